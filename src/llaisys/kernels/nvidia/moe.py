"""moe_mlp (Qwen3-MoE's routed SwiGLU experts) on NVIDIA GPUs, in Triton, with no host sync.

Five launches, every size fixed by the shapes, so a decoding step can be captured in a CUDA graph:

1. ``_route``, a program per token: softmax of the router logits (N, E) in F32, the top_k
   largest probabilities (ties to the lower expert index, as the CPU's stable sort), listed in
   ascending expert order, their weights divided by their sum (NumPy's summation order) when
   ``norm_topk_prob``; writes the (token, slot) pairs' experts and weights (N*k,).
2. ``_group``, a program per expert: the pairs routed to it, in ascending pair order (an (E, N)
   table and a count per expert).
3. ``_gate_up``: each program takes a block of up to BM pairs of one expert (the blocks of all
   experts laid end to end, each program finding its own from the counts) and BN columns of
   the expert's gate and up rows: act = silu(gate h) * up h for those pairs (N*k, I). So each
   chosen expert's weights are read once per block of its pairs (once per call when decoding).
4. ``_down``: the same blocks over down's rows: y = weight * down act, per pair (N*k, D), F32.
5. ``_combine``, a program per token: out = 0 + y_slot0 + y_slot1 ..., ascending expert order
   (the CPU's order), rounded once to the output type.

The grid of 3 and 4 covers the most blocks any routing can need (N*k // BM + min(E, N*k));
programs past the last block return at once. F32 runs IEEE products (``input_precision="ieee"``)
without fused multiply-adds and F32 act; F16/BF16 run the tensor cores with F32 accumulation,
act rounded to the activations' type. Expert weights of the activations' type are read as they
are; block-quantized ones, and F16/BF16 ones under F32 activations, are dequantized once to the
activations' type (``quant.dequantized``, kept with the frozen weight), as ``linear`` does: every
combination ``ops.moe_mlp`` accepts, so none takes the registry's CPU fallback (host copies,
which a CUDA graph cannot hold).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from ...runtime.dtypes import QUANTIZED_TYPES, DataType
from ..registry import register_kernel
from ._common import FLOATS, TORCH_DTYPES, interpreted, launch, next_pow2, rows, run_rows, tv
from .quant import dequantized

if TYPE_CHECKING:
    from ...tensor import Tensor

GROUP_BLOCK = 1024  # pairs scanned per step of ``_group``
COMBINE_BLOCK = 1024
BLOCK_N, BLOCK_K = 64, 32
INTERPRETED_BLOCK = 128  # the interpreter runs a program as NumPy: fewer, larger tiles
KEPT_TOKENS = 16  # scratch of calls up to this many tokens is kept with the output (decoding)


@triton.jit
def _at(w, slot, j):
    """The value of w (EP,) in slot j (exact: one lane holds it, the others add zero)."""
    return tl.sum(tl.where(slot == j, w, 0.0), 0)


@triton.jit
def _lane(w, slot, m: tl.constexpr, END: tl.constexpr):
    """Slots m, m + 8, ... < END summed in order (one of NumPy's eight partial sums)."""
    r = _at(w, slot, m)
    for i in tl.static_range(m + 8, END, 8):
        r += _at(w, slot, i)
    return r


@triton.jit
def _numpy_sum(w, slot, K: tl.constexpr):
    """The sum of slots 0..K-1 of w in NumPy's float32 order: one by one below 8 values, else
    eight interleaved partial sums combined pairwise, then the rest (its pairwise sum up to 128)."""
    if K < 8:
        s = _at(w, slot, 0)
        for j in tl.static_range(1, K):
            s += _at(w, slot, j)
    else:
        s = ((_lane(w, slot, 0, K - K % 8) + _lane(w, slot, 1, K - K % 8))
             + (_lane(w, slot, 2, K - K % 8) + _lane(w, slot, 3, K - K % 8))) \
            + ((_lane(w, slot, 4, K - K % 8) + _lane(w, slot, 5, K - K % 8))
               + (_lane(w, slot, 6, K - K % 8) + _lane(w, slot, 7, K - K % 8)))
        for j in tl.static_range(K - K % 8, K):
            s += _at(w, slot, j)
    return s


@triton.jit
def _route(ids, wts, logits, E, l_s, K: tl.constexpr, EP: tl.constexpr, NORM: tl.constexpr):
    """Token t: its K experts ids[t*K:(t+1)*K] (int32, ascending) and weights wts (F32), the
    top K of softmax(logits[t, :E]) (ties to the lower index), divided by their sum if NORM."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    ok = e < E
    x = tl.load(logits + t * l_s + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.div_rn(p, tl.sum(p, 0))
    left = tl.where(ok, p, -1.0)  # padding lanes lose to every expert, even one of probability 0
    chosen = e < 0
    for _ in tl.static_range(K):
        _m, i = tl.max(left, 0, return_indices=True, return_indices_tie_break_left=True)
        chosen = chosen | (e == i)
        left = tl.where(e == i, -2.0, left)
    slot = tl.where(chosen, tl.cumsum(chosen.to(tl.int32), 0) - 1, -1)  # (EP,) ascending experts
    w = tl.where(chosen, p, 0.0)
    if NORM:
        w = tl.div_rn(w, _numpy_sum(w, slot, K))
    for j in tl.static_range(K):
        tl.store(ids + t * K + j, tl.sum(tl.where(slot == j, e, 0), 0))
        tl.store(wts + t * K + j, _at(w, slot, j))


@triton.jit
def _group(order, counts, ids, NK, N, BLOCK: tl.constexpr):
    """Expert e: the pairs p (t*K + j) with ids[p] == e, ascending, into order[e*N:], and their
    number into counts[e]."""
    e = tl.program_id(0)
    total = tl.zeros([], tl.int32)
    for start in range(0, NK, BLOCK):
        p = start + tl.arange(0, BLOCK)
        hit = tl.load(ids + p, mask=p < NK, other=-1) == e
        rank = total + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(order + e.to(tl.int64) * N + rank, p, mask=hit)
        total += tl.sum(hit.to(tl.int32), 0)
    tl.store(counts + e, total)


@triton.jit
def _block(counts, order, E, N, BM: tl.constexpr, EP: tl.constexpr):
    """Block tl.program_id(0) of the experts' pair blocks laid end to end: (its expert, E or
    more when past the last block; its pairs (BM,); which of them exist (BM,))."""
    pid = tl.program_id(0)
    e = tl.arange(0, EP)
    c = tl.load(counts + e, mask=e < E, other=0)
    nb = (c + BM - 1) // BM
    ends = tl.cumsum(nb, 0)
    ex = tl.sum((ends <= pid).to(tl.int32), 0)
    first = tl.sum(tl.where(e == ex, ends - nb, 0), 0)
    r = (pid - first) * BM + tl.arange(0, BM)
    r_ok = r < tl.sum(tl.where(e == ex, c, 0), 0)  # none past the last block: a padding lane counts 0
    pair = tl.load(order + ex.to(tl.int64) * N + r, mask=r_ok, other=0)
    return ex, pair.to(tl.int64), r_ok


@triton.jit
def _product(acc, a, w, IEEE: tl.constexpr):
    """acc + a (BM, BK) @ w (BK, BN): IEEE F32 products, or the tensor cores' in a's type."""
    if IEEE:
        return acc + tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(a, w.to(a.dtype))


@triton.jit
def _gate_up(act, h, gate, up, order, counts, E, N, D, I, h_s, g_s, u_s, K: tl.constexpr, EP: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """act[p, cols] = silu(g) * u for the block's pairs p (token p // K), with g, u = h[token] @
    rows ex*I + cols of gate and up (cols: BN of the I)."""
    ex, pair, r_ok = _block(counts, order, E, N, BM, EP)
    if ex >= E:
        return
    tok = pair // K
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    c_ok = cols < I
    wrow = ex.to(tl.int64) * I + cols  # (BN,)
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < D
        x = tl.load(h + tok[:, None] * h_s + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = c_ok[None, :] & k_ok[:, None]
        acc_g = _product(acc_g, x, tl.load(gate + wrow[None, :] * g_s + kk[:, None], mask=w_ok, other=0.0), IEEE)
        acc_u = _product(acc_u, x, tl.load(up + wrow[None, :] * u_s + kk[:, None], mask=w_ok, other=0.0), IEEE)
    a = tl.div_rn(acc_g, tl.exp(-acc_g) + 1.0) * acc_u  # the CPU swiglu's g / (e^-g + 1) * u
    tl.store(act + pair[:, None] * I + cols[None, :], a.to(act.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _down(y, act, down, wts, order, counts, E, N, D, I, d_s, K: tl.constexpr, EP: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """y[p, cols] = wts[p] * (act[p] @ rows ex*D + cols of down) for the block's pairs p (F32)."""
    ex, pair, r_ok = _block(counts, order, E, N, BM, EP)
    if ex >= E:
        return
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    c_ok = cols < D
    wrow = ex.to(tl.int64) * D + cols  # (BN,)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, I, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < I
        a = tl.load(act + pair[:, None] * I + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _product(acc, a, tl.load(down + wrow[None, :] * d_s + kk[:, None], mask=c_ok[None, :] & k_ok[:, None],
                                       other=0.0), IEEE)
    w = tl.load(wts + pair, mask=r_ok, other=0.0)
    tl.store(y + pair[:, None] * D + cols[None, :], acc * w[:, None], mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _combine(out, y, D, o_s, K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, cols] = 0 + y[t*K] + y[t*K + 1] + ... (ascending experts), rounded to out's type."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    total = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        total += tl.load(y + (t * K + j) * D + cols, mask=ok, other=0.0)
    tl.store(out + t * o_s + cols, total.to(out.dtype.element_ty), mask=ok)


def _scratch(out_t: "Tensor", device: torch.device, n: int, k: int, e: int, inter: int, d: int,
             act_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(ids (N*k,) int32, wts (N*k,) F32, counts (E,) int32, order (E*N,) int32, act (N*k, I),
    y (N*k, D) F32) on the device; kept with the output for decoding-sized calls, so a captured
    graph and every later step use the same buffers."""
    def make() -> tuple[torch.Tensor, ...]:
        new = lambda *shape, dt=torch.float32: torch.empty(shape, dtype=dt, device=device)  # noqa: E731
        return (new(n * k, dt=torch.int32), new(n * k), new(e, dt=torch.int32), new(e * n, dt=torch.int32),
                new(n * k, inter, dt=act_dtype), new(n * k, d))

    if n > KEPT_TOKENS:
        return make()
    kept = out_t.derived("nvidia.moe.scratch", lambda t: {})
    key = (n, k, e, inter, d, act_dtype)
    if key not in kept:
        kept[key] = make()
    return kept[key]


def _weight(w_t: "Tensor", dtype: DataType) -> torch.Tensor:
    """A stacked expert matrix as a device tensor of the activations' type with unit last stride."""
    w = tv(w_t) if w_t.dtype is dtype else dequantized(w_t, dtype)
    return w if w.stride(1) == 1 else w.contiguous()


def route(ids: torch.Tensor, wts: torch.Tensor, logits: torch.Tensor, top_k: int, norm: bool) -> None:
    """ids (N*k,) int32 and wts (N*k,) F32 = each token's top_k experts (ascending) and
    weights from router logits (N, E) with a unit last stride (launch 1 of the module doc)."""
    n, e = logits.shape
    launch(_route, (n,), (ids, wts, logits, e, logits.stride(0)),
           {"K": top_k, "EP": next_pow2(e), "NORM": norm}, exact=True)


def _tiles(dtype: DataType, n: int, k: int, e: int) -> tuple[int, int, int]:
    """(BM, BN, BK): pair blocks sized by the pairs an expert gets on average, at least 16 (tl.dot)."""
    per_expert = n * k / e
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    if interpreted():
        return bm, INTERPRETED_BLOCK, INTERPRETED_BLOCK
    return bm, BLOCK_N, BLOCK_K


def moe_mlp(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """out (N, D) = the routed SwiGLU experts of h (N, D) for inputs (h, router_logits (N, E),
    gate (E*I, D), up (E*I, D), down (E*D, I)); attrs top_k, norm_topk_prob."""
    out_t, (h_t, logits_t, gate_t, up_t, down_t) = outputs[0], inputs
    dtype = out_t.dtype
    n, d = out_t.shape
    e = logits_t.shape[1]
    inter = gate_t.shape[0] // e
    k = attrs["top_k"]
    h, logits = rows(tv(h_t), d), rows(tv(logits_t), e)
    gate, up, down = (_weight(w, dtype) for w in (gate_t, up_t, down_t))
    f32 = dtype is DataType.F32
    ids, wts, counts, order, act, y = _scratch(out_t, h.device, n, k, e, inter, d, TORCH_DTYPES[dtype])
    route(ids, wts, logits, k, attrs["norm_topk_prob"])
    launch(_group, (e,), (order, counts, ids, n * k, n), {"BLOCK": min(GROUP_BLOCK, next_pow2(n * k))}, exact=True)
    bm, bn, bk = _tiles(dtype, n, k, e)
    blocks = n * k // bm + min(e, n * k)
    shape = {"K": k, "EP": next_pow2(e), "BM": bm, "BN": min(bn, max(16, next_pow2(max(inter, d)))),
             "IEEE": f32 or (dtype is DataType.BF16 and interpreted())}
    launch(_gate_up, (blocks, triton.cdiv(inter, shape["BN"])),
           (act, h, gate, up, order, counts, e, n, d, inter, h.stride(0), gate.stride(0), up.stride(0)),
           {**shape, "BK": min(bk, max(16, next_pow2(d)))}, exact=f32)
    launch(_down, (blocks, triton.cdiv(d, shape["BN"])), (y, act, down, wts, order, counts, e, n, d, inter,
                                                         down.stride(0)),
           {**shape, "BK": min(bk, max(16, next_pow2(inter)))}, exact=f32)
    block = min(COMBINE_BLOCK, next_pow2(d))
    run_rows(tv(out_t), d, lambda out2: launch(_combine, (n, triton.cdiv(d, block)), (out2, y, d, out2.stride(0)),
                                               {"K": k, "BLOCK": block}, exact=f32))


register_kernel("moe_mlp", "nvidia", dtypes=FLOATS, kernel=moe_mlp)
register_kernel("moe_mlp", "nvidia", dtypes=FLOATS, weight_dtypes=QUANTIZED_TYPES, kernel=moe_mlp)
register_kernel("moe_mlp", "nvidia", dtypes=(DataType.F32,), weight_dtypes=(DataType.F16, DataType.BF16),
                kernel=moe_mlp)
