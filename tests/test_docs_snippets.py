"""The Python snippets of docs/models.md run as pasted, each in a fresh process.

A snippet may use the bundled SmolLM2 model and files it writes itself; the one path a reader
supplies, the placeholder ``HF_FOLDER_PLACEHOLDER``, is replaced by a small model folder made here.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import llaisys

DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"
HF_FOLDER_PLACEHOLDER = "path/to/Qwen2.5-0.5B-Instruct"


def python_blocks(text: str) -> list[str]:
    """The code of each fenced ```python block of a Markdown ``text``, in order."""
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M)]


BLOCKS = python_blocks(DOC.read_text(encoding="utf-8"))


def test_the_doc_has_snippets_and_its_placeholder():
    assert len(BLOCKS) >= 2
    assert sum(HF_FOLDER_PLACEHOLDER in b for b in BLOCKS) == 1  # what the test below replaces is there


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A small random-weight Qwen2 folder as transformers saves it."""
    from conftest import random_hf_model

    folder = tmp_path_factory.mktemp("qwen2")
    random_hf_model("qwen2", 0, tie_word_embeddings=True).save_pretrained(folder)
    return folder


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_snippet_runs(index, smollm2_path, hf_folder, tmp_path):
    code = BLOCKS[index].replace(HF_FOLDER_PLACEHOLDER, hf_folder.as_posix())
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(llaisys.__file__))}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 0, f"docs/models.md python block {index} failed:\n{code}\n{out.stderr[-3000:]}"
