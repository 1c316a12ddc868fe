"""The paged KV-cache ops (kv_cache_write, paged_attention) against PyTorch in float64, per
sequence on keys gathered slot by slot through its block table; the native kernel against the
NumPy reference; batch invariance of the native kernel (bitwise); argument errors; Plan."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llaisys import DataType, Tensor, ops
from llaisys.kernels.cpu import paged, paged_native

from conftest import assert_close, dtype_params, to_torch

NOT_BUILT = "llaisys._native._kernels was not built: pip install -e . needs a C compiler"
KERNELS = ("native", "numpy")


@pytest.fixture
def rng():
    return np.random.default_rng(4321)


@pytest.fixture
def native_built():
    """The native library must exist wherever the suite runs (the install builds it)."""
    assert paged_native.available(), NOT_BUILT


@pytest.fixture
def pool_threads():
    """Sets the native pool's thread count (``pool_threads(n)``); the old count comes back after."""
    from llaisys.kernels.quant import native as quant

    before = quant.threads()
    yield quant.set_threads
    quant.set_threads(before)


def _t(a: np.ndarray, dtype: DataType = DataType.F32) -> Tensor:
    return Tensor.from_numpy(np.asarray(a), dtype=dtype)


def _i64(a) -> Tensor:
    return Tensor.from_numpy(np.asarray(a, np.int64))


class Batch:
    """A flat batch over a random block pool: specs are (context_len, q_len) per sequence; each
    sequence gets shuffled, non-adjacent blocks; table entries it does not need hold -1."""

    def __init__(self, rng, specs, bs, h, kh, d, dv=None, dtype=DataType.F32, spare_blocks=3, mb=None):
        dv = d if dv is None else dv
        need = [math.ceil(c / bs) for c, _ in specs]
        nb = sum(need) + spare_blocks
        self.mb = mb or max(need + [1]) + 1
        order = rng.permutation(nb)
        tables, at = np.full((len(specs), self.mb), -1, np.int64), 0
        for b, k in enumerate(need):
            tables[b, :k] = order[at:at + k]
            at += k
        starts = np.concatenate([[0], np.cumsum([s for _, s in specs])])
        self.n, self.scale = int(starts[-1]), 1 / math.sqrt(d)
        self.k_cache = _t(rng.standard_normal((nb, bs, kh, d)), dtype)  # (NB, BS, KH, D)
        self.v_cache = _t(rng.standard_normal((nb, bs, kh, dv)), dtype)  # (NB, BS, KH, Dv)
        # q as the first H heads of a fused (N, H + 2 KH, D) qkv buffer: a strided view
        qkv = _t(rng.standard_normal((self.n, h + 2 * kh, d)), dtype)
        self.q = qkv.slice(1, 0, h)  # (N, H, D)
        self.block_tables, self.query_starts = _i64(tables), _i64(starts)
        self.context_lens = _i64([c for c, _ in specs])
        self.out_shape = (self.n, h, dv)

    @property
    def inputs(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_starts, self.context_lens)

    def run(self, kernel: str = "native") -> Tensor:
        out = Tensor.empty(self.out_shape, self.q.dtype)
        attention(kernel, out, *self.inputs, self.scale)
        return out


def attention(kernel: str, out: Tensor, q, k_cache, v_cache, block_tables, query_starts, context_lens, scale) -> None:
    """paged_attention through the native kernel, the NumPy one, or the op (the registered one)."""
    inputs, attrs = (q, k_cache, v_cache, block_tables, query_starts, context_lens), {"scale": scale}
    if kernel == "native":
        assert paged_native.available(), NOT_BUILT
        paged_native.native_paged_attention((out,), inputs, attrs)
    elif kernel == "numpy":
        paged.paged_attention((out,), inputs, attrs)
    else:
        ops.paged_attention(out, *inputs, scale)


def write(kernel: str, k_cache, v_cache, k, v, slots) -> None:
    """kv_cache_write through the native kernel, the NumPy one, or the op."""
    if kernel == "native":
        assert paged_native.available(), NOT_BUILT
        paged_native.native_kv_cache_write((k_cache, v_cache), (k, v, slots), {})
    elif kernel == "numpy":
        paged.kv_cache_write((k_cache, v_cache), (k, v, slots), {})
    else:
        ops.kv_cache_write(k_cache, v_cache, k, v, slots)


def reference(q, k_cache, v_cache, block_tables, query_starts, context_lens, scale) -> torch.Tensor:
    """float64 attention per sequence: keys gathered position by position through the table."""
    q, kc, vc = to_torch(q), to_torch(k_cache), to_torch(v_cache)
    bt, qs, cl = block_tables.numpy(), query_starts.numpy(), context_lens.numpy()
    n, h, _ = q.shape
    bs, kh = kc.shape[1], kc.shape[2]
    out = torch.zeros(n, h, vc.shape[3], dtype=torch.float64)
    for b in range(len(cl)):
        q0, q1, t = int(qs[b]), int(qs[b + 1]), int(cl[b])
        s = q1 - q0
        if s == 0:
            continue
        pos = torch.arange(t)
        blocks = torch.from_numpy(bt[b])[pos // bs]
        k = kc[blocks, pos % bs].repeat_interleave(h // kh, dim=1)  # (T, H, D)
        v = vc[blocks, pos % bs].repeat_interleave(h // kh, dim=1)  # (T, H, Dv)
        scores = torch.einsum("shd,thd->hst", q[q0:q1], k) * scale  # (H, S, T)
        future = pos[None, :] > (torch.arange(s)[:, None] + (t - s))  # query i sits at t - s + i
        scores = scores.masked_fill(future, -math.inf)
        out[q0:q1] = torch.einsum("hst,thd->shd", scores.softmax(-1), v)
    return out


# decoding one token (a short and a long context), a fresh prefill, a chunk of a longer
# prompt (earlier chunks cached), a first token, and a sequence with no queries this step
MIXED = [(37, 1), (9, 9), (50, 7), (1, 1), (20, 0), (70, 1)]


# ---- against PyTorch ---------------------------------------------------------------------
@pytest.mark.parametrize("kernel", KERNELS + ("op",))
@pytest.mark.parametrize("d", [64, 32])
@pytest.mark.parametrize("heads", [(6, 2), (6, 6)], ids=["gqa", "mha"])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_paged_attention_matches_torch(kernel, d, heads, bs, rng):
    h, kh = heads
    batch = Batch(rng, MIXED, bs, h, kh, d)
    out = batch.run(kernel)
    np.testing.assert_allclose(out.numpy(), reference(*batch.inputs, batch.scale).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_paged_attention_value_dim_differs(kernel, rng):
    batch = Batch(rng, [(23, 5), (40, 1)], 4, 4, 2, 64, dv=32)
    out = batch.run(kernel)
    np.testing.assert_allclose(out.numpy(), reference(*batch.inputs, batch.scale).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", dtype_params((DataType.F16, DataType.BF16)))
def test_paged_attention_half_caches(dtype, rng):
    batch = Batch(rng, MIXED, 4, 6, 2, 32, dtype=dtype)
    assert_close(batch.run("op"), reference(*batch.inputs, batch.scale))


def test_native_matches_numpy_reference(rng, native_built):
    specs = [(int(c), int(s)) for c, s in zip(rng.integers(1, 300, 12), rng.integers(1, 40, 12))]
    specs = [(max(c, s), s) for c, s in specs] + [(300, 300)]  # and a long prefill: N > 256
    batch = Batch(rng, specs, 16, 9, 3, 64)
    np.testing.assert_allclose(batch.run("native").numpy(), batch.run("numpy").numpy(), rtol=1e-5, atol=1e-5)


def test_op_runs_numpy_without_native_library(rng, monkeypatch):
    monkeypatch.setattr(paged_native, "_lib", False)  # as if the library was not built
    batch = Batch(rng, MIXED, 4, 6, 2, 32)
    k_cache, v_cache = Tensor.zeros((2, 4, 2, 32)), Tensor.zeros((2, 4, 2, 32))
    k = _t(rng.standard_normal((2, 2, 32)))
    ops.kv_cache_write(k_cache, v_cache, k, k, _i64([6, 1]))
    assert np.array_equal(k_cache.numpy().reshape(8, 2, 32)[[6, 1]], k.numpy())
    out = batch.run("op")
    np.testing.assert_allclose(out.numpy(), reference(*batch.inputs, batch.scale).numpy(), rtol=1e-5, atol=1e-5)


def test_op_falls_back_to_numpy_for_strided_head_dim(rng):
    batch = Batch(rng, MIXED, 4, 6, 2, 32)
    batch.q = _t(rng.standard_normal((32, 6, batch.n))).permute(2, 1, 0)  # (N, H, D), D strided
    out = batch.run("op")
    np.testing.assert_allclose(out.numpy(), reference(*batch.inputs, batch.scale).numpy(), rtol=1e-5, atol=1e-5)


# ---- batch invariance (native) -----------------------------------------------------------
def _rows_of(batch: Batch, out: Tensor, b: int) -> np.ndarray:
    qs = batch.query_starts.numpy()
    return out.numpy()[qs[b]:qs[b + 1]]


def _sub_batch(batch: Batch, seqs: list[int], q_lens: list[int] | None = None) -> Batch:
    """A batch of some of ``batch``'s sequences (same cache, same tables, same q rows)."""
    qs, cl, bt = batch.query_starts.numpy(), batch.context_lens.numpy(), batch.block_tables.numpy()
    sub = Batch.__new__(Batch)
    sub.__dict__.update(batch.__dict__)
    rows = np.concatenate([np.arange(qs[b], qs[b + 1]) for b in seqs])
    sub.q = _t(batch.q.numpy()[rows])
    sub.block_tables, sub.context_lens = _i64(bt[seqs]), _i64(cl[seqs])
    sub.query_starts = _i64(np.concatenate([[0], np.cumsum([qs[b + 1] - qs[b] for b in seqs])]))
    sub.n = len(rows)
    sub.out_shape = (sub.n,) + batch.out_shape[1:]
    return sub


@pytest.mark.parametrize("heads", [(9, 3), (6, 6)], ids=["gqa", "mha"])
def test_batch_invariance_alone_vs_batched(heads, rng, native_built):
    # 32 decoding sequences (enough K/V to use every thread) around one prefill chunk
    specs = [(int(c), 1) for c in rng.integers(100, 400, 31)]
    specs.insert(13, (150, 12))
    batch = Batch(rng, specs, 16, *heads, 64)
    full = batch.run("native")
    for b in (0, 13, 31):
        alone = _sub_batch(batch, [b]).run("native")
        assert np.array_equal(alone.numpy(), _rows_of(batch, full, b)), f"sequence {b}"
    pair = _sub_batch(batch, [31, 13])
    got = pair.run("native").numpy()
    assert np.array_equal(got[1:], _rows_of(batch, full, 13))


@pytest.mark.parametrize("split", [1, 30, 64, 69])
def test_batch_invariance_chunked_prefill(split, rng, native_built):
    """A prompt of 70 tokens in one call, or in two (the first chunk's K/V written before the
    second call), gives the same bits; the K/V of each chunk go in with kv_cache_write."""
    h, kh, d, bs, t = 6, 2, 64, 4, 70
    nb = 24
    k_cache, v_cache = Tensor.zeros((nb, bs, kh, d)), Tensor.zeros((nb, bs, kh, d))
    table = rng.permutation(nb)[: t // bs + 1]
    block_tables = _i64(table[None, :])
    q = _t(rng.standard_normal((t, h, d)))
    k, v = _t(rng.standard_normal((t, kh, d))), _t(rng.standard_normal((t, kh, d)))
    slots = table[np.arange(t) // bs] * bs + np.arange(t) % bs
    scale = 0.125

    def step(lo: int, hi: int) -> np.ndarray:
        ops.kv_cache_write(k_cache, v_cache, k.slice(0, lo, hi), v.slice(0, lo, hi), _i64(slots[lo:hi]))
        out = Tensor.empty((hi - lo, h, d))
        attention("native", out, q.slice(0, lo, hi), k_cache, v_cache, block_tables, _i64([0, hi - lo]),
                  _i64([hi]), scale)
        return out.numpy()

    chunked = np.concatenate([step(0, split), step(split, t)])
    whole = step(0, t)
    assert np.array_equal(chunked, whole)


def test_block_size_does_not_change_bits(rng, native_built):
    t, h, kh, d = 90, 6, 2, 32
    q, k, v = rng.standard_normal((5, h, d)), rng.standard_normal((t, kh, d)), rng.standard_normal((t, kh, d))
    outs = []
    for bs in (1, 4, 16):
        nb = math.ceil(t / bs)
        table = rng.permutation(nb)
        kc, vc = np.zeros((nb, bs, kh, d)), np.zeros((nb, bs, kh, d))
        pos = np.arange(t)
        kc[table[pos // bs], pos % bs], vc[table[pos // bs], pos % bs] = k, v
        out = Tensor.empty((5, h, d))
        attention("native", out, _t(q), _t(kc), _t(vc), _i64(table[None]), _i64([0, 5]), _i64([t]), 0.2)
        outs.append(out.numpy())
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


@pytest.mark.parametrize("shape", [(6, 2, 64, 64), (12, 2, 128, 128), (6, 6, 72, 40), (8, 1, 20, 24)],
                         ids=["gqa", "qwen", "tails", "mqa"])
def test_simd_levels_give_the_same_bits(shape, rng, native_built, pool_threads):
    """Every level the CPU has (portable, AVX2, AVX-512) gives the portable path's bits: head
    dims with a tail past the 16 lanes, contexts over several segments, split decoding rows."""
    h, kh, d, dv = shape
    batch = Batch(rng, MIXED + [(600, 1), (300, 17)], 4, h, kh, d, dv=dv)
    before = paged_native.set_simd(-1)
    pool_threads(2)
    try:
        paged_native.set_simd(0)
        portable = batch.run("native").numpy()
        levels = sorted({paged_native.set_simd(level) for level in range(1, len(paged_native.SIMD_LEVELS))} - {0})
        for level in levels:
            paged_native.set_simd(level)
            got = batch.run("native")
            assert np.array_equal(got.numpy(), portable), paged_native.SIMD_LEVELS[level]
            decode = _sub_batch(batch, [6])  # one token over 600 keys: split over the threads
            assert np.array_equal(decode.run("native").numpy(), _rows_of(batch, got, 6))
    finally:
        paged_native.set_simd(before)
    if not levels:
        pytest.skip("this CPU has no SIMD level past the portable one")


@pytest.mark.parametrize("heads", [(9, 3), (12, 2)], ids=["smol", "qwen"])
def test_decoding_gives_the_same_bits_on_any_number_of_threads(heads, rng, native_built, pool_threads):
    """A lone decoding row (its keys cut into segments over the threads, their softmax states
    merged after) has the bits of the same row in a big batch (one task for all its keys)."""
    h, kh = heads
    specs = [(1100, 1)] + [(int(c), 1) for c in rng.integers(200, 700, 40)]
    batch = Batch(rng, specs, 16, h, kh, 64)
    pool_threads(1)
    full = batch.run("native")
    alone = _sub_batch(batch, [0])
    for threads in (1, 2, 3, 5):
        pool_threads(threads)
        assert np.array_equal(alone.run("native").numpy(), _rows_of(batch, full, 0)), f"{threads} threads"
        assert np.array_equal(batch.run("native").numpy(), full.numpy()), f"{threads} threads"


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_rows_match_each_token_alone(threads, rng, native_built, pool_threads):
    """Tokens grouped in one task (sharing the key and value rows it loads) give the bits of
    each token run alone, over a prompt that crosses segment boundaries."""
    h, kh, d, bs, t = 6, 2, 64, 16, 300
    batch = Batch(rng, [(t, t)], bs, h, kh, d)
    pool_threads(threads)
    whole = batch.run("native").numpy()
    q = batch.q.numpy()
    for i in list(range(0, t, 23)) + [255, 256, 257, t - 1]:
        out = Tensor.empty((1, h, d))
        attention("native", out, _t(q[i:i + 1]), batch.k_cache, batch.v_cache, batch.block_tables, _i64([0, 1]),
                  _i64([i + 1]), batch.scale)
        assert np.array_equal(out.numpy()[0], whole[i]), f"token {i}"


# ---- kv_cache_write ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("kernel", KERNELS + ("op",))
def test_kv_cache_write_lands_in_slots(kernel, dtype, rng):
    nb, bs, kh, d, dv, h = 5, 4, 2, 8, 6, 3
    k_host, v_host = np.full((nb, bs, kh, d), 7.0), np.full((nb, bs, kh, dv), -7.0)
    k_cache, v_cache = _t(k_host, dtype), _t(v_host, dtype)
    slots = np.array([13, 0, 19, 6, 7], np.int64)
    # k and v as strided slices of one fused (N, H + 2 KH, D) buffer (dv < d: a narrower slice)
    qkv = _t(rng.standard_normal((len(slots), h + 2 * kh, d)), dtype)
    k, v = qkv.slice(1, h, h + kh), qkv.slice(1, h + kh, h + 2 * kh).slice(2, 1, 1 + dv)
    write(kernel, k_cache, v_cache, k, v, _i64(slots))
    k_host[slots // bs, slots % bs], v_host[slots // bs, slots % bs] = k.numpy(), v.numpy()
    assert np.array_equal(k_cache.numpy().astype(np.float64), k_host)  # others untouched
    assert np.array_equal(v_cache.numpy().astype(np.float64), v_host)


def test_kv_cache_write_strided_head_dim(rng):
    k_cache, v_cache = Tensor.zeros((3, 2, 2, 4)), Tensor.zeros((3, 2, 2, 4))
    k = _t(rng.standard_normal((4, 2, 3))).permute(2, 1, 0)  # (3, 2, 4), last dim strided
    v = _t(rng.standard_normal((3, 2, 4)))
    ops.kv_cache_write(k_cache, v_cache, k, v, _i64([5, 0, 2]))
    assert np.array_equal(k_cache.numpy().reshape(6, 2, 4)[[5, 0, 2]], k.numpy())
    assert np.array_equal(v_cache.numpy().reshape(6, 2, 4)[[5, 0, 2]], v.numpy())


@pytest.mark.parametrize("kernel", KERNELS + ("op",))
@pytest.mark.parametrize("bad", [12, -1, 100])
def test_kv_cache_write_slot_out_of_range(kernel, bad, rng):
    k_cache, v_cache = Tensor.zeros((3, 4, 1, 2)), Tensor.zeros((3, 4, 1, 2))
    k, v = _t(rng.standard_normal((3, 1, 2))), _t(rng.standard_normal((3, 1, 2)))
    with pytest.raises(ValueError, match=rf"slots\[2\] = {bad} is outside \[0, 12\)"):
        write(kernel, k_cache, v_cache, k, v, _i64([1, 11, bad]))
    assert not k_cache.numpy().any() and not v_cache.numpy().any()  # checked before any write


@pytest.mark.parametrize("change, error, match", [
    (dict(k=(3, 2, 5)), ValueError, r"k has shape \(3, 2, 5\); expected \(3, 2, 4\)"),
    (dict(v=(3, 1, 4)), ValueError, r"v has shape \(3, 1, 4\); expected \(3, 2, 4\)"),
    (dict(v_cache=(4, 4, 2, 4)), ValueError, r"v_cache has shape \(4, 4, 2, 4\); expected \(3, 4, 2, Dv\)"),
    (dict(k_cache=(12, 2, 4)), ValueError, r"k_cache must be 4-D \(NB, BS, KH, D\)"),
    (dict(slots=(3, 1)), ValueError, r"slots must be 1-D"),
    (dict(slots_dtype=DataType.F32), TypeError, r"slots has data type F32; expected one of I64"),
    (dict(v_dtype=DataType.F16), TypeError, r"v has data type F16 but k_cache has F32"),
    (dict(cache_dtype=DataType.I64), TypeError, r"k_cache has data type I64; expected one of"),
])
def test_kv_cache_write_argument_errors(change, error, match):
    shapes = dict(k_cache=(3, 4, 2, 4), v_cache=(3, 4, 2, 4), k=(3, 2, 4), v=(3, 2, 4), slots=(3,))
    shapes.update({key: val for key, val in change.items() if not key.endswith("dtype")})
    cache_dtype = change.get("cache_dtype", DataType.F32)
    k_cache, v_cache = Tensor.zeros(shapes["k_cache"], cache_dtype), Tensor.zeros(shapes["v_cache"], cache_dtype)
    k = Tensor.zeros(shapes["k"], cache_dtype)
    v = Tensor.zeros(shapes["v"], change.get("v_dtype", cache_dtype))
    slots = Tensor.zeros(shapes["slots"], change.get("slots_dtype", DataType.I64))
    with pytest.raises(error, match=match):
        ops.kv_cache_write(k_cache, v_cache, k, v, slots)


def test_kv_cache_write_refuses_non_tensors():
    with pytest.raises(TypeError, match="slots must be a llaisys Tensor, got list"):
        ops.kv_cache_write(Tensor.zeros((1, 1, 1, 1)), Tensor.zeros((1, 1, 1, 1)), Tensor.zeros((1, 1, 1)),
                           Tensor.zeros((1, 1, 1)), [0])


# ---- paged_attention errors --------------------------------------------------------------
def _args(n=3, h=4, kh=2, d=8, dv=8, nb=4, bs=4, b=2, mb=3, dtype=DataType.F32, index_dtype=DataType.I64):
    return dict(out=Tensor.zeros((n, h, dv), dtype), q=Tensor.zeros((n, h, d), dtype),
                k_cache=Tensor.zeros((nb, bs, kh, d), dtype), v_cache=Tensor.zeros((nb, bs, kh, dv), dtype),
                block_tables=Tensor.zeros((b, mb), index_dtype), query_starts=Tensor.zeros((b + 1,), index_dtype),
                context_lens=Tensor.zeros((b,), index_dtype), scale=0.5)


@pytest.mark.parametrize("replace, error, match", [
    (dict(q=(3, 5, 8)), ValueError, r"q has 5 heads, not a multiple of the 2 key/value heads"),
    (dict(q=(3, 4, 6)), ValueError, r"k_cache has head dim 8 .* but q has 6"),
    (dict(q=(3, 4)), ValueError, r"q must be 3-D \(N, H, D\)"),
    (dict(out=(3, 4, 6)), ValueError, r"out has shape \(3, 4, 6\); expected \(3, 4, 8\)"),
    (dict(v_cache=(4, 2, 2, 8)), ValueError, r"v_cache has shape \(4, 2, 2, 8\); expected \(4, 4, 2, Dv\)"),
    (dict(query_starts=(2,)), ValueError, r"query_starts has shape \(2,\); expected \(3,\)"),
    (dict(context_lens=(3,)), ValueError, r"context_lens has shape \(3,\); expected \(2,\)"),
    (dict(block_tables=(6,)), ValueError, r"block_tables must be 2-D \(B, MB\)"),
    (dict(k_cache=(4, 0, 2, 8), v_cache=(4, 0, 2, 8)), ValueError, r"BS = 0"),
])
def test_paged_attention_shape_errors(replace, error, match):
    args = _args()
    for name, shape in replace.items():
        args[name] = Tensor.zeros(shape, args[name].dtype)
    with pytest.raises(error, match=match):
        ops.paged_attention(**args)


def test_paged_attention_type_errors():
    args = _args()
    args["context_lens"] = Tensor.zeros((2,), DataType.I32)
    with pytest.raises(TypeError, match="context_lens has data type I32; expected one of I64"):
        ops.paged_attention(**args)
    args = _args()
    args["k_cache"] = Tensor.zeros((4, 4, 2, 8), DataType.F16)
    with pytest.raises(TypeError, match="k_cache has data type F16 but out has F32"):
        ops.paged_attention(**args)
    args = _args(dtype=DataType.I64)
    with pytest.raises(TypeError, match="q has data type I64; expected one of"):
        ops.paged_attention(**args)
    with pytest.raises(TypeError, match="scale must be a real number"):
        ops.paged_attention(**{**_args(), "scale": "0.5"})


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("starts, lens, table, match", [
    ([1, 2, 3], [4, 4], [[0, 1, -1], [2, -1, -1]], r"query_starts\[0\] is 1; expected 0"),
    ([0, 2, 1], [4, 4], [[0, 1, -1], [2, -1, -1]], r"query_starts\[2\] = 1 is less than query_starts\[1\]"),
    ([0, 1, 2], [4, 4], [[0, 1, -1], [2, -1, -1]], r"query_starts\[2\] is 2; .* end at N = 3"),
    ([0, 1, 3], [4, 1], [[0, 1, -1], [2, -1, -1]], r"context_lens\[1\] = 1 is less than the 2 queries of sequence 1"),
    ([0, 1, 3], [13, 4], [[0, 1, 3], [2, -1, -1]], r"context_lens\[0\] = 13 exceeds the MB \* BS = 3 \* 4 = 12"),
    ([0, 1, 3], [5, 4], [[0, -1, -1], [2, -1, -1]], r"block_tables\[0, 1\] = -1 is outside \[0, 4\)"),
    ([0, 1, 3], [5, 4], [[0, 1, -1], [4, -1, -1]], r"block_tables\[1, 0\] = 4 is outside \[0, 4\)"),
])
def test_paged_attention_index_errors(kernel, starts, lens, table, match):
    args = _args()
    args["query_starts"], args["context_lens"], args["block_tables"] = _i64(starts), _i64(lens), _i64(table)
    with pytest.raises(ValueError, match=match):
        attention(kernel, *args.values())


# ---- plans ---------------------------------------------------------------------------------
def test_plan_records_and_replays(rng):
    h, kh, d, bs = 6, 2, 32, 4
    batch = Batch(rng, MIXED, bs, h, kh, d)
    n = batch.n
    k, v = _t(rng.standard_normal((n, kh, d))), _t(rng.standard_normal((n, kh, d)))
    # every token of the step writes a slot of its sequence's last positions
    qs, cl, bt = batch.query_starts.numpy(), batch.context_lens.numpy(), batch.block_tables.numpy()
    pos = np.concatenate([np.arange(cl[b] - (qs[b + 1] - qs[b]), cl[b]) for b in range(len(cl))])
    seq = np.repeat(np.arange(len(cl)), np.diff(qs))
    slots = _i64(bt[seq, pos // bs] * bs + pos % bs)

    def step(plan):
        ops.kv_cache_write(batch.k_cache, batch.v_cache, k, v, slots, plan=plan)
        ops.paged_attention(out, *batch.inputs, batch.scale, plan=plan)

    out = Tensor.zeros(batch.out_shape)
    plan = ops.Plan()
    step(plan)
    assert len(plan) == 2 and not out.numpy().any()  # recorded, not run
    plan.run()
    recorded = out.numpy()
    np.testing.assert_allclose(recorded, reference(*batch.inputs, batch.scale).numpy(), rtol=1e-5, atol=1e-5)
    step(None)
    assert np.array_equal(out.numpy(), recorded)
    # new keys in the same tensor: the replay writes and reads them
    k.load(rng.standard_normal((n, kh, d)).astype(np.float32))
    plan.run()
    assert not np.array_equal(out.numpy(), recorded)
    np.testing.assert_allclose(out.numpy(), reference(*batch.inputs, batch.scale).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [DataType.F32, DataType.F16])
def test_plan_runs_both_ops_in_one_native_stretch(cache_dtype, rng, native_built):
    """A replayed plan runs both paged ops inside one native stretch (``native_call``) with
    the bits of the direct calls; it reads index tensors reloaded in place at each run,
    follows a rebind, and a bad index raises the direct call's error."""
    from llaisys.kernels.cpu import native_calls
    from llaisys.ops.plan import ReplayStats

    assert native_calls.available(), NOT_BUILT
    h, kh, d, bs = 6, 2, 32, 4
    batch = Batch(rng, MIXED, bs, h, kh, d, dtype=cache_dtype)
    n = batch.n
    k = _t(rng.standard_normal((n, kh, d)), cache_dtype)
    v = _t(rng.standard_normal((n, kh, d)), cache_dtype)
    qs, cl, bt = batch.query_starts.numpy(), batch.context_lens.numpy(), batch.block_tables.numpy()
    pos = np.concatenate([np.arange(cl[b] - (qs[b + 1] - qs[b]), cl[b]) for b in range(len(cl))])
    seq = np.repeat(np.arange(len(cl)), np.diff(qs))
    slots = _i64(bt[seq, pos // bs] * bs + pos % bs)
    out = Tensor.zeros(batch.out_shape, cache_dtype)
    plan = ops.Plan()
    ops.kv_cache_write(batch.k_cache, batch.v_cache, k, v, slots, plan=plan)
    ops.paged_attention(out, *batch.inputs, batch.scale, plan=plan)
    if cache_dtype is DataType.F32:  # both in one stretch, nothing called from Python
        assert plan.stats() == ReplayStats(calls=2, native=2, stretches=1, python=0)
    else:  # the cache write is native for every float type; F16 attention is NumPy
        assert plan.stats() == ReplayStats(calls=2, native=1, stretches=1, python=1)
    k_before, v_before = batch.k_cache.numpy(), batch.v_cache.numpy()
    plan.run()
    replayed, k_after = out.numpy(), batch.k_cache.numpy()
    batch.k_cache.load(k_before), batch.v_cache.load(v_before)
    write("numpy", batch.k_cache, batch.v_cache, k, v, slots)
    assert np.array_equal(batch.k_cache.numpy(), k_after)
    direct = batch.run("op")
    assert np.array_equal(replayed, direct.numpy())
    # the next step: one more key for the first sequence, its index tensors reloaded in place
    cl2 = cl.copy()
    cl2[0] += 1
    slot0 = bt[0, cl[0] // bs] * bs + cl[0] % bs
    slots.load(np.where(np.arange(n) == 0, slot0, slots.numpy()))
    batch.context_lens.load(cl2)
    k.load(rng.standard_normal((n, kh, d)).astype(np.float32))
    plan.run()
    assert batch.k_cache.numpy()[slot0 // bs, slot0 % bs].tolist() == k.numpy()[0].tolist()
    assert np.array_equal(out.numpy(), batch.run("op").numpy())
    # a rebind to another output moves the block's pointer
    out2 = Tensor.zeros(batch.out_shape, cache_dtype)
    plan.rebind(1, outputs=(out2,))
    plan.run()
    assert np.array_equal(out2.numpy(), out.numpy()) and plan.stats().stretches == 1
    # bad indices reloaded in place: the direct calls' errors, raised from the replay
    slots.load(np.full(n, batch.k_cache.shape[0] * bs, np.int64))
    with pytest.raises(ValueError, match=r"kv_cache_write: slots\[0\] = .* is outside"):
        plan.run()
    slots.load(bt[seq, pos // bs] * bs + pos % bs)
    if cache_dtype is DataType.F32:
        batch.context_lens.load(np.full(len(cl), 10_000, np.int64))
        with pytest.raises(ValueError, match=r"paged_attention: context_lens\[0\] = 10000 exceeds"):
            plan.run()


# ---- on a device without these kernels (the registry's CPU fallback) ------------------------
def test_both_ops_through_the_cpu_fallback(fake_device, rng):
    """The fallback hands kernels uninitialised host copies of dense outputs; kv_cache_write
    updates its caches in place, so the slots it does not write must come back unchanged."""
    h, kh, d, bs = 6, 2, 32, 4
    batch = Batch(rng, MIXED, bs, h, kh, d)
    on = lambda t: t.to("fakedev:0")  # noqa: E731
    k_cache, v_cache = on(batch.k_cache), on(batch.v_cache)
    k, v = _t(rng.standard_normal((3, kh, d))), _t(rng.standard_normal((3, kh, d)))
    slots = np.array([5, 17, 2], np.int64)
    ops.kv_cache_write(k_cache, v_cache, on(k), on(v), on(_i64(slots)))
    want_k, want_v = batch.k_cache.numpy(), batch.v_cache.numpy()
    want_k[slots // bs, slots % bs], want_v[slots // bs, slots % bs] = k.numpy(), v.numpy()
    assert np.array_equal(k_cache.numpy(), want_k) and np.array_equal(v_cache.numpy(), want_v)
    out = Tensor.empty(batch.out_shape, device="fakedev:0")
    ops.paged_attention(out, on(batch.q.contiguous()), k_cache, v_cache, on(batch.block_tables),
                        on(batch.query_starts), on(batch.context_lens), batch.scale)
    batch.k_cache.load(want_k), batch.v_cache.load(want_v)
    np.testing.assert_allclose(out.numpy(), reference(*batch.inputs, batch.scale).numpy(), rtol=1e-5, atol=1e-5)
