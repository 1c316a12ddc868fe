"""The ops a vision encoder (SigLIP, Idefics3's) adds to a decoder's: ``layer_norm``, ``gelu``
(tanh and erf forms) and non-causal ``self_attention``, against PyTorch (float64 references
from the exact input values) in F32, F16 and BF16; their argument errors; their dispatch (own
kernel names, the CPU fallback of a device without them); and the NVIDIA kernels against the
CPU ones, through Triton's interpreter or on the GPU where torch sees one."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from llaisys import DataType, Tensor, ops
from llaisys.kernels import find_kernel, register_kernel, unregister_kernels
from llaisys.ops import functional as F

from conftest import assert_close, dtype_params, random_tensor, to_torch
from test_nvidia_kernels import close, pair

DTYPES = dtype_params()
VISION_KERNELS = ("layer_norm", "gelu_tanh", "gelu_erf", "self_attention_full")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def make(layout: str, shape: tuple, dtype: DataType, rng: np.random.Generator, scale: float = 1.0,
         offset: float = 0.0) -> Tensor:
    """A CPU tensor of ``shape`` holding normal samples * scale + offset rounded to ``dtype``:
    contiguous, "sliced" (strided rows: a slice of a wider one along the last dim) or
    "permuted" (no unit last stride: the transpose of a contiguous one)."""
    full = {"contiguous": shape, "sliced": shape[:-1] + (shape[-1] + 5,), "permuted": shape[::-1]}[layout]
    t = Tensor.from_numpy(rng.standard_normal(full) * scale + offset, dtype=dtype)
    if layout == "sliced":
        return t.slice(-1, 2, 2 + shape[-1])
    return t.permute(*range(len(shape) - 1, -1, -1)) if layout == "permuted" else t


# ---- layer_norm ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 3, 40), (2, 1152)])
@pytest.mark.parametrize("layout", ["contiguous", "sliced", "permuted"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_layer_norm_matches_torch(dtype, shape, layout, with_bias, rng):
    x = make(layout, shape, dtype, rng, 3.0, offset=2.0)  # a mean away from zero, which the norm removes
    d = shape[-1]
    w = Tensor.from_numpy(1 + 0.2 * rng.standard_normal(d), dtype=dtype)
    b = Tensor.from_numpy(0.5 * rng.standard_normal(d), dtype=dtype) if with_bias else None
    want = TF.layer_norm(to_torch(x), (d,), to_torch(w), None if b is None else to_torch(b), 1e-6)
    out = Tensor.empty(shape, dtype)
    assert ops.layer_norm(out, x, w, b, 1e-6) is out
    assert_close(out, want, what="layer_norm")
    assert_close(F.layer_norm(x, w, b, 1e-6), want, what="functional layer_norm")


def test_layer_norm_of_a_constant_row_is_the_bias_and_eps_counts():
    x = Tensor.from_numpy(np.full((2, 8), 3.5, np.float32))
    w, b = Tensor.from_numpy(np.full(8, 2.0, np.float32)), Tensor.from_numpy(np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(F.layer_norm(x, w, b, 1e-5).numpy(), np.tile(np.arange(8, dtype=np.float32), (2, 1)))
    y = np.array([[-1.0, 1.0]], np.float32)  # variance 1: a large eps shrinks the result
    got = F.layer_norm(Tensor.from_numpy(y), Tensor.from_numpy(np.ones(2, np.float32)), None, 3.0).numpy()
    np.testing.assert_allclose(got, y / 2.0, rtol=1e-6)


def test_layer_norm_in_a_plan_replays(rng):
    x, w = random_tensor((4, 16), DataType.F32, rng), random_tensor((16,), DataType.F32, rng)
    out = Tensor.empty((4, 16), DataType.F32)
    plan = ops.Plan()
    ops.layer_norm(out, x, w, None, 1e-6, plan=plan)
    ops.gelu(out, out, approximate="none", plan=plan)
    plan.run()
    want = TF.gelu(TF.layer_norm(to_torch(x), (16,), to_torch(w), None, 1e-6), approximate="none")
    assert_close(out, want)


# ---- gelu -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("shape", [(1,), (5, 33), (2, 3, 17)])
@pytest.mark.parametrize("layout", ["contiguous", "sliced", "permuted"])
def test_gelu_matches_torch(dtype, approximate, shape, layout, rng):
    x = make(layout, shape, dtype, rng, 4.0)
    want = TF.gelu(to_torch(x), approximate=approximate)
    out = Tensor.empty(shape, dtype)
    assert ops.gelu(out, x, approximate=approximate) is out
    assert_close(out, want, what=f"gelu {approximate}")
    assert_close(F.gelu(x, approximate=approximate), want, what=f"functional gelu {approximate}")


def test_gelu_default_is_tanh_and_runs_in_place(rng):
    x = random_tensor((3, 10), DataType.BF16, rng, 3.0)
    want = TF.gelu(to_torch(x), approximate="tanh")
    ops.gelu(x, x)
    assert_close(x, want)


def test_gelu_tanh_is_the_numpy_geglu_with_a_unit_up(rng):
    from llaisys.kernels.cpu import elementwise

    x = random_tensor((4, 50), DataType.F32, rng, 3.0)
    want = Tensor.empty((4, 50), DataType.F32)
    elementwise.geglu((want,), (x, Tensor.from_numpy(np.ones((4, 50), np.float32))), {})
    np.testing.assert_array_equal(F.gelu(x).numpy(), want.numpy())


def test_gelu_erf_keeps_float32_precision_in_both_tails():
    """The erf form as erfc of the other side: no 1 + erf(x) cancels, so far into the left
    tail (gelu(-12) ~ -2e-32) the result still has float32's relative precision."""
    x = np.linspace(-12, 12, 4001).astype(np.float32)
    got = F.gelu(Tensor.from_numpy(x), approximate="none").numpy().astype(np.float64)
    x64 = x.astype(np.float64)
    want = np.array([0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in x64])
    np.testing.assert_allclose(got, want, rtol=3e-7, atol=0)


# ---- non-causal attention -----------------------------------------------------------------
def torch_full_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> torch.Tensor:
    """q (S, H, D) over every key of k (T, KH, D), v (T, KH, Dv): (S, H, Dv) float64, by torch's
    scaled_dot_product_attention (is_causal=False) with the KV heads repeated per group."""
    g = q.shape[1] // k.shape[1]
    qt = to_torch(q).permute(1, 0, 2)  # (H, S, D)
    kt = to_torch(k).repeat_interleave(g, dim=1).permute(1, 0, 2)  # (H, T, D)
    vt = to_torch(v).repeat_interleave(g, dim=1).permute(1, 0, 2)  # (H, T, Dv)
    out = TF.scaled_dot_product_attention(qt, kt, vt, is_causal=False, scale=scale)  # (H, S, Dv)
    return out.permute(1, 0, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s, t", [(1, 7), (5, 9), (9, 5), (16, 16)])
@pytest.mark.parametrize("h, kh", [(6, 2), (4, 4)])
def test_full_attention_matches_torch(dtype, s, t, h, kh, rng):
    d = 16
    q = random_tensor((s, h, d), dtype, rng)
    kv = random_tensor((t, 2 * kh, d), dtype, rng)  # k and v heads interleaved: strided views
    k, v = kv.slice(1, 0, kh), kv.slice(1, kh, 2 * kh)
    scale = 1 / math.sqrt(d)
    out = Tensor.empty((s, h, d), dtype)
    assert ops.self_attention(out, q, k, v, scale, causal=False) is out
    want = torch_full_attention(q, k, v, scale)
    assert_close(out, want, what="full attention")
    assert_close(F.self_attention(q, k, v, scale, causal=False), want, what="functional full attention")


def test_full_attention_with_another_value_dim_and_every_query_seeing_the_last_key(rng):
    q, k = random_tensor((4, 2, 8), DataType.F32, rng), random_tensor((6, 1, 8), DataType.F32, rng)
    v = random_tensor((6, 1, 12), DataType.F32, rng)
    got = F.self_attention(q, k, v, 0.4, causal=False)
    assert got.shape == (4, 2, 12)
    assert_close(got, torch_full_attention(q, k, v, 0.4))
    causal = F.self_attention(q, k, v, 0.4).numpy()  # query 0 sits at position 2: keys 3..5 hidden
    assert not np.allclose(causal[0], got.numpy()[0])
    np.testing.assert_allclose(causal[3], got.numpy()[3], rtol=1e-6, atol=1e-6)  # the last query sees all


# ---- argument errors ----------------------------------------------------------------------
def test_argument_errors_name_the_problem(rng):
    f32 = lambda *shape: random_tensor(shape, DataType.F32, rng)  # noqa: E731
    x, w = f32(3, 8), f32(8)
    with pytest.raises(ValueError, match=r"layer_norm: weight has shape \(7,\); expected \(8,\)"):
        ops.layer_norm(f32(3, 8), x, f32(7), None, 1e-6)
    with pytest.raises(ValueError, match=r"layer_norm: bias has shape \(9,\); expected \(8,\)"):
        ops.layer_norm(f32(3, 8), x, w, f32(9), 1e-6)
    with pytest.raises(ValueError, match=r"layer_norm: out has shape \(8, 3\); expected \(3, 8\)"):
        ops.layer_norm(f32(8, 3), x, w, None, 1e-6)
    with pytest.raises(ValueError, match="layer_norm: eps must be >= 0, got -1.0"):
        ops.layer_norm(f32(3, 8), x, w, None, -1.0)
    with pytest.raises(TypeError, match="layer_norm: bias has data type F16 but out has F32"):
        ops.layer_norm(f32(3, 8), x, w, Tensor.zeros((8,), DataType.F16), 1e-6)
    with pytest.raises(ValueError, match="gelu: approximate must be one of 'tanh', 'none', got 'erf'"):
        ops.gelu(f32(3, 8), x, approximate="erf")
    with pytest.raises(ValueError, match=r"gelu: in has shape \(3, 8\); expected \(8, 3\)"):
        ops.gelu(f32(8, 3), x)
    with pytest.raises(TypeError, match="gelu: out has data type I64"):
        ops.gelu(Tensor.zeros((2,), DataType.I64), Tensor.zeros((2,), DataType.I64))
    q, k = f32(5, 4, 8), f32(3, 2, 8)
    out = f32(5, 4, 8)
    with pytest.raises(ValueError, match="self_attention: window=3 needs causal attention"):
        ops.self_attention(out, q, k, k, 0.3, causal=False, window=3)
    with pytest.raises(ValueError, match="k and v hold 3 positions, fewer than the 5 queries"):
        ops.self_attention(out, q, k, k, 0.3)  # causal: T >= S
    ops.self_attention(out, q, k, k, 0.3, causal=False)  # not causal: any T
    with pytest.raises(ValueError, match="k and v hold no positions for the 5 queries"):
        ops.self_attention(out, q, f32(0, 2, 8), f32(0, 2, 8), 0.3, causal=False)
    with pytest.raises(TypeError, match="self_attention: causal must be a bool, got int"):
        ops.self_attention(out, q, k, k, 0.3, causal=0)
    with pytest.raises(ValueError, match=r"self_attention: attn_val has shape \(5, 4, 8\); expected \(5, 4, 6\)"):
        ops.self_attention(out, q, k, f32(3, 2, 6), 0.3, causal=False)
    with pytest.raises(ValueError, match="q has 4 heads, not a multiple of the 3 key/value heads"):
        ops.self_attention(out, q, f32(3, 3, 8), f32(3, 3, 8), 0.3, causal=False)


# ---- dispatch -----------------------------------------------------------------------------
def test_every_vision_kernel_is_registered_on_the_cpu():
    for name in VISION_KERNELS:
        for dt in (DataType.F32, DataType.F16, DataType.BF16):
            assert find_kernel(name, "cpu", dt) is not None, (name, dt)


def test_a_full_attention_call_never_reaches_a_causal_only_kernel(rng):
    plan = ops.Plan()
    q, k = random_tensor((3, 4, 8), DataType.F32, rng), random_tensor((5, 2, 8), DataType.F32, rng)
    ops.self_attention(Tensor.empty((3, 4, 8), DataType.F32), q, k, k, 0.2, causal=False, plan=plan)
    assert plan.calls[0][0] is find_kernel("self_attention_full", "cpu", DataType.F32)
    assert plan.calls[0][0] is not find_kernel("self_attention", "cpu", DataType.F32)


def test_a_device_without_the_kernels_runs_them_on_the_cpu(fake_device, rng):
    """A device whose only attention kernel is the causal one (as a plugin's is) runs the new
    ops, and full attention, through the CPU fallback."""

    @register_kernel("self_attention", "fakedev", dtypes=[DataType.F32])
    def causal_only(outputs, inputs, attrs):
        pytest.fail("a non-causal call reached the causal kernel")

    try:
        dev = lambda t: t.to("fakedev:0")  # noqa: E731
        x, w, b = (random_tensor(s, DataType.F32, rng) for s in ((3, 16), (16,), (16,)))
        got = F.layer_norm(dev(x), dev(w), dev(b), 1e-6)
        assert got.device.type.name == "fakedev"
        assert_close(got, TF.layer_norm(to_torch(x), (16,), to_torch(w), to_torch(b), 1e-6))
        assert_close(F.gelu(dev(x), approximate="none"), TF.gelu(to_torch(x)))
        q, k = random_tensor((3, 4, 8), DataType.F32, rng), random_tensor((5, 2, 8), DataType.F32, rng)
        assert_close(F.self_attention(dev(q), dev(k), dev(k), 0.2, causal=False), torch_full_attention(q, k, k, 0.2))
    finally:
        unregister_kernels("fakedev", ops=("self_attention",))


# ---- NVIDIA kernels against the CPU kernels ---------------------------------------------------
def test_nvidia_registers_every_vision_kernel(nvidia_device):
    for name in VISION_KERNELS:
        for dt in (DataType.F32, DataType.F16, DataType.BF16):
            assert find_kernel(name, "nvidia", dt) is not None, (name, dt)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvidia_layer_norm(nvidia_device, rng, dtype):
    x_c, x_n = pair(rng.standard_normal((3, 80)) * 2 + 1, dtype, nvidia_device)
    w_c, w_n = pair(1 + 0.1 * rng.standard_normal(70), dtype, nvidia_device)
    b_c, b_n = pair(rng.standard_normal(70), dtype, nvidia_device)
    for bias_c, bias_n in ((b_c, b_n), (None, None)):
        outs = []
        for x, w, b, dev in ((x_c, w_c, bias_c, "cpu"), (x_n, w_n, bias_n, nvidia_device)):
            out = Tensor.zeros((3, 90), dtype, dev).slice(1, 10, 80)  # a strided output
            ops.layer_norm(out, x.slice(1, 5, 75), w, b, 1e-6)  # strided rows in
            outs.append(out)
        close(outs[1], outs[0], dtype, what=f"layer_norm bias={bias_c is not None}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_nvidia_gelu_strided_and_in_place(nvidia_device, rng, dtype, approximate):
    x_c, x_n = pair(rng.standard_normal((6, 40)) * 4, dtype, nvidia_device)
    want = F.gelu(x_c.permute(1, 0), approximate=approximate)
    close(F.gelu(x_n.permute(1, 0), approximate=approximate), want, dtype, what=f"gelu {approximate} transposed")
    ops.gelu(x_n, x_n, approximate=approximate)
    close(x_n, F.gelu(x_c, approximate=approximate), dtype, what=f"gelu {approximate} in place")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s, t", [(1, 9), (7, 20), (20, 7), (40, 40)])
def test_nvidia_full_attention(nvidia_device, rng, dtype, s, t):
    h, kh, d = 6, 2, 16
    q_c, q_n = pair(rng.standard_normal((s, h, d)), dtype, nvidia_device)
    kv_c, kv_n = pair(rng.standard_normal((t, 2 * kh, d)), dtype, nvidia_device)  # k and v heads interleaved
    outs = []
    for q, kv, dev in ((q_c, kv_c, "cpu"), (q_n, kv_n, nvidia_device)):
        out = Tensor.empty((s, h, d), dtype, dev)
        ops.self_attention(out, q, kv.slice(1, 0, kh), kv.slice(1, kh, 2 * kh), 1 / math.sqrt(d), causal=False)
        outs.append(out)
    close(outs[1], outs[0], dtype, scale=2, what="full attention")
