"""``llaisys generate --image`` and ``/image`` in ``llaisys chat`` on a random-weight SmolVLM
folder: the text equals the library's greedy reply to the same image (which
tests/test_vision_models.py checks against transformers); bad images are one clear error."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import random_image
from llaisys.engine import LLMEngine, chat
from llaisys.generation import GenerationConfig
from llaisys.models import load_model

GREEDY = GenerationConfig(max_new_tokens=6, temperature=0.0)


def llaisys(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llaisys", *args], input=stdin, capture_output=True, text=True,
                          timeout=180)


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    image = random_image(np.random.default_rng(7), 90, 60)
    path = tmp_path_factory.mktemp("images") / "picture.png"
    image.save(path)
    return path, image


def test_generate_with_an_image(tiny_smolvlm, picture):
    path, image = picture
    model = load_model(str(tiny_smolvlm))
    want = chat(model, [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": "What is this?"}]}], GREEDY).text
    proc = llaisys("generate", "What is this?", "--model", str(tiny_smolvlm), "--image", str(path),
                   "--max-new-tokens", "6", "--greedy")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == want


def test_chat_attaches_an_image(tiny_smolvlm, picture):
    path, image = picture
    model = load_model(str(tiny_smolvlm))
    engine = LLMEngine(model)
    first = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}]}]
    reply = chat(engine, first, GREEDY).text
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}]
    want = [reply, chat(engine, second, GREEDY).text]
    proc = llaisys("chat", "--model", str(tiny_smolvlm), "--max-new-tokens", "6", "--greedy",
                   stdin=f"/image {path}\nHi\nMore?\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == want
    assert "attached" in proc.stderr


def test_bad_images_are_one_clear_error(tiny_smolvlm, tmp_path, smollm2_path):
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image at all")
    proc = llaisys("generate", "x", "--model", str(tiny_smolvlm), "--image", str(junk))
    assert proc.returncode == 2 and "junk.png" in proc.stderr and "Traceback" not in proc.stderr
    proc = llaisys("generate", "x", "--model", str(tiny_smolvlm), "--image", str(tmp_path / "absent.png"))
    assert proc.returncode == 2 and "cannot read it" in proc.stderr
    picture = tmp_path / "ok.png"
    random_image(np.random.default_rng(0), 8, 8).save(picture)
    proc = llaisys("generate", "x", "--model", str(smollm2_path), "--image", str(picture))
    assert proc.returncode == 2 and "no vision encoder" in proc.stderr
    proc = llaisys("chat", "--model", str(smollm2_path), stdin=f"/image {picture}\n")
    assert proc.returncode == 0 and "no vision encoder" in proc.stderr
