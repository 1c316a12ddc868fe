"""moe_mlp on the nvidia backend (Triton, interpreted here; on the GPU where torch sees one)
against the CPU's NumPy reference (``kernels/cpu/moe.py``: ``route`` and ``moe_mlp_numpy``):
the device routing picks the CPU's experts (ties included) with its weights, the experts' sum
is within float32 rounding of the reference in F32 and within a stated tolerance in BF16; a
random Qwen3-MoE model decodes the CPU's greedy tokens with the op as a device kernel inside
the decoding graph (the simulated stand-in here)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from llaisys import DataType, Tensor, ops
from llaisys.engine import generate
from llaisys.generation import GenerationConfig
from llaisys.engine.stream import engine_for
from llaisys.kernels import find_kernel
from llaisys.kernels.cpu import moe as cpu_moe
from llaisys.models import load_model

D, WIDTH = 64, 32  # hidden size, an expert's MLP width
BF16_TOLERANCE = 0.02  # of the output's largest magnitude (measured: <= 1.3 %, the interpreter truncating)
TIES = np.array([[0.5] * 8, [1.0, 2.0, 2.0, 2.0, 0.0, 2.0, 1.0, 1.0], [-90.0] * 4 + [3.0] * 4,
                 np.linspace(-200, 80, 8), [0.0] * 7 + [1e-7], [3.0, 3.0, -1.0, 3.0, 3.0, 3.0, 3.0, 3.0]], np.float32)


@pytest.fixture
def nv_moe(nvidia_device):
    """The nvidia kernels' module (imported once the backend has set Triton up)."""
    from llaisys.kernels.nvidia import moe

    return moe


def _inputs(rng, n: int, e: int, logits: np.ndarray | None = None) -> list[np.ndarray]:
    """(h (N, D), router logits (N, E), gate (E*I, D), up (E*I, D), down (E*D, I)) float64."""
    shapes = ((e * WIDTH, D), (e * WIDTH, D), (e * D, WIDTH))
    return [rng.standard_normal((n, D)), rng.standard_normal((n, e)) * 3 if logits is None else logits,
            *(rng.standard_normal(s) * 0.2 for s in shapes)]


def _reference(cpu: list[Tensor], dtype: DataType, top_k: int, norm: bool) -> np.ndarray:
    """The CPU's NumPy path on the CPU tensors (N, D), as float64."""
    out = Tensor.empty(cpu[0].shape, dtype)
    cpu_moe.moe_mlp_numpy((out,), tuple(cpu), {"top_k": top_k, "norm_topk_prob": norm})
    return out.numpy().astype(np.float64)


def _on_device(cpu: list[Tensor], dtype: DataType, top_k: int, norm: bool, device: str) -> np.ndarray:
    """moe_mlp of the CPU tensors' values on ``device``; h and out row-strided views (the left
    half of wider rows), as the decoder's work buffers may be."""
    n = cpu[0].shape[0]
    wide = Tensor.from_numpy(np.concatenate([cpu[0].numpy()] * 2, axis=1), dtype=cpu[0].dtype, device=device)
    rest = [Tensor.from_numpy(t.numpy(), dtype=t.dtype, device=device) for t in cpu[1:]]
    out = Tensor.zeros((n, 2 * D), dtype, device)
    ops.moe_mlp(out.slice(1, 0, D), wide.slice(1, 0, D), *rest, top_k, norm)
    got = out.numpy().astype(np.float64)
    assert not got[:, D:].any()  # nothing written past the view
    return got[:, :D]


def test_registered_for_the_weights_a_loaded_model_has(nv_moe):
    for dt in (DataType.F32, DataType.F16, DataType.BF16):
        assert find_kernel("moe_mlp", "nvidia", dt) is nv_moe.moe_mlp
        for wt in (DataType.Q4_0, DataType.Q8_0, DataType.Q4_K, DataType.Q6_K):
            assert find_kernel("moe_mlp", "nvidia", dt, weight_dtype=wt) is nv_moe.moe_mlp
    for wt in (DataType.F16, DataType.BF16):
        assert find_kernel("moe_mlp", "nvidia", DataType.F32, weight_dtype=wt) is nv_moe.moe_mlp


@pytest.mark.parametrize("norm", [True, False])
def test_routing_picks_the_cpus_experts_and_weights(nv_moe, nvidia_device, norm):
    import torch

    rng = np.random.default_rng(5)
    logits = np.concatenate([TIES, (rng.standard_normal((11, 8)) * 4).astype(np.float32)])  # (17, 8)
    device = Tensor.from_numpy(logits, device=nvidia_device)
    view = nv_moe.tv(device)  # (17, 8) torch view of the device tensor
    for top_k in (1, 2, 3, 8):
        ids = torch.empty(17 * top_k, dtype=torch.int32, device=view.device)
        wts = torch.empty(17 * top_k, dtype=torch.float32, device=view.device)
        nv_moe.route(ids, wts, view, top_k, norm)
        want_ids, want_wts = cpu_moe.route(logits, top_k, norm)
        got_ids, got_wts = _host(ids, nvidia_device, DataType.I32), _host(wts, nvidia_device, DataType.F32)
        np.testing.assert_array_equal(got_ids.reshape(17, top_k), want_ids, err_msg=f"top_k {top_k}")
        np.testing.assert_allclose(got_wts.reshape(17, top_k), want_wts, rtol=1e-6, atol=1e-7)


def _host(values, device: str, dtype: DataType) -> np.ndarray:
    """A device torch tensor's values on the host, through a llaisys tensor's copy."""
    out = Tensor.empty(tuple(values.shape), dtype, device)
    from llaisys.kernels.nvidia._common import tv

    tv(out).copy_(values)
    return out.numpy()


SHAPES = [(1, 4, 1, True), (1, 8, 2, False), (3, 5, 3, True), (5, 8, 2, False), (17, 8, 3, True),
          (17, 6, 1, False), (17, 4, 4, True)]  # (N, E, top_k, norm_topk_prob)


@pytest.mark.parametrize("n,e,top_k,norm", SHAPES)
def test_f32_within_float32_rounding_of_the_reference(nvidia_device, nv_moe, n, e, top_k, norm):
    rng = np.random.default_rng(100 * n + 10 * e + top_k)
    cpu = [Tensor.from_numpy(a, dtype=DataType.F32) for a in _inputs(rng, n, e)]
    want = _reference(cpu, DataType.F32, top_k, norm)
    got = _on_device(cpu, DataType.F32, top_k, norm, nvidia_device)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("top_k", [1, 3])
def test_f32_tied_router_logits(nvidia_device, nv_moe, top_k):
    rng = np.random.default_rng(7)
    cpu = [Tensor.from_numpy(a, dtype=DataType.F32) for a in _inputs(rng, len(TIES), 8, TIES)]
    want = _reference(cpu, DataType.F32, top_k, True)
    got = _on_device(cpu, DataType.F32, top_k, True, nvidia_device)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("n,e,top_k,norm", SHAPES[1::2])
def test_bf16_within_tolerance_of_the_reference(nvidia_device, nv_moe, n, e, top_k, norm):
    """BF16 activations and experts (the reference computes in F32 from the same BF16 values and
    rounds once; the kernel rounds the SwiGLU output to BF16 for the tensor cores)."""
    rng = np.random.default_rng(200 + n + e)
    cpu = [Tensor.from_numpy(a, dtype=DataType.BF16) for a in _inputs(rng, n, e)]
    want = _reference(cpu, DataType.BF16, top_k, norm)
    got = _on_device(cpu, DataType.BF16, top_k, norm, nvidia_device)
    np.testing.assert_allclose(got, want, rtol=BF16_TOLERANCE, atol=BF16_TOLERANCE * np.abs(want).max())


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "BF16"])
def test_f32_activations_with_quantized_or_half_experts(nvidia_device, nv_moe, kind, f32_quant_math):
    """The weights a GGUF (block formats) or a BF16 folder loaded in F32 gives: dequantized once
    on the device, then the F32 kernel; against the CPU kernels on the same stored weights (in
    the f32 arithmetic, which the device's dequantized weights follow)."""
    import gguf

    rng = np.random.default_rng(9)
    h, logits, *floats = _inputs(rng, 5, 8)
    if kind == "BF16":
        experts = [Tensor.from_numpy(w, dtype=DataType.BF16) for w in floats]
    else:
        qtype = gguf.GGMLQuantizationType[kind]
        experts = [Tensor.from_raw(gguf.quants.quantize(w.astype(np.float32), qtype), kind) for w in floats]
    cpu = [Tensor.from_numpy(h, dtype=DataType.F32), Tensor.from_numpy(logits, dtype=DataType.F32), *experts]
    want = _reference(cpu, DataType.F32, 2, True)
    on_device = [t.to(nvidia_device) for t in cpu]
    for w in on_device[2:]:
        w.freeze()  # as a model's weights: dequantized once, kept with the weight
    out = Tensor.empty((5, D), DataType.F32, nvidia_device)
    ops.moe_mlp(out, *on_device, 2, True)
    assert on_device[2].dtype is DataType[kind]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ---- a model -----------------------------------------------------------------------------
VOCAB = 320


@pytest.fixture(scope="module")
def moe_models(nvidia_device, tmp_path_factory):
    """A random Qwen3-MoE (2 layers, the second routed over 6 experts, 2 per token) saved to a
    folder: (CPU model, nvidia model)."""
    from test_qwen3_moe import random_qwen3_moe

    hf = random_qwen3_moe(3, width=WIDTH, layers=2, experts=6, top_k=2, vocab=VOCAB)
    folder = tmp_path_factory.mktemp("nvidia-qwen3-moe")
    hf.save_pretrained(folder)
    return load_model(folder), load_model(folder, device=nvidia_device)


def test_model_decodes_the_cpus_tokens_with_the_device_kernel_in_a_graph(moe_models, nv_moe):
    cpu_model, nv_model = moe_models
    prompt = [1, 17, 42, 99, 5, 250, 3]
    config = GenerationConfig(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    want = generate(cpu_model, prompt, config).token_ids
    kept = engine_for(nv_model, len(prompt), config.max_new_tokens)
    assert generate(kept, prompt, config).token_ids == want
    graphs = nv_model.runner._graph_caches[kept.cache]  # graphs on for the MoE model: one capture, then replays
    assert (graphs.captures, graphs.replays) == (1, len(want) - 1)
    kernels = [call[0] for call in nv_model.runner.decoding_pass(kept.cache).plan.calls]
    assert kernels.count(nv_moe.moe_mlp) == 1  # the one routed layer, on the device
    assert not any(isinstance(k, functools.partial) for k in kernels)  # nothing through the CPU fallback
