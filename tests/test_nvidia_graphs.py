"""Decoding steps replayed from graphs, and greedy tokens picked on the device, on the nvidia
backend (simulated on the CPU here, where ``graphs.SimulatedGraph`` stands in for a CUDA graph
and replays the recorded plan; on a GPU machine the same tests capture real CUDA graphs).

A small random-weight Llama (2 layers, the interpreter is slow) on the CPU and on nvidia:
graphs on give the tokens and logits of graphs off and of the CPU; one capture per batch
bucket used; padded batches return only their own rows."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_hf_model

from llaisys.engine import generate

from llaisys.generation import GenerationConfig
from llaisys.engine.stream import engine_for
from llaisys.models import load_model
from llaisys.models.paged_cache import TokenBatch

VOCAB = 320


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs-llama")
    random_hf_model("llama", 11, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cpu_model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def nv_model(nvidia_device, model_dir):
    return load_model(model_dir, device=nvidia_device)


def _graph_caches(model) -> list:
    return [g for g in model.runner._graph_caches.values() if g is not None]


def test_single_sequence_decode_with_graphs_equals_without_and_the_cpu(nv_model, cpu_model, monkeypatch):
    prompt = [1, 17, 42, 99, 5]
    config = GenerationConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    want = generate(cpu_model, prompt, config).token_ids
    monkeypatch.setenv("LLAISYS_NVIDIA_GRAPHS", "0")
    before = len(_graph_caches(nv_model))
    off = generate(nv_model, prompt, config).token_ids
    assert len(_graph_caches(nv_model)) == before  # graphs off: none made
    monkeypatch.delenv("LLAISYS_NVIDIA_GRAPHS")
    kept = engine_for(nv_model, len(prompt), config.max_new_tokens)
    on = generate(kept, prompt, config).token_ids
    assert on == off == want
    graphs = nv_model.runner._graph_caches[kept.cache]  # captured once, replayed at every decoding step
    assert (graphs.captures, graphs.replays) == (1, len(want) - 1)


def test_single_sequence_graph_logits_equal_the_plain_pass(nv_model, monkeypatch):
    prompt = [3, 1, 4, 1, 5, 9]
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("LLAISYS_NVIDIA_GRAPHS", setting)
        cache = nv_model.new_cache(32)
        nv_model.forward(prompt, cache)
        runs[setting] = [nv_model.forward([t], cache) for t in (2, 6, 5)]  # (V,) each
        assert cache.length == len(prompt) + 3
    from llaisys.runtime import get_runtime

    if get_runtime(nv_model.device).backend.simulate:
        np.testing.assert_array_equal(np.stack(runs["1"]), np.stack(runs["0"]))  # the same kernels, the same bits
    else:  # (cuBLAS may pick another algorithm inside a capture)
        np.testing.assert_allclose(np.stack(runs["1"]), np.stack(runs["0"]), rtol=1e-5, atol=1e-5)


def _decode_steps(model, sizes: list[int]) -> tuple[list[np.ndarray], object]:
    """Prefill 4 sequences, then decoding steps over the first ``size`` of them for each size;
    the logits (size, V) of each step."""
    cache = model.new_paged_cache(num_blocks=16, block_size=8)
    prompts = [[1, 5, 9, 13, 2], [1, 7], [1, 30, 31], [1, 200, 201, 202]]
    tables = [[2 * b, 2 * b + 1] for b in range(4)]
    model.forward_batch(TokenBatch.build([(p, 0, t, True) for p, t in zip(prompts, tables)], 8, cache.max_blocks),
                        cache)
    lengths = [len(p) for p in prompts]
    out = []
    for step, size in enumerate(sizes):
        chunks = [([(11 * step + b) % VOCAB], lengths[b], tables[b], True) for b in range(size)]
        out.append(model.forward_batch(TokenBatch.build(chunks, 8, cache.max_blocks), cache))
        for b in range(size):
            lengths[b] += 1
    return out, cache


def test_batched_decode_captures_once_per_bucket(nv_model, cpu_model, monkeypatch):
    sizes = [3, 1, 4, 3, 2, 1, 4]  # buckets 4, 1, 2
    monkeypatch.setenv("LLAISYS_NVIDIA_GRAPHS", "0")
    eager, _ = _decode_steps(nv_model, sizes)
    monkeypatch.delenv("LLAISYS_NVIDIA_GRAPHS")
    graphed, cache = _decode_steps(nv_model, sizes)
    cpu, _ = _decode_steps(cpu_model, sizes)
    graphs = nv_model.runner._graph_caches[cache]
    assert graphs.captures == 3 and len(graphs) == 3
    assert graphs.replays == len(sizes)
    assert {k for k in cache.passes if k[0] == k[1]} >= {(4, 4, 4), (1, 1, 1), (2, 2, 2)}
    assert (3, 3, 3) not in cache.passes  # 3 sequences ran padded to the bucket of 4
    for size, g, e, c in zip(sizes, graphed, eager, cpu):
        assert g.shape == (size, VOCAB)
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)  # padding may change cuBLAS's (here torch's) M
        np.testing.assert_allclose(g, c, rtol=1e-4, atol=1e-4)
        assert (g.argmax(-1) == c.argmax(-1)).all()


def test_greedy_generation_picks_tokens_on_the_device(nv_model, cpu_model, monkeypatch):
    from llaisys.kernels.nvidia import sampling

    calls = {"sample": 0, "rows_to_host": 0}
    for name in calls:
        original = getattr(sampling, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(sampling, name, spy)
    prompt = [1, 250, 3, 77]
    config = GenerationConfig(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    got = generate(nv_model, prompt, config).token_ids
    assert got == generate(cpu_model, prompt, config).token_ids
    assert calls == {"sample": 5, "rows_to_host": 0}  # every pick on the device: ids only cross
    penalized = config.replace(repetition_penalty=1.3)  # needs the logits on the host
    calls.update(sample=0, rows_to_host=0)
    assert generate(nv_model, prompt, penalized).token_ids == generate(cpu_model, prompt, penalized).token_ids
    assert calls == {"sample": 0, "rows_to_host": 5}


def test_pad_decode_batch_repeats_the_first_sequence():
    from llaisys.models.passes import pad_decode_batch

    batch = TokenBatch.build([([5], 3, [0], True), ([6], 7, [1], True), ([8], 1, [2], False)], 8, 2)
    padded = pad_decode_batch(batch, 4)
    assert padded.token_ids.tolist() == [5, 6, 8, 5] and padded.positions.tolist() == [3, 7, 1, 3]
    assert padded.slots.tolist() == [3, 15, 17, 3] and padded.context_lens.tolist() == [4, 8, 2, 4]
    assert padded.block_tables.tolist() == [[0, -1], [1, -1], [2, -1], [0, -1]]
    assert padded.query_starts.tolist() == [0, 1, 2, 3, 4] and padded.logit_rows.tolist() == [0, 1, 0, 0]
    assert pad_decode_batch(padded, 4) is padded
