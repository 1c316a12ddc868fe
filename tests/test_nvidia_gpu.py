"""The nvidia backend on a real GPU (marked ``gpu``; skipped elsewhere, saying why): the bundled
model's greedy tokens equal the CPU's in F32; random-weight Qwen2 and Llama logits against
transformers on the same GPU in F32, and in BF16 no further from transformers' F32 than its own
BF16 is; the serving engine's batch equal to single runs; a decoding step replayed from a CUDA
graph equal to the step run eagerly, and the decoder's own graphs (single sequence and engine
batches) giving the tokens of graphs off and the CPU. (Where torch sees a GPU, the
``nvidia_device`` fixture of the other nvidia tests starts the real backend too.)"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_hf_model

pytestmark = pytest.mark.gpu


def _why_not() -> str | None:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as exc:
        return f"needs torch and triton with CUDA (pip install 'llaisys[cuda]'): {exc.name} is missing"
    if not torch.cuda.is_available():
        return f"needs an NVIDIA GPU: torch {torch.__version__} sees none"
    from llaisys.runtime.backends import available_backends, get_backend
    from llaisys.runtime.device import DeviceType

    if "nvidia" in available_backends() and get_backend(DeviceType.NVIDIA).simulate:
        return "the nvidia backend of this process runs simulated (LLAISYS_NVIDIA_SIMULATE was set)"
    return None


@pytest.fixture(scope="module")
def gpu() -> str:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    return "nvidia:0"


@pytest.fixture(scope="module")
def gpu_model(gpu, smollm2_path):
    from llaisys.models import load_model

    return load_model(smollm2_path, device=gpu)  # F32 activations, TF32 off


def test_bundled_model_greedy_tokens_equal_the_cpu(gpu_model, smollm2_model):
    from llaisys.engine import generate
    from llaisys.generation import GenerationConfig

    config = GenerationConfig(max_new_tokens=24, temperature=0.0)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        assert generate(gpu_model, prompt, config).token_ids == generate(smollm2_model, prompt, config).token_ids


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_random_weight_logits_match_transformers_on_the_gpu(gpu, tmp_path, arch):
    import torch

    from llaisys.models import load_model

    hf = _random_model(arch)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, device=gpu, dtype="f32")
    ids = _prompt()
    got = model.forward(ids, model.new_cache(64), all_logits=True)  # (S, V)
    with torch.no_grad():
        want = hf.to("cuda", torch.float32)(torch.tensor([ids], device="cuda")).logits[0].cpu().numpy()
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_bf16_logits_err_no_more_than_transformers_bf16(gpu, tmp_path, arch):
    """BF16 rounds differently in each engine, so two BF16 runs differ by about the sum of their
    errors; each is measured against transformers in F32 on the same bf16-rounded weights, and
    ours must stay within 1.5x of transformers' own BF16 error (max and mean)."""
    import torch
    import transformers

    from llaisys.models import load_model

    _random_model(arch).to(torch.bfloat16).save_pretrained(tmp_path)
    ids = _prompt()
    model = load_model(tmp_path, device=gpu, dtype="bf16")
    ours = model.forward(ids, model.new_cache(64), all_logits=True)  # (S, V)
    runs = {}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).to("cuda").eval()
        with torch.no_grad():
            runs[name] = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    our_err, their_err = np.abs(ours - runs["f32"]), np.abs(runs["bf16"] - runs["f32"])
    assert our_err.max() <= 1.5 * their_err.max(), (our_err.max(), their_err.max())
    assert our_err.mean() <= 1.5 * their_err.mean(), (our_err.mean(), their_err.mean())


def _random_model(arch: str):
    return random_hf_model(arch, 7, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=2)


def _prompt() -> list[int]:
    return [int(i) for i in np.random.default_rng(3).integers(0, 512, 40)]


def test_engine_batch_equals_single_runs_on_the_gpu(gpu_model):
    from llaisys.engine import LLMEngine
    from llaisys.generation import GenerationConfig

    prompts = ["1, 2, 3, 4,", "def fibonacci(n):", "The three primary colours are", "Once upon a time,"]
    config = GenerationConfig(max_new_tokens=12, temperature=0.0)
    together = LLMEngine(gpu_model, kv_cache_tokens=4096).generate(prompts, config)
    for prompt, out in zip(prompts, together):
        assert LLMEngine(gpu_model, kv_cache_tokens=4096).generate([prompt], config)[0].token_ids == out.token_ids


def test_decoding_step_replayed_from_a_cuda_graph(gpu_model):
    from llaisys.backends.nvidia.graphs import GraphCache
    from llaisys.models.paged_cache import TokenBatch
    from llaisys.runtime import get_runtime

    model = gpu_model
    cache = model.new_paged_cache(num_blocks=32, block_size=16)
    prompts = [[1, 504, 3458, 314], [1, 9, 2]]
    prefill = TokenBatch.build([(p, 0, [2 * b, 2 * b + 1], True) for b, p in enumerate(prompts)], 16, cache.max_blocks)
    model.forward_batch(prefill, cache)
    step = TokenBatch.build([([42], len(p), [2 * b, 2 * b + 1], True) for b, p in enumerate(prompts)], 16,
                            cache.max_blocks)
    eager = model.forward_batch(step, cache)  # (2, V); records the pass of shape (2, 2, 2) (and replays its graph)
    recorded = cache.passes[(2, 2, 2)]
    rt = get_runtime(model.device)
    graphs = GraphCache(rt.backend, rt.index)
    for _ in range(3):  # captured once, then replayed
        recorded.ws.ids.load(step.token_ids)
        recorded.ws.pos.load(step.positions)
        recorded.idx.load(step)
        graphs.run((2, 2, 2), recorded.plan.run)
        np.testing.assert_array_equal(recorded.logits.numpy().astype(np.float32), eager)
    assert graphs.captures == 1


def test_decoding_with_cuda_graphs_equals_eager_and_the_cpu(gpu_model, smollm2_model, monkeypatch):
    """The decoder's own graphs (one per cache and bucket): greedy tokens and engine batches
    with graphs on equal those with graphs off, and the CPU's (F32)."""
    from llaisys.engine import LLMEngine, generate
    from llaisys.generation import GenerationConfig
    from llaisys.engine.stream import engine_for

    config = GenerationConfig(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = "The capital of France is"
    kept = engine_for(gpu_model, 64, config.max_new_tokens)
    on = generate(kept, prompt, config).token_ids
    graphs = gpu_model.runner._graph_caches[kept.cache]
    assert (graphs.captures, graphs.replays) == (1, 15)
    assert on == generate(smollm2_model, prompt, config).token_ids
    prompts = ["1, 2, 3, 4,", "def fibonacci(n):", "The three primary colours are"]  # 3 sequences: bucket 4
    with_graphs = LLMEngine(gpu_model, kv_cache_tokens=1024).generate(prompts, config)
    monkeypatch.setenv("LLAISYS_NVIDIA_GRAPHS", "0")
    assert generate(gpu_model, prompt, config).token_ids == on
    without = LLMEngine(gpu_model, kv_cache_tokens=1024).generate(prompts, config)
    assert [r.token_ids for r in with_graphs] == [r.token_ids for r in without]
