"""One model shared by several threads: each caller gets the tokens it would get alone.

A model's forward passes share its work buffers; the model serialises them with a lock. The
reference is the same requests run one after another on the same model."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import random_hf_model
from llaisys.engine import generate
from llaisys.generation import GenerationConfig
from llaisys.models import load_model

THREADS = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random-weight Llama folder without a tokenizer: prompts are token ids."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    random_hf_model("llama", seed=3, num_hidden_layers=3, max_position_embeddings=1024).save_pretrained(folder)
    return load_model(folder)


def _prompts(vocab: int) -> list[list[int]]:
    """Different ids and lengths per thread, one longer than a prefill chunk (256 tokens)."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, size=n).tolist() for n in (5, 17, 300, 40)][:THREADS]


def _in_threads(work, n: int) -> list:
    """``work(i)`` for i < n, each in its own thread started together; results by index."""
    results: list = [None] * n
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = work(i)
        except BaseException as exc:  # noqa: BLE001 - reported below with its thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_threads_generating_on_one_model_match_sequential_runs(tiny_model):
    prompts = _prompts(tiny_model.config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    want = [generate(tiny_model, p, cfg).token_ids for p in prompts]
    for _ in range(3):
        got = _in_threads(lambda i: generate(tiny_model, prompts[i], cfg).token_ids, THREADS)
        assert got == want


def test_threads_forwarding_on_one_model_get_their_own_logits(tiny_model):
    prompts = _prompts(tiny_model.config.vocab_size)
    want = [tiny_model.forward(p, tiny_model.new_cache(512), all_logits=True) for p in prompts]

    def steps(i: int) -> np.ndarray:
        cache = tiny_model.new_cache(512)
        rows = [tiny_model.forward([t], cache) for t in prompts[i]]  # one token at a time: many lock turns
        return np.stack(rows)

    got = _in_threads(steps, THREADS)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
