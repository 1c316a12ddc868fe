"""The whole path on the nvidia backend (simulated on the CPU here: its own ops, Triton kernels
interpreted, its allocator): the bundled SmolLM2 model generates the CPU's greedy tokens in
F32, and the serving engine's batch equals single runs. Few tokens: the interpreter is slow."""
from __future__ import annotations

import pytest

from llaisys.engine import LLMEngine
from llaisys.generation import GenerationConfig, generate
from llaisys.models import load_model

GREEDY = GenerationConfig(max_new_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def nvidia_model(nvidia_device, smollm2_path):
    """The bundled Q4_1 GGUF on the nvidia device (F32 activations; weights dequantized once)."""
    return load_model(smollm2_path, device=nvidia_device)


def test_weights_live_on_the_device(nvidia_model):
    assert str(nvidia_model.device) == "nvidia:0"
    assert nvidia_model.params.layers[0].qkv.device == nvidia_model.device


def test_greedy_tokens_equal_the_cpu(nvidia_model, smollm2_model):
    prompt = "The capital of France is"
    want = generate(smollm2_model, prompt, GREEDY)
    got = generate(nvidia_model, prompt, GREEDY)
    assert got.token_ids == want.token_ids, (got.text, want.text)


def test_engine_batch_equals_single_runs(nvidia_model, smollm2_model):
    prompts = ["1, 2, 3, 4,", "def fibonacci(n):"]
    config = GenerationConfig(max_new_tokens=2, temperature=0.0)
    options = {"kv_cache_tokens": 256, "block_size": 16}
    together = LLMEngine(nvidia_model, **options).generate(prompts, config)
    alone = [LLMEngine(nvidia_model, **options).generate([p], config)[0] for p in prompts]
    cpu = LLMEngine(smollm2_model, **options).generate(prompts, config)
    for t, a, c in zip(together, alone, cpu):
        assert t.token_ids == a.token_ids == c.token_ids, (t.text, a.text, c.text)
