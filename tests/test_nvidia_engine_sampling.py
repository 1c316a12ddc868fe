"""The serving engine samples on the nvidia device (simulated on the CPU here): greedy rows and
plain temperature/top-k/top-p draws are picked there and only their ids cross to the host;
penalized, grammar-masked and logprobs rows have their rows copied and go through
``sample_batch``. A small random-weight Llama (the interpreter is slow), and the bundled model
for a grammar (it needs a tokenizer)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import random_hf_model

from llaisys.engine import LLMEngine, engine as engine_module
from llaisys.engine.grammar import GrammarCompiler, GuidedConfig
from llaisys.generation import GenerationConfig, Sampler
from llaisys.models import load_model
from llaisys.runtime import get_runtime

VOCAB = 320
OPTIONS = {"kv_cache_tokens": 256, "block_size": 16}
PROMPTS = [[1, 5, 9, 13, 2], [1, 7], [1, 30, 31, 32, 33, 34, 35]]
SAMPLED = GenerationConfig(max_new_tokens=6, temperature=0.9, top_k=40, top_p=0.8, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def models(nvidia_device, tmp_path_factory):
    """A random-weight Llama, 2 layers: (cpu, nvidia)."""
    path = tmp_path_factory.mktemp("sampling-llama")
    random_hf_model("llama", 13, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2).save_pretrained(path)
    return load_model(path), load_model(path, device=nvidia_device)


@pytest.fixture
def d2h(models, monkeypatch):
    """Bytes copied from the nvidia device to the host (index checks off: they copy indices)."""
    monkeypatch.setenv("LLAISYS_NVIDIA_CHECK", "0")
    backend = get_runtime(models[1].device).backend
    copied = [0]
    original = backend.copy_d2h

    def count(index, dst, src, nbytes):
        copied[0] += nbytes
        return original(index, dst, src, nbytes)

    monkeypatch.setattr(backend, "copy_d2h", count)
    return copied


@pytest.fixture
def calls(monkeypatch):
    """Rows sampled on the device and rows copied to the host, per call."""
    from llaisys.kernels.nvidia import sampling

    seen = {"device": [], "host": []}
    for name, key in (("sample", "device"), ("rows_to_host", "host")):
        original = getattr(sampling, name)

        def spy(logits, *args, _original=original, _key=key, **kwargs):
            rows = kwargs["rows"] if _key == "device" else args[0]
            seen[_key].append(len(rows))
            return _original(logits, *args, **kwargs)

        monkeypatch.setattr(sampling, name, spy)
    return seen


def test_greedy_equals_the_cpu_and_only_ids_cross(models, d2h, calls, monkeypatch):
    cpu_model, nv_model = models
    config = GenerationConfig(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    want = [r.token_ids for r in LLMEngine(cpu_model, **OPTIONS).generate(PROMPTS, config)]
    assert LLMEngine(cpu_model, **OPTIONS)._device_sampling is None  # the CPU: host logits as before
    got = [r.token_ids for r in LLMEngine(nv_model, **OPTIONS).generate(PROMPTS, config)]
    assert got == want
    assert d2h[0] == 8 * 15  # an int64 id per token, nothing else
    assert calls["host"] == [] and sum(calls["device"]) == 15
    monkeypatch.setenv("LLAISYS_NVIDIA_SAMPLING", "0")  # off: every row's logits cross, as before
    d2h[0] = 0
    off = [r.token_ids for r in LLMEngine(nv_model, **OPTIONS).generate(PROMPTS, config)]
    assert off == want and d2h[0] == 4 * VOCAB * 15


def _kept(model, prompt: list[int], tokens: list[int], config: GenerationConfig) -> list[np.ndarray]:
    """Per generated position, the ids the host sampler's filters keep (teacher-forced logits of ``model``)."""
    logits = model.forward(prompt + tokens[:-1], model.new_cache(64), all_logits=True)  # (S + G - 1, V)
    process = Sampler(config).process
    return [np.flatnonzero(np.isfinite(process(logits[len(prompt) - 1 + i]))) for i in range(len(tokens))]


def test_seeded_sampling_is_reproducible_and_within_top_p(models, calls, monkeypatch):
    _, nv_model = models

    def refuse(*args, **kwargs):
        raise AssertionError("a plain sampled request went to the host sampler")

    monkeypatch.setattr(engine_module, "sample_batch", refuse)
    runs = [LLMEngine(nv_model, **OPTIONS).generate([PROMPTS[0]], SAMPLED)[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 6
    for token, kept in zip(runs[0], _kept(nv_model, PROMPTS[0], runs[0], SAMPLED)):
        assert token in kept and len(kept) < VOCAB
    # batched beside others, a request draws from its own generator: the same tokens as alone
    others = [SAMPLED.replace(seed=1), SAMPLED.replace(temperature=0.0)]
    together = LLMEngine(nv_model, **OPTIONS).generate(PROMPTS, [SAMPLED, *others])
    assert together[0].token_ids == runs[0]
    assert calls["host"] == [] and sum(calls["device"]) == 2 * 6 + 3 * 6


def test_penalized_and_logprobs_rows_cross_and_match_the_cpu(models, d2h, calls):
    cpu_model, nv_model = models
    penalized = GenerationConfig(max_new_tokens=4, temperature=0.0, repetition_penalty=1.5, ignore_eos=True)
    logprobs = GenerationConfig(max_new_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
    configs = [penalized, logprobs, SAMPLED.replace(max_new_tokens=4)]
    got = LLMEngine(nv_model, **OPTIONS).generate(PROMPTS, configs)
    want = LLMEngine(cpu_model, **OPTIONS).generate(PROMPTS[:2], configs[:2])
    assert [r.token_ids for r in got[:2]] == [r.token_ids for r in want]
    assert calls["host"] == [2] * 4 and calls["device"] == [1] * 4
    assert d2h[0] == 4 * (2 * 4 * VOCAB + 8)  # per step: 2 rows of F32 logits and one id
    alone = LLMEngine(nv_model, **OPTIONS).generate(PROMPTS[1:2], logprobs)[0]  # every row to the host
    assert alone.token_ids == want[1].token_ids and calls["host"][-4:] == [1] * 4


def test_mixed_batch_with_a_grammar(nvidia_device, smollm2_model, smollm2_path, calls):
    """The bundled model: a penalized request, a grammar-constrained one and a device-sampled one."""
    nv_model = load_model(smollm2_path, device=nvidia_device)
    tok = nv_model.tokenizer
    grammar = GrammarCompiler(tok, nv_model.eos_token_ids).compile("regex", "[0-9]{2,4}")
    prompts = ["The year is", "Once upon a time", "Paris is"]
    penalized = GenerationConfig(max_new_tokens=2, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
    configs = [penalized, GuidedConfig(max_new_tokens=2, grammar=grammar, temperature=0.7, seed=1),
               GenerationConfig(max_new_tokens=2, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True)]
    got = LLMEngine(nv_model, kv_cache_tokens=256).generate(prompts, configs)
    cpu = LLMEngine(smollm2_model, kv_cache_tokens=256).generate(prompts[:1], penalized)[0]
    assert got[0].token_ids == cpu.token_ids
    assert re.fullmatch("[0-9]{1,4}", got[1].text), got[1].text
    assert len(got[2].token_ids) == 2 and all(0 <= t < nv_model.config.vocab_size for t in got[2].token_ids)
    assert calls["device"] == [1] * 2  # the sampled request's rows: ids only
    assert sum(calls["host"]) == len(got[0].token_ids) + len(got[1].token_ids)
