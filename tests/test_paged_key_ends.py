"""``ops.paged_attention(..., key_ends=)``: rows whose keys end past their own position (the
tokens of a Gemma 3 image see the whole image), with and without a sliding window, against
PyTorch in float64 with an explicit mask per query (keys [start_i, key_ends[i])); the native
kernel against the NumPy one, bit for bit where key_ends are the natural ends, batch invariant
and equal at every SIMD level; errors naming the row; a recorded Plan; the dispatch that keeps
key_ends away from kernels that do not know them (the CPU fallback serves such a device); the
Triton kernel through its interpreter."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llaisys import DataType, Tensor, ops
from llaisys.kernels.cpu import paged, paged_native
from llaisys.kernels.registry import find_kernel, register_kernel, unregister_kernels

from conftest import assert_close, dtype_params, to_torch
from test_paged_attention import NOT_BUILT, Batch, _i64, _t

# (context_len, q_len, image spans [a, b) of positions): a decoding row, a prefill with an
# image, a chunk whose image lies inside it, a long prefill whose second image crosses the
# 256-key segment and 64-key chunk boundaries, a plain prefill, a sequence with no queries,
# a chunk with a small image, and a second decoding row.
SPECS = [(37, 1, ()), (30, 30, ((5, 17),)), (90, 40, ((60, 80),)), (300, 300, ((10, 30), (200, 280))),
         (9, 9, ()), (20, 0, ()), (50, 7, ((44, 48),)), (70, 1, ())]
WINDOWS = [0, 3, 20, 1000]  # none; inside an image and a block; wider than a block; wider than everything
KERNELS = ("native", "numpy", "op")


@pytest.fixture
def rng():
    return np.random.default_rng(2024)


@pytest.fixture
def native_built():
    assert paged_native.available(), NOT_BUILT


def image_batch(rng, specs, bs, h, kh, d, dtype=DataType.F32) -> Batch:
    """``Batch`` over ``specs`` with ``key_ends``: a row at position p inside a span [a, b) sees
    keys up to b - 1, every other row up to p."""
    batch = Batch(rng, [(c, s) for c, s, _ in specs], bs, h, kh, d, dtype=dtype)
    ends = []
    for c, s, spans in specs:
        pos = np.arange(c - s, c)
        end = pos + 1
        for a, b in spans:
            end = np.where((pos >= a) & (pos < b), b, end)
        ends.append(end)
    batch.key_ends = _i64(np.concatenate(ends) if ends else np.zeros(0))
    return batch


def natural_ends(batch: Batch) -> np.ndarray:
    """Each row's position + 1: the key ends of a plain causal call."""
    qs, cl = batch.query_starts.numpy(), batch.context_lens.numpy()
    return np.concatenate([np.arange(cl[b] - (qs[b + 1] - qs[b]), cl[b]) + 1 for b in range(len(cl))])


def run(kernel: str, batch: Batch, window: int = 0, key_ends: Tensor | None = None, device: str = "cpu") -> Tensor:
    """paged_attention of ``batch`` with ``key_ends`` (default the batch's) through the native
    kernel, the NumPy one, or the op (on ``device``)."""
    key_ends = batch.key_ends if key_ends is None else key_ends
    inputs = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_starts, batch.context_lens,
              key_ends)
    attrs = {"scale": batch.scale, **({"window": window} if window else {})}
    if kernel == "native":
        out = Tensor.empty(batch.out_shape, batch.q.dtype)
        paged_native.native_paged_attention((out,), inputs, attrs)
    elif kernel == "numpy":
        out = Tensor.empty(batch.out_shape, batch.q.dtype)
        paged.paged_attention((out,), inputs, attrs)
    else:
        on = lambda t: t.contiguous().to(device)  # noqa: E731
        out = Tensor.empty(batch.out_shape, batch.q.dtype, device)
        ops.paged_attention(out, *map(on, inputs[:6]), batch.scale, window=window, key_ends=on(key_ends))
    return out


def reference(batch: Batch, window: int = 0) -> torch.Tensor:
    """float64 attention, each query over the keys [max(0, p + 1 - window), key_ends[i]) of its
    sequence, gathered position by position through the block table: an explicit mask."""
    q, kc, vc = to_torch(batch.q), to_torch(batch.k_cache), to_torch(batch.v_cache)
    bt, qs, cl = batch.block_tables.numpy(), batch.query_starts.numpy(), batch.context_lens.numpy()
    ke = torch.from_numpy(batch.key_ends.numpy())
    n, h, _ = q.shape
    bs, kh = kc.shape[1], kc.shape[2]
    out = torch.zeros(n, h, vc.shape[3], dtype=torch.float64)
    for b in range(len(cl)):
        q0, q1, t = int(qs[b]), int(qs[b + 1]), int(cl[b])
        if q1 == q0:
            continue
        key = torch.arange(t)
        blocks = torch.from_numpy(bt[b])[key // bs]
        k = kc[blocks, key % bs].repeat_interleave(h // kh, dim=1)  # (T, H, D)
        v = vc[blocks, key % bs].repeat_interleave(h // kh, dim=1)  # (T, H, Dv)
        pos = torch.arange(t - (q1 - q0), t)  # (S,) the queries' positions
        start = (pos + 1 - window).clamp(min=0) if window else torch.zeros_like(pos)
        seen = (key[None, :] >= start[:, None]) & (key[None, :] < ke[q0:q1, None])  # (S, T)
        scores = torch.einsum("shd,thd->hst", q[q0:q1], k) * batch.scale  # (H, S, T)
        scores = scores.masked_fill(~seen, -math.inf)
        out[q0:q1] = torch.einsum("hst,thd->shd", scores.softmax(-1), v)
    return out


# ---- against PyTorch ---------------------------------------------------------------------
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_key_ends_match_torch(kernel, bs, heads, window, rng):
    batch = image_batch(rng, SPECS, bs, *heads, 32)
    np.testing.assert_allclose(run(kernel, batch, window).numpy(), reference(batch, window).numpy(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 20])
def test_native_matches_numpy(window, rng, native_built):
    batch = image_batch(rng, SPECS, 16, 9, 3, 64)
    np.testing.assert_allclose(run("native", batch, window).numpy(), run("numpy", batch, window).numpy(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 3, 20])
@pytest.mark.parametrize("dtype", dtype_params((DataType.F16, DataType.BF16)))
def test_half_types(dtype, window, rng):
    batch = image_batch(rng, SPECS, 4, 6, 2, 32, dtype=dtype)
    assert_close(run("op", batch, window), reference(batch, window))


# ---- the natural ends are the plain call ---------------------------------------------------
@pytest.mark.parametrize("window", [0, 3, 20])
@pytest.mark.parametrize("kernel, dtype", [("native", DataType.F32), ("numpy", DataType.F32), ("op", DataType.F32),
                                           ("numpy", DataType.F16), ("op", DataType.BF16)],
                         ids=["native", "numpy", "op", "numpy-f16", "op-bf16"])
def test_natural_ends_give_the_bits_of_the_plain_call(kernel, dtype, window, rng):
    batch = image_batch(rng, SPECS, 4, 6, 2, 32, dtype=dtype)
    plain = Tensor.empty(batch.out_shape, dtype)
    inputs, attrs = batch.inputs, {"scale": batch.scale, **({"window": window} if window else {})}
    if kernel == "native":
        paged_native.native_paged_attention((plain,), inputs, attrs)
    elif kernel == "numpy":
        paged.paged_attention((plain,), inputs, attrs)
    else:
        ops.paged_attention(plain, *inputs, batch.scale, window=window)
    got = run(kernel, batch, window, key_ends=_i64(natural_ends(batch)))
    assert np.array_equal(got.numpy(), plain.numpy())


# ---- batch invariance (native) -----------------------------------------------------------
def _alone(batch: Batch, b: int) -> Batch:
    """Sequence b of ``batch`` as a batch of its own (same cache, table, rows and key ends)."""
    qs, cl, bt = batch.query_starts.numpy(), batch.context_lens.numpy(), batch.block_tables.numpy()
    sub = Batch.__new__(Batch)
    sub.__dict__.update(batch.__dict__)
    rows = slice(int(qs[b]), int(qs[b + 1]))
    sub.q = _t(batch.q.numpy()[rows], batch.q.dtype)
    sub.key_ends = _i64(batch.key_ends.numpy()[rows])
    sub.block_tables, sub.context_lens = _i64(bt[b:b + 1]), _i64(cl[b:b + 1])
    sub.query_starts = _i64([0, qs[b + 1] - qs[b]])
    sub.out_shape = (int(qs[b + 1] - qs[b]),) + batch.out_shape[1:]
    return sub


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("threads", [1, 3])
def test_rows_are_batch_invariant(threads, window, rng, native_built):
    """A sequence alone (its rows one task each) gives the bits of the same rows in the whole
    batch, on any number of threads; sequences without overridden rows too."""
    from llaisys.kernels.quant import native as quant

    batch = image_batch(rng, SPECS, 16, 6, 2, 64)
    before = quant.threads()
    try:
        quant.set_threads(1)
        whole = run("native", batch, window).numpy()
        quant.set_threads(threads)
        assert np.array_equal(run("native", batch, window).numpy(), whole)
        qs = batch.query_starts.numpy()
        for b in range(len(SPECS)):
            alone = run("native", _alone(batch, b), window).numpy()
            assert np.array_equal(alone, whole[qs[b]:qs[b + 1]]), f"sequence {b}"
    finally:
        quant.set_threads(before)


@pytest.mark.parametrize("window", [0, 20])
def test_simd_levels_give_the_same_bits(window, rng, native_built):
    batch = image_batch(rng, SPECS, 4, 6, 2, 72)  # a head dim with a tail past the 16 lanes
    before = paged_native.set_simd(-1)
    try:
        paged_native.set_simd(0)
        portable = run("native", batch, window).numpy()
        levels = sorted({paged_native.set_simd(level) for level in range(1, len(paged_native.SIMD_LEVELS))} - {0})
        for level in levels:
            paged_native.set_simd(level)
            assert np.array_equal(run("native", batch, window).numpy(), portable), paged_native.SIMD_LEVELS[level]
    finally:
        paged_native.set_simd(before)
    if not levels:
        pytest.skip("this CPU has no SIMD level past the portable one")


# ---- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("row, value, match", [
    # row 3 is the query at position 2 of sequence 1 (context 30, all 30 rows new)
    (3, 2, r"key_ends\[3\] = 2 is outside \[3, 30\]: row 3 is the query at position 2 of sequence 1"),
    (3, 31, r"key_ends\[3\] = 31 is outside \[3, 30\]: .* context_lens\[1\] = 30 keys"),
    (0, 36, r"key_ends\[0\] = 36 is outside \[37, 37\]: row 0 is the query at position 36 of sequence 0"),
    (387, 71, r"key_ends\[387\] = 71 is outside \[70, 70\]: row 387 is the query at position 69 of sequence 7"),
])
def test_bad_key_ends_name_the_row(kernel, window, row, value, match, rng):
    batch = image_batch(rng, SPECS, 4, 4, 2, 16)
    ends = batch.key_ends.numpy()
    ends[row] = value
    with pytest.raises(ValueError, match=match):
        run(kernel, batch, window, key_ends=_i64(ends))


@pytest.mark.parametrize("change, error, match", [
    (dict(shape=(389,)), ValueError, r"key_ends has shape \(389,\); expected \(388,\)"),
    (dict(shape=(388, 1)), ValueError, r"key_ends has shape \(388, 1\); expected \(388,\)"),
    (dict(dtype=DataType.I32), TypeError, r"key_ends has data type I32; expected one of I64"),
    (dict(value=[1]), TypeError, r"key_ends must be a llaisys Tensor, got list"),
])
def test_key_ends_argument_errors(change, error, match, rng):
    batch = image_batch(rng, SPECS, 4, 4, 2, 16)
    key_ends = change.get("value", Tensor.zeros(change.get("shape", (388,)), change.get("dtype", DataType.I64)))
    with pytest.raises(error, match=match):
        ops.paged_attention(Tensor.empty(batch.out_shape), *batch.inputs, batch.scale, key_ends=key_ends)


# ---- plans and dispatch ------------------------------------------------------------------
@pytest.mark.parametrize("window", [0, 20])
def test_plan_replays_with_key_ends_reloaded_in_place(window, rng, native_built):
    """A recorded call runs natively in a stretch, reads key_ends at every run (reloaded in
    place), and a bad one raises the direct call's error from the replay."""
    from llaisys.ops.plan import ReplayStats

    batch = image_batch(rng, SPECS, 4, 6, 2, 32)
    out = Tensor.zeros(batch.out_shape)
    plan = ops.Plan()
    ops.paged_attention(out, *batch.inputs, batch.scale, window=window, key_ends=batch.key_ends, plan=plan)
    name = "paged_attention_window_ends" if window else "paged_attention_ends"
    assert plan.calls[0][0] is find_kernel(name, "cpu", DataType.F32)
    assert plan.stats() == ReplayStats(calls=1, native=1, stretches=1, python=0)
    assert not out.numpy().any()  # recorded, not run
    plan.run()
    assert np.array_equal(out.numpy(), run("op", batch, window).numpy())
    np.testing.assert_allclose(out.numpy(), reference(batch, window).numpy(), rtol=1e-5, atol=1e-5)
    batch.key_ends.load(natural_ends(batch))
    plan.run()
    plain = Tensor.empty(batch.out_shape)
    ops.paged_attention(plain, *batch.inputs, batch.scale, window=window)
    assert np.array_equal(out.numpy(), plain.numpy())
    bad = natural_ends(batch)
    bad[40] = 0
    batch.key_ends.load(bad)
    with pytest.raises(ValueError, match=r"paged_attention: key_ends\[40\] = 0 is outside"):
        plan.run()


def test_each_form_dispatches_under_its_own_name(rng):
    names = {(w, e): "paged_attention" + ("_window" if w else "") + ("_ends" if e else "")
             for w in (0, 5) for e in (False, True)}
    batch = image_batch(rng, SPECS, 4, 4, 2, 16)
    for (window, ends), name in names.items():
        for dtype in (DataType.F32, DataType.F16):
            assert find_kernel(name, "cpu", dtype) is not None, (name, dtype)
        plan = ops.Plan()
        ops.paged_attention(Tensor.empty(batch.out_shape), *batch.inputs, batch.scale, window=window,
                            key_ends=batch.key_ends if ends else None, plan=plan)
        assert plan.calls[0][0] is find_kernel(name, "cpu", DataType.F32)


@pytest.mark.parametrize("window", [0, 3])
def test_a_device_without_the_ends_kernel_runs_the_cpu_fallback(fake_device, window, rng):
    """A device whose paged_attention kernels know no key_ends (as a plugin's) is never handed
    them: the call runs the CPU kernel on host copies."""
    def no_key_ends(outputs, inputs, attrs):
        raise AssertionError(f"a kernel without key_ends got {len(inputs)} inputs")

    for name in ("paged_attention", "paged_attention_window"):
        register_kernel(name, "fakedev", dtypes=(DataType.F32,), kernel=no_key_ends)
    try:
        batch = image_batch(rng, SPECS, 4, 6, 2, 32)
        got = run("op", batch, window, device="fakedev:0")
        np.testing.assert_allclose(got.numpy(), reference(batch, window).numpy(), rtol=1e-5, atol=1e-5)
    finally:
        unregister_kernels("fakedev", ("paged_attention", "paged_attention_window"))


# ---- the Triton kernel, interpreted without a GPU ---------------------------------------------
NV_SPECS = [(13, 1, ()), (24, 24, ((3, 12),)), (40, 9, ((33, 38),)), (7, 0, ())]


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("dtype", dtype_params((DataType.F32, DataType.F16)))
def test_nvidia_key_ends_match_torch(nvidia_device, dtype, window, rng):
    batch = image_batch(rng, NV_SPECS, 4, 4, 2, 16, dtype=dtype)
    assert_close(run("op", batch, window, device=nvidia_device), reference(batch, window), dtype)


def test_nvidia_decoding_rows_and_natural_ends(nvidia_device, rng):
    """A decoding step (a program per token, which finds its sequence) with key_ends, and a
    prefill whose key_ends are the natural ones: the plain call's values."""
    for specs in ([(13, 1, ()), (30, 1, ()), (5, 1, ())], [(24, 24, ()), (9, 3, ())]):
        batch = image_batch(rng, specs, 4, 4, 2, 16)
        plain = Tensor.empty(batch.out_shape, DataType.F32, nvidia_device)
        ops.paged_attention(plain, *(t.contiguous().to(nvidia_device) for t in batch.inputs), batch.scale)
        got = run("op", batch, 0, device=nvidia_device)
        np.testing.assert_allclose(got.numpy(), plain.numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got.numpy(), reference(batch).numpy(), rtol=1e-5, atol=1e-5)


def test_nvidia_bad_key_ends_raise_when_checked(nvidia_device, rng, monkeypatch):
    monkeypatch.setenv("LLAISYS_NVIDIA_CHECK", "1")
    batch = image_batch(rng, NV_SPECS, 4, 4, 2, 16)
    ends = batch.key_ends.numpy()
    ends[2] = 25
    with pytest.raises(ValueError, match=r"key_ends\[2\] = 25 is outside \[2, 24\]: row 2 is the query at position 1 "
                                         r"of sequence 1"):
        run("op", batch, 0, key_ends=_i64(ends), device=nvidia_device)
