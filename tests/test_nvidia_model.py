"""The whole path on the nvidia backend (simulated on the CPU here: its own ops, Triton kernels
interpreted, its allocator): the bundled SmolLM2 model generates the CPU's greedy tokens in
F32 (decoding steps replayed from graphs, tokens picked on the device), and the serving
engine's batch equals single runs and the CPU on a small random-weight model of SmolLM2's
head layout (3 query heads per KV head of 64). Few tokens: the interpreter is slow."""
from __future__ import annotations

import pytest

from conftest import random_hf_model

from llaisys.engine import LLMEngine, generate
from llaisys.generation import GenerationConfig
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


@pytest.fixture(scope="module")
def small_models(nvidia_device, tmp_path_factory):
    """A random-weight Llama with SmolLM2's head layout (G = 3, head dim 64), 2 layers: (cpu, nvidia)."""
    path = tmp_path_factory.mktemp("small-llama")
    random_hf_model("llama", 5, vocab_size=384, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=3, num_key_value_heads=1).save_pretrained(path)
    return load_model(path), load_model(path, device=nvidia_device)


def test_engine_batch_equals_single_runs(small_models):
    cpu_model, nv_model = small_models
    prompts = [[1, 5, 9, 13, 2], [1, 7], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46]]
    config = GenerationConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    options = {"kv_cache_tokens": 256, "block_size": 16}
    together = LLMEngine(nv_model, **options).generate(prompts, config)  # decoding batches of 3 (bucket 4)
    alone = [LLMEngine(nv_model, **options).generate([p], config)[0] for p in prompts]
    cpu = LLMEngine(cpu_model, **options).generate(prompts, config)
    for t, a, c in zip(together, alone, cpu):
        assert t.token_ids == a.token_ids == c.token_ids
        assert len(t.token_ids) == 6
