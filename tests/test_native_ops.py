"""The native F32 kernels of csrc/ops (``kernels.cpu.native_ops``): rms_norm, add_rms_norm, rope,
swiglu and self_attention (causal and full) against their NumPy kernels (called explicitly) and PyTorch in
float64, in the decoder's strided layouts and odd sizes; batch invariance (a row computed alone
gives the bits it gets in a bigger call); every SIMD level gives the same bits; layouts the
native code does not take, and a missing library, fall back to the NumPy kernels."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from llaisys import DataType, Tensor, ops
from llaisys.kernels import find_kernel
from llaisys.kernels.cpu import attention, elementwise, native_ops, norm_rope

from conftest import assert_close, to_torch

native = pytest.mark.skipif(not native_ops.available(), reason="llaisys._native._ops is not built")

NATIVE, NUMPY = native_ops.KERNELS, native_ops.NUMPY_KERNELS


@pytest.fixture
def rng():
    return np.random.default_rng(2024)


@pytest.fixture(params=native_ops.simd_levels() if native_ops.available() else ["none"])
def simd(request):
    """Each SIMD level this CPU runs, restored afterwards."""
    if request.param == "none":
        pytest.skip("llaisys._native._ops is not built")
    before = native_ops.simd_level()
    native_ops.set_simd_level(request.param)
    yield request.param
    native_ops.set_simd_level(before)


def rand(shape, rng, scale=1.0) -> Tensor:
    return Tensor.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))


def columns(rows: int, width: int, start: int, total: int, rng, scale=1.0) -> Tensor:
    """Columns [start, start + width) of a (rows, total) tensor: rows `total` apart, as the
    decoder's gate and up are slices of one buffer."""
    return rand((rows, total), rng, scale).slice(1, start, start + width)


def run(kernel, outputs, inputs, attrs) -> list[np.ndarray]:
    kernel(outputs, inputs, attrs)
    return [o.numpy() for o in outputs]


def fresh(*shapes) -> tuple[Tensor, ...]:
    return tuple(Tensor.from_numpy(np.full(s, np.nan, np.float32)) for s in shapes)


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance in units in the last place between float32 arrays (same signs)."""
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


# ---- rms_norm, add_rms_norm ---------------------------------------------------------------------
def rms_norm_ref(x, w, eps):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


NORM_SHAPES = [(1, 576), (7, 576), (3, 1), (5, 13), (2, 3, 37), (4, 130)]


@native
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_matches_numpy_and_torch(shape, strided, simd, rng):
    d = shape[-1]
    if strided:  # rows d + 5 apart, as a column slice of a wider buffer
        x = columns(math.prod(shape[:-1]), d, 2, d + 5, rng, 3.0).view(*shape)
    else:
        x = rand(shape, rng, 3.0)
    w = rand((d,), rng)
    ours, = run(NATIVE["rms_norm"], fresh(shape), (x, w), {"eps": 1e-5})
    ref, = run(NUMPY["rms_norm"], fresh(shape), (x, w), {"eps": 1e-5})
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)
    assert_close(Tensor.from_numpy(ours), rms_norm_ref(to_torch(x), to_torch(w), 1e-5))


@native
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_add_rms_norm_matches_numpy_and_rms_norm(shape, simd, rng):
    a, b, w = rand(shape, rng, 2.0), rand(shape, rng), rand(shape[-1:], rng)
    ours = run(NATIVE["add_rms_norm"], fresh(shape, shape), (a, b, w), {"eps": 1e-6})
    ref = run(NUMPY["add_rms_norm"], fresh(shape, shape), (a, b, w), {"eps": 1e-6})
    np.testing.assert_array_equal(ours[1], ref[1])  # the sum, rounded once, as NumPy adds
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-6, atol=1e-7)
    alone, = run(NATIVE["rms_norm"], fresh(shape), (Tensor.from_numpy(ours[1]), w), {"eps": 1e-6})
    np.testing.assert_array_equal(ours[0], alone)  # exactly add, then rms_norm
    assert_close(Tensor.from_numpy(ours[0]), rms_norm_ref(to_torch(a) + to_torch(b), to_torch(w), 1e-6))


@native
def test_add_rms_norm_in_place_as_the_decoder_runs_it(rng):
    x, proj, w = rand((3, 576), rng), rand((3, 576), rng), rand((576,), rng)
    expected_total = x.numpy() + proj.numpy()
    expected, = run(NUMPY["rms_norm"], fresh((3, 576)), (Tensor.from_numpy(expected_total), w), {"eps": 1e-5})
    h = Tensor.empty((3, 576))
    ops.add_rms_norm(h, x, x, proj, w, 1e-5)  # x += proj; h = norm(x)
    np.testing.assert_array_equal(x.numpy(), expected_total)
    np.testing.assert_allclose(h.numpy(), expected, rtol=1e-6, atol=1e-7)


@native
def test_rms_norm_float64_accumulation_is_closer_to_torch_than_numpy(rng):
    x, w = rand((64, 1536), rng, 10.0), rand((1536,), rng)
    ref = rms_norm_ref(to_torch(x), to_torch(w), 1e-5).numpy()
    (ours,), (theirs,) = (run(k["rms_norm"], fresh((64, 1536)), (x, w), {"eps": 1e-5}) for k in (NATIVE, NUMPY))
    assert np.abs(ours - ref).max() <= np.abs(theirs - ref).max()


# ---- swiglu -------------------------------------------------------------------------------------
@native
@pytest.mark.parametrize("shape", [(1, 1536), (16, 1536), (3, 1), (5, 17), (2, 3, 33)])
def test_swiglu_matches_numpy_and_torch(shape, simd, rng):
    n = shape[-1]
    rows = math.prod(shape[:-1])
    gate = columns(rows, n, 0, 2 * n, rng, 4.0).view(*shape)  # (rows, 2n) buffer: gate | up
    up = columns(rows, n, n, 2 * n, rng).view(*shape)
    (ours,), (ref,) = (run(k["swiglu"], fresh(shape), (gate, up), {}) for k in (NATIVE, NUMPY))
    assert ulps(ours, ref) <= 4
    assert_close(Tensor.from_numpy(ours), to_torch(up) * TF.silu(to_torch(gate)))


@native
def test_swiglu_extreme_gates_match_numpy(simd):
    values = [-1e30, -1e4, -100.0, -88.8, -87.0, -20.0, -1e-30, -0.0, 0.0, 1e-30, 20.0, 87.0, 88.8, 103.9, 104.0,
              1e4, np.inf, -np.inf]
    gate = Tensor.from_numpy(np.array(values, np.float32))
    up = Tensor.from_numpy(np.full(len(values), 0.75, np.float32))
    with np.errstate(invalid="ignore"):
        (ours,), (ref,) = (run(k["swiglu"], fresh((len(values),)), (gate, up), {}) for k in (NATIVE, NUMPY))
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(ours), finite)
    np.testing.assert_allclose(ours[finite], ref[finite], rtol=3e-7, atol=0)
    np.testing.assert_array_equal(np.signbit(ours), np.signbit(ref))


@native
def test_exp_accuracy_over_the_float_range(simd):
    """swiglu with up = 1 and gate = -x gives -x / (1 + e^x): check e^x through it against float64."""
    x = np.concatenate([np.linspace(-103, 88.7, 200001), np.linspace(-1, 1, 10001)]).astype(np.float32)
    gate, up = Tensor.from_numpy(-x), Tensor.from_numpy(np.ones_like(x))
    ours, = run(NATIVE["swiglu"], fresh(x.shape), (gate, up), {})
    exact = (-x.astype(np.float64)) / (1.0 + np.exp(x.astype(np.float64)))
    rel = np.abs(ours - exact) / np.maximum(np.abs(exact), np.finfo(np.float32).tiny)
    assert rel.max() < 4e-7  # a few ulp of float32: the exp, the add, the division


# ---- rope ---------------------------------------------------------------------------------------
def rope_ref(x, pos, theta):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (D/2,)
    phi = pos.double()[:, None, None] * inv  # (S, 1, D/2)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * phi.cos() - b * phi.sin(), b * phi.cos() + a * phi.sin()], dim=-1)


@native
@pytest.mark.parametrize("s, h, d", [(1, 12, 64), (16, 12, 64), (5, 3, 2), (3, 5, 18), (2, 4, 130)])
@pytest.mark.parametrize("theta", [10000.0, 1e6])
def test_rope_is_bit_identical_to_numpy(s, h, d, theta, simd, rng):
    fused = rand((s, h + 2, d), rng)  # q and k heads of a fused projection, one more head after them
    x = fused.slice(1, 0, h)
    pos = Tensor.from_numpy(rng.permutation(100000)[:s].astype(np.int64))
    (ours,), (ref,) = (run(k["rope"], fresh((s, h, d)), (x, pos), {"theta": theta}) for k in (NATIVE, NUMPY))
    np.testing.assert_array_equal(ours, ref)
    assert_close(Tensor.from_numpy(ours), rope_ref(to_torch(x), to_torch(pos), theta))


@native
def test_rope_in_place_and_new_positions(rng):
    x = rand((2, 3, 8), rng)
    expected = {p: run(NUMPY["rope"], fresh((2, 3, 8)), (x, Tensor.from_numpy(np.array([p, p + 1], np.int64))),
                       {"theta": 500.0})[0] for p in (0, 7, 4000)}
    pos = Tensor.empty((2,), DataType.I64)
    out = Tensor.empty((2, 3, 8))
    for p in (0, 7, 4000, 7):  # the positions change between calls, as in decoding
        pos.load(np.array([p, p + 1], np.int64))
        NATIVE["rope"]((out,), (x, pos), {"theta": 500.0})
        np.testing.assert_array_equal(out.numpy(), expected[p])
    y = Tensor.from_numpy(x.numpy())
    ops.rope(y, y, pos, 500.0)  # in place
    np.testing.assert_array_equal(y.numpy(), expected[7])


@native
@pytest.mark.parametrize("kind", ["rope", "rope_freqs"])
def test_rope_rows_read_in_place_equal_each_call_computed(kind, rng):
    """Consecutive positions (a decoding step, a prompt's chunk) read the rows of a table of all
    positions so far, grown as they pass its end: the same cos and sin, bit for bit, as the
    NumPy kernel computes for each call's own positions, over several growths."""
    x = rand((1, 3, 16), rng)
    attrs = {"theta": 1e4} if kind == "rope" else {"attention_factor": 1.25}
    extra = () if kind == "rope" else (Tensor.from_numpy(rng.uniform(1e-4, 1.0, 8).astype(np.float32)),)
    pos = Tensor.empty((1,), DataType.I64)
    out = Tensor.empty((1, 3, 16))
    for p in [*range(0, 300), *range(511, 530), 1023, 1024, 5000, 4999, 3]:
        pos.load(np.array([p], np.int64))
        NATIVE[kind]((out,), (x, pos, *extra), attrs)
        want = run(NUMPY[kind], fresh((1, 3, 16)), (x, Tensor.from_numpy(np.array([p], np.int64)), *extra), attrs)[0]
        np.testing.assert_array_equal(out.numpy(), want, err_msg=f"position {p}")
    chunk = rand((6, 3, 16), rng)  # a prompt's chunk at 4990 .. 4995
    positions = Tensor.from_numpy(np.arange(4990, 4996, dtype=np.int64))
    (ours,), (ref,) = (run(k[kind], fresh((6, 3, 16)), (chunk, positions, *extra), attrs) for k in (NATIVE, NUMPY))
    np.testing.assert_array_equal(ours, ref)


# ---- self_attention -----------------------------------------------------------------------------
def attention_ref(q, k, v, scale):
    s, h, _ = q.shape
    t, kh, _ = k.shape
    k, v = k.repeat_interleave(h // kh, dim=1), v.repeat_interleave(h // kh, dim=1)  # (T, H, D), (T, H, Dv)
    scores = torch.einsum("shd,thd->hst", q, k) * scale  # (H, S, T)
    mask = torch.arange(t)[None, :] <= torch.arange(s)[:, None] + (t - s)  # (S, T)
    return torch.einsum("hst,thd->shd", scores.masked_fill(~mask, float("-inf")).softmax(dim=-1), v)


ATTENTION_CASES = {  # (S, T, H, KH, D, Dv)
    "decode smollm2": (1, 161, 9, 3, 64, 64),
    "prefill smollm2, cache ahead": (16, 40, 9, 3, 64, 64),
    "one key": (1, 1, 2, 1, 8, 8),
    "equal lengths, mha": (5, 5, 4, 4, 16, 16),
    "odd dims": (3, 37, 6, 2, 19, 23),
    "wide heads, mqa": (4, 70, 8, 1, 80, 130),
    "gqa 4": (2, 33, 12, 3, 33, 7),
    "long": (1, 1500, 9, 3, 64, 64),
}


def attention_inputs(s, t, h, kh, d, dv, rng, scale=1.0):
    qkv = rand((s, h + kh, d), rng, scale)  # q is a slice of a fused buffer
    cache_k, cache_v = rand((t + 9, kh, d), rng, scale), rand((t + 9, kh, dv), rng)
    return qkv.slice(1, 0, h), cache_k.slice(0, 0, t), cache_v.slice(0, 0, t)  # K, V: the filled rows of a cache


@native
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_self_attention_matches_numpy_and_torch(case, simd, rng):
    s, t, h, kh, d, dv = ATTENTION_CASES[case]
    q, k, v = attention_inputs(s, t, h, kh, d, dv, rng)
    attrs = {"scale": 1 / math.sqrt(d)}
    (ours,), (ref,) = (run(kern["self_attention"], fresh((s, h, dv)), (q, k, v), attrs) for kern in (NATIVE, NUMPY))
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=1e-5)
    assert_close(Tensor.from_numpy(ours), attention_ref(to_torch(q), to_torch(k), to_torch(v), attrs["scale"]))


@native
def test_self_attention_sharp_scores(rng):
    q, k, v = attention_inputs(3, 20, 4, 2, 16, 16, rng, scale=6.0)  # scores of hundreds: a near one-hot softmax
    ours, = run(NATIVE["self_attention"], fresh((3, 4, 16)), (q, k, v), {"scale": 1.0})
    assert np.isfinite(ours).all()
    assert_close(Tensor.from_numpy(ours), attention_ref(to_torch(q), to_torch(k), to_torch(v), 1.0))


# ---- self_attention_full: every query sees every key (a vision encoder's) -----------------------
def full_attention_ref(q, k, v, scale):
    """torch's scaled_dot_product_attention (is_causal=False) of q (S, H, D) over k (T, KH, D),
    v (T, KH, Dv), the KV heads repeated per group: (S, H, Dv)."""
    g = q.shape[1] // k.shape[1]
    kt, vt = (x.repeat_interleave(g, dim=1).permute(1, 0, 2) for x in (k, v))  # (H, T, D), (H, T, Dv)
    return TF.scaled_dot_product_attention(q.permute(1, 0, 2), kt, vt, is_causal=False, scale=scale).permute(1, 0, 2)


FULL_CASES = {  # (S, T, H, KH, D, Dv)
    "siglip-b heads": (40, 40, 12, 12, 64, 64),
    "so400m head dim, odd rows": (29, 29, 16, 16, 72, 72),
    "more queries than keys": (19, 7, 4, 2, 16, 16),
    "fewer queries than keys": (3, 50, 6, 3, 19, 23),
    "one query, mqa, wide values": (1, 33, 8, 1, 80, 130),
    "one key": (9, 1, 2, 1, 8, 8),
    "gqa 4, odd sizes": (11, 37, 12, 3, 33, 7),
}


@native
@pytest.mark.parametrize("case", list(FULL_CASES))
def test_self_attention_full_matches_numpy_and_torch(case, simd, rng):
    s, t, h, kh, d, dv = FULL_CASES[case]
    q, k, v = attention_inputs(s, t, h, kh, d, dv, rng)
    attrs = {"scale": 1 / math.sqrt(d)}
    (ours,), (ref,) = (run(kern["self_attention_full"], fresh((s, h, dv)), (q, k, v), attrs)
                       for kern in (NATIVE, NUMPY))
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=1e-5)
    assert_close(Tensor.from_numpy(ours), full_attention_ref(to_torch(q), to_torch(k), to_torch(v), attrs["scale"]))


@native
def test_self_attention_full_sharp_scores(rng):
    q, k, v = attention_inputs(5, 20, 4, 2, 16, 16, rng, scale=6.0)  # scores of hundreds: a near one-hot softmax
    ours, = run(NATIVE["self_attention_full"], fresh((5, 4, 16)), (q, k, v), {"scale": 1.0})
    ref, = run(NUMPY["self_attention_full"], fresh((5, 4, 16)), (q, k, v), {"scale": 1.0})
    assert np.isfinite(ours).all()
    # a float32 score of hundreds is off by ~1e-5 in its last bits, and the weights inherit that
    want = full_attention_ref(to_torch(q), to_torch(k), to_torch(v), 1.0).numpy()
    np.testing.assert_allclose(ours, want, atol=1e-4, rtol=1e-4)
    assert np.abs(ours - want).max() <= 2 * np.abs(ref - want).max() + 1e-6


@native
@pytest.mark.parametrize("case", ["siglip-b heads", "more queries than keys", "gqa 4, odd sizes"])
def test_full_attention_row_is_the_causal_kernels_row_that_sees_every_key(case, simd, rng):
    """One kernel body: a query of the full kernel gives the bits of that query alone in the
    causal kernel (which then sees every key), whatever rows and threads its call has."""
    from llaisys.kernels.quant import native as quant

    s, t, h, kh, d, dv = FULL_CASES[case]
    q, k, v = attention_inputs(s, t, h, kh, d, dv, rng)
    before = quant.threads()
    try:
        results = {}
        for threads in (1, 2, 3, 5):
            quant.set_threads(threads)
            results[threads], = run(NATIVE["self_attention_full"], fresh((s, h, dv)), (q, k, v), {"scale": 0.2})
        quant.set_threads(1)
        for i in range(s):
            alone, = run(NATIVE["self_attention"], fresh((1, h, dv)), (q.slice(0, i, i + 1), k, v), {"scale": 0.2})
            np.testing.assert_array_equal(alone[0], results[1][i], err_msg=f"query {i}")
    finally:
        quant.set_threads(before)
    for threads in (2, 3, 5):
        np.testing.assert_array_equal(results[threads], results[1], err_msg=f"{threads} threads")


@native
def test_full_attention_every_simd_level_gives_the_same_bits(rng):
    levels, before = native_ops.simd_levels(), native_ops.simd_level()
    q, k, v = attention_inputs(21, 45, 6, 2, 37, 21, rng)
    results = {}
    try:
        for level in levels:
            native_ops.set_simd_level(level)
            results[level], = run(NATIVE["self_attention_full"], fresh((21, 6, 21)), (q, k, v), {"scale": 0.3})
    finally:
        native_ops.set_simd_level(before)
    for level in levels[1:]:
        np.testing.assert_array_equal(results[level], results[levels[0]], err_msg=level)


@native
def test_ops_dispatch_full_attention_to_the_native_kernel(rng, monkeypatch):
    if os.environ.get("LLAISYS_NATIVE_OPS", "1") in ("0", "false", "no", "off"):
        pytest.skip("LLAISYS_NATIVE_OPS=0 keeps the NumPy kernels")
    assert find_kernel("self_attention_full", "cpu", DataType.F32) is native_ops.self_attention_full
    assert find_kernel("self_attention_full", "cpu", DataType.F16) is attention.self_attention_full
    monkeypatch.setattr(attention, "self_attention_full", lambda *a: pytest.fail("fell back to NumPy"))
    q, k, v = attention_inputs(6, 9, 4, 2, 16, 16, rng)
    out = Tensor.empty((6, 4, 16))
    ops.self_attention(out, q, k, v, 0.25, causal=False)
    assert_close(out, full_attention_ref(to_torch(q), to_torch(k), to_torch(v), 0.25))


@native
def test_plan_replays_full_attention_in_a_native_stretch(rng):
    """Recorded once, replayed in C (no Python), with the bits of a direct call; rebound to
    other K/V rows of the same layout (more keys), it follows them."""
    from llaisys.ops.plan import ReplayStats

    s, h, kh, d = 13, 6, 3, 24
    q, k, v = attention_inputs(s, 10, h, kh, d, d, rng)
    out = Tensor.empty((s, h, d))
    plan = ops.Plan()
    ops.self_attention(out, q, k, v, 0.3, causal=False, plan=plan)
    assert plan.stats() == ReplayStats(calls=1, native=1, stretches=1, python=0)
    plan.run()
    direct, = run(NATIVE["self_attention_full"], fresh((s, h, d)), (q, k, v), {"scale": 0.3})
    np.testing.assert_array_equal(out.numpy(), direct)
    _, k2, v2 = attention_inputs(s, 17, h, kh, d, d, rng)
    plan.rebind(0, inputs=(q, k2, v2))
    plan.run()
    assert plan.stats().native == 1
    assert_close(out, full_attention_ref(to_torch(q), to_torch(k2), to_torch(v2), 0.3))


@native
def test_a_library_without_full_attention_runs_the_numpy_kernel(rng, monkeypatch):
    """A library built before the full kernel lacks its functions: the NumPy kernel runs, and a
    plan replays the call from Python."""

    class Older:
        def __getattr__(self, name):
            if name.startswith("llaisys_ops_self_attention_full"):
                raise AttributeError(name)
            return getattr(native_ops._library(), name)

    older = Older()
    monkeypatch.setattr(native_ops, "_lib", older)
    monkeypatch.setattr(native_ops, "_library", lambda: older)
    q, k, v = attention_inputs(4, 6, 4, 2, 8, 8, rng)
    ours, = run(NATIVE["self_attention_full"], fresh((4, 4, 8)), (q, k, v), {"scale": 0.5})
    ref, = run(NUMPY["self_attention_full"], fresh((4, 4, 8)), (q, k, v), {"scale": 0.5})
    np.testing.assert_array_equal(ours, ref)
    assert native_ops.self_attention_full.native_call((Tensor.empty((4, 4, 8)),), (q, k, v), {"scale": 0.5}) is None


# ---- batch invariance, SIMD levels ---------------------------------------------------------------
@native
def test_row_results_do_not_depend_on_the_rows_in_the_call(simd, rng):
    s = 9
    x, proj, w = rand((s, 576), rng), rand((s, 576), rng), rand((576,), rng)
    gate, up = columns(s, 1536, 0, 3072, rng, 3.0), columns(s, 1536, 1536, 3072, rng)
    qk = rand((s, 12, 64), rng)
    pos = Tensor.from_numpy(np.arange(100, 100 + s, dtype=np.int64))
    whole = {
        "rms_norm": run(NATIVE["rms_norm"], fresh((s, 576)), (x, w), {"eps": 1e-5}),
        "add_rms_norm": run(NATIVE["add_rms_norm"], fresh((s, 576), (s, 576)), (x, proj, w), {"eps": 1e-5}),
        "swiglu": run(NATIVE["swiglu"], fresh((s, 1536)), (gate, up), {}),
        "rope": run(NATIVE["rope"], fresh((s, 12, 64)), (qk, pos), {"theta": 1e4}),
    }
    for i in range(s):
        row = {
            "rms_norm": run(NATIVE["rms_norm"], fresh((1, 576)), (x.slice(0, i, i + 1), w), {"eps": 1e-5}),
            "add_rms_norm": run(NATIVE["add_rms_norm"], fresh((1, 576), (1, 576)),
                                (x.slice(0, i, i + 1), proj.slice(0, i, i + 1), w), {"eps": 1e-5}),
            "swiglu": run(NATIVE["swiglu"], fresh((1, 1536)), (gate.slice(0, i, i + 1), up.slice(0, i, i + 1)), {}),
            "rope": run(NATIVE["rope"], fresh((1, 12, 64)), (qk.slice(0, i, i + 1), pos.slice(0, i, i + 1)),
                        {"theta": 1e4}),
        }
        for name, outs in row.items():
            for got, want in zip(outs, whole[name]):
                np.testing.assert_array_equal(got[0], want[i], err_msg=f"{name} row {i}")


@native
@pytest.mark.parametrize("case", ["prefill smollm2, cache ahead", "odd dims", "wide heads, mqa"])
def test_attention_query_alone_gives_the_bits_of_the_batch(case, simd, rng):
    s, t, h, kh, d, dv = ATTENTION_CASES[case]
    q, k, v = attention_inputs(s, t, h, kh, d, dv, rng)
    whole, = run(NATIVE["self_attention"], fresh((s, h, dv)), (q, k, v), {"scale": 0.2})
    for i in range(s):
        seen = t - s + i + 1  # query i sits at position T - S + i
        alone, = run(NATIVE["self_attention"], fresh((1, h, dv)),
                     (q.slice(0, i, i + 1), k.slice(0, 0, seen), v.slice(0, 0, seen)), {"scale": 0.2})
        np.testing.assert_array_equal(alone[0], whole[i], err_msg=f"query {i}")


@native
@pytest.mark.parametrize("case", ["decode smollm2", "prefill smollm2, cache ahead", "gqa 4", "long"])
def test_attention_gives_the_same_bits_on_any_number_of_threads(case, rng):
    """Attention splits rows (prefill) or heads (decoding) over the quantized kernels' thread
    pool; each row and head is still one fixed sequence of operations."""
    from llaisys.kernels.quant import native as quant

    s, t, h, kh, d, dv = ATTENTION_CASES[case]
    q, k, v = attention_inputs(s, t, h, kh, d, dv, rng)
    before = quant.threads()
    results = {}
    try:
        for threads in (1, 2, 3, 5):
            quant.set_threads(threads)
            results[threads], = run(NATIVE["self_attention"], fresh((s, h, dv)), (q, k, v), {"scale": 0.125})
    finally:
        quant.set_threads(before)
    assert_close(Tensor.from_numpy(results[1]), attention_ref(to_torch(q), to_torch(k), to_torch(v), 0.125))
    for threads in (2, 3, 5):
        np.testing.assert_array_equal(results[threads], results[1], err_msg=f"{threads} threads")


@native
def test_every_simd_level_gives_the_same_bits(rng):
    levels = native_ops.simd_levels()
    before = native_ops.simd_level()
    q, k, v = attention_inputs(5, 45, 6, 2, 37, 21, rng)
    x, w = rand((4, 77), rng), rand((77,), rng)
    gate, up = rand((4, 77), rng, 4.0), rand((4, 77), rng)
    pos, xr = Tensor.from_numpy(np.arange(3, 8, dtype=np.int64)), rand((5, 6, 38), rng)
    results = {}
    try:
        for level in levels:
            native_ops.set_simd_level(level)
            results[level] = (
                run(NATIVE["self_attention"], fresh((5, 6, 21)), (q, k, v), {"scale": 0.3})
                + run(NATIVE["add_rms_norm"], fresh((4, 77), (4, 77)), (x, gate, w), {"eps": 1e-5})
                + run(NATIVE["swiglu"], fresh((4, 77)), (gate, up), {})
                + run(NATIVE["rope"], fresh((5, 6, 38)), (xr, pos), {"theta": 1e4}))
    finally:
        native_ops.set_simd_level(before)
    for level in levels[1:]:
        for got, want in zip(results[level], results[levels[0]]):
            np.testing.assert_array_equal(got, want, err_msg=level)


@native
def test_unknown_simd_level_is_refused():
    with pytest.raises(ValueError, match="does not run on this CPU"):
        native_ops.set_simd_level("sse9")


# ---- layouts the native code does not take, aliasing --------------------------------------------
@native
def test_layouts_it_does_not_take_fall_back_to_numpy(rng, monkeypatch):
    calls = []
    for module, name in ((norm_rope, "rms_norm"), (elementwise, "swiglu"), (norm_rope, "rope"),
                         (attention, "self_attention")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name: (calls.append(_n), _f(*a))[1])
    # rows that do not share one stride, and last dimensions that are strided
    x = rand((4, 6, 8), rng).permute(1, 0, 2)  # (6, 4, 8): the leading dims do not fold into one
    w = rand((8,), rng)
    out = Tensor.empty((6, 4, 8))
    native_ops.rms_norm((out,), (x, w), {"eps": 1e-5})
    assert_close(out, rms_norm_ref(to_torch(x), to_torch(w), 1e-5))
    g = rand((5, 3), rng).permute(1, 0)  # (3, 5), last dim strided
    u = rand((3, 5), rng)
    o = Tensor.empty((3, 5))
    native_ops.swiglu((o,), (g, u), {})
    assert_close(o, to_torch(u) * TF.silu(to_torch(g)))
    xr = rand((8, 2, 3), rng).permute(2, 1, 0)  # (3, 2, 8), last dim strided
    pos = Tensor.from_numpy(np.array([1, 2, 3], np.int64))
    orope = Tensor.empty((3, 2, 8))
    native_ops.rope((orope,), (xr, pos), {"theta": 100.0})
    assert_close(orope, rope_ref(to_torch(xr), to_torch(pos), 100.0))
    q = rand((8, 2, 3), rng).permute(2, 1, 0)  # (3, 2, 8), last dim strided
    k, v = rand((5, 1, 8), rng), rand((5, 1, 8), rng)
    oatt = Tensor.empty((3, 2, 8))
    native_ops.self_attention((oatt,), (q, k, v), {"scale": 0.4})
    assert_close(oatt, attention_ref(to_torch(q), to_torch(k), to_torch(v), 0.4))
    assert calls == ["rms_norm", "swiglu", "rope", "self_attention"]


@native
def test_outputs_overlapping_inputs_fall_back_to_numpy(rng):
    # the output one row behind the input in one buffer: row by row in place would read written rows
    buf = rand((5, 16), rng)
    x, out = buf.slice(0, 1, 5), buf.slice(0, 0, 4)
    w = rand((16,), rng)
    expected = rms_norm_ref(to_torch(x), to_torch(w), 1e-5)
    native_ops.rms_norm((out,), (x, w), {"eps": 1e-5})
    assert_close(out, expected)
    # the norm weight in the output's first row: writing that row would change what the next reads
    buf = rand((2, 16), rng)
    out, w = buf, buf.slice(0, 0, 1).view(16)
    x = rand((2, 16), rng)
    expected = rms_norm_ref(to_torch(x), to_torch(w), 1e-5)
    native_ops.rms_norm((out,), (x, w), {"eps": 1e-5})
    assert_close(out, expected)
    # attention writing over its own keys
    kv = rand((6, 1, 8), rng)
    q, k, v = rand((2, 1, 8), rng), kv.slice(0, 0, 4), kv.slice(0, 2, 6)
    expected = attention_ref(to_torch(q), to_torch(k), to_torch(v), 0.5)
    out = kv.slice(0, 4, 6)
    native_ops.self_attention((out,), (q, k, v), {"scale": 0.5})
    assert_close(out, expected)
    out = kv.slice(0, 3, 5)  # overlaps the last key and value
    kv2 = Tensor.from_numpy(kv.numpy())
    kv2_out = kv2.slice(0, 3, 5)
    k2, v2 = kv2.slice(0, 0, 4), kv2.slice(0, 2, 6)
    expected = attention_ref(to_torch(q), to_torch(k2), to_torch(v2), 0.5)
    native_ops.self_attention((kv2_out,), (q, k2, v2), {"scale": 0.5})
    assert_close(kv2_out, expected)


@native
def test_in_place_elementwise_stays_native(rng, monkeypatch):
    monkeypatch.setattr(elementwise, "swiglu", lambda *a: pytest.fail("fell back to NumPy"))
    g, u = rand((3, 40), rng, 3.0), rand((3, 40), rng)
    expected = to_torch(u) * TF.silu(to_torch(g))
    native_ops.swiglu((g,), (g, u), {})
    assert_close(g, expected)


# ---- registration and fallback ------------------------------------------------------------------
@pytest.mark.skipif(os.environ.get("LLAISYS_NATIVE_OPS", "1") in ("0", "false", "no", "off"),
                    reason="LLAISYS_NATIVE_OPS=0 keeps the NumPy kernels")
def test_registered_for_f32_only():
    for name in native_ops.KERNELS:  # registered even without the library: they fall back themselves
        assert find_kernel(name, "cpu", DataType.F32) is native_ops.KERNELS[name]
        assert find_kernel(name, "cpu", DataType.F16) is native_ops.NUMPY_KERNELS[name]
        assert find_kernel(name, "cpu", DataType.BF16) is native_ops.NUMPY_KERNELS[name]


def test_register_can_put_the_numpy_kernels_back():
    try:
        native_ops.register(native=False)
        for name in native_ops.KERNELS:
            assert find_kernel(name, "cpu", DataType.F32) is native_ops.NUMPY_KERNELS[name]
    finally:
        native_ops.register()
    assert find_kernel("rope", "cpu", DataType.F32) is native_ops.rope


def test_environment_variable_keeps_the_numpy_kernels():
    code = ("from llaisys.kernels import find_kernel; from llaisys import DataType; "
            "from llaisys.kernels.cpu import norm_rope; "
            "assert find_kernel('rms_norm', 'cpu', DataType.F32) is norm_rope.rms_norm")
    env = dict(os.environ, LLAISYS_NATIVE_OPS="0")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_without_the_library_the_numpy_kernels_run(rng, monkeypatch, caplog):
    monkeypatch.setattr(native_ops, "_lib", None)
    monkeypatch.setattr(native_ops._native, "load", lambda name, global_symbols=False: None)
    assert not native_ops.available()
    assert "not built" in caplog.text
    s, t, h, kh, d, dv = ATTENTION_CASES["odd dims"]
    q, k, v = attention_inputs(s, t, h, kh, d, dv, rng)
    x, b, w = rand((3, 20), rng), rand((3, 20), rng), rand((20,), rng)
    pos = Tensor.from_numpy(np.arange(s, dtype=np.int64))
    cases = [("rms_norm", ((3, 20),), (x, w), {"eps": 1e-5}),
             ("add_rms_norm", ((3, 20), (3, 20)), (x, b, w), {"eps": 1e-5}),
             ("swiglu", ((3, 20),), (x, b), {}),
             ("rope", ((s, h, d + 1),), (rand((s, h, d + 1), rng), pos), {"theta": 1e4}),
             ("self_attention", ((s, h, dv),), (q, k, v), {"scale": 0.25}),
             ("self_attention_full", ((s, h, dv),), (q, k, v), {"scale": 0.25})]
    for name, shapes, inputs, attrs in cases:
        ours = run(NATIVE[name], fresh(*shapes), inputs, attrs)
        ref = run(NUMPY[name], fresh(*shapes), inputs, attrs)
        for got, want in zip(ours, ref):
            np.testing.assert_array_equal(got, want, err_msg=name)
