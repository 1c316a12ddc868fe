"""Causal grouped-query attention on NVIDIA GPUs, in Triton: ``self_attention`` over one
sequence's keys and, for the serving engine, ``kv_cache_write`` and ``paged_attention`` over
a pool of KV blocks addressed through block tables; both with an optional sliding window (a
query sees its last ``window`` keys, its own included; the walk starts at the first of them).
``self_attention_full`` is the one sequence's attention without a mask (``CAUSAL`` off: every
query sees every key), a vision encoder's. ``paged_attention_ends`` (and ``_window_ends``)
reads each row's key end from key_ends (``ENDS``) instead of taking its position + 1 (the
tokens of an image that see each other both ways); a window still starts from its position.
``paged_attention_q8`` (and its ``_window`` / ``_ends`` forms) reads an 8-bit pool (``Q8``):
int8 codes widened in registers to the queries' type (exact), each key's dot products times its
scale, each value row times its own; ``kv_cache_write_q8`` quantizes each head of each token
(absmax / 127, IEEE division, rounded half to even: the CPU's codes and scales, bit for bit).

One kernel serves both attentions (``PAGED`` picks how key p is found). A program takes
BLOCK_Q queries of one sequence and all G query heads of one KV head, as ROWS = BLOCK_Q * G
rows (padded to a power of two, at least 16 for ``tl.dot``), and walks the keys in chunks of
BLOCK_N from position 0 with an online softmax in F32 (F32 products in IEEE F32, never TF32;
F16/BF16 products on the tensor cores, accumulated in F32; under Triton's interpreter, whose
``tl.dot`` mishandles BF16, BF16 products are taken in F32 instead).
A sequence's facts (its rows of q, its key count) are read on the device, so a step needs no
host sync and can be captured in a CUDA graph; the grid covers the most rows a sequence can
have and programs beyond a sequence's own rows do nothing; a decoding step (as many tokens
as sequences) runs a program per token instead, which finds its sequence in query_starts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

from ...runtime.dtypes import DataType
from ..cpu.paged import check_key_ends, check_sequences, check_slots
from ..registry import register_kernel
from ._common import FLOATS, checks_enabled, interpreted, launch, next_pow2, tv

if TYPE_CHECKING:
    from ...tensor import Tensor

BLOCK_N = 32
INTERPRETED_BLOCK_N = 128  # the interpreter runs a program as NumPy: fewer, larger steps
PREFILL_ROWS = 64


@triton.jit
def _attention(out, q, kc, vc, bt, qs, cl, ke, ks, vs, n_rows, n_seqs, t_plain, bs, scale, window,
               q_n, q_h, q_d, o_n, o_h, o_d, k_b, k_s, k_h, k_d, v_b, v_s, v_h, v_d, bt_b, ke_n,
               ks_b, ks_s, ks_h, vs_b, vs_s, vs_h,
               G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
               BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
               FIND_SEQ: tl.constexpr, B_PAD: tl.constexpr, IEEE: tl.constexpr, CAUSAL: tl.constexpr,
               ENDS: tl.constexpr, Q8: tl.constexpr):
    """Grid (B, query blocks, KH), or with FIND_SEQ (BLOCK_Q = 1) (N, 1, KH): a program per
    token, which finds its sequence in qs. Sequence b owns rows qs[b]:qs[b+1] of q and cl[b]
    keys (PAGED), or rows 0:n_rows and t_plain keys (not PAGED); its query j sits at key count
    - q_len + j and sees keys 0..that position, or with ``window`` > 0 the last ``window`` of them;
    with ENDS (PAGED, CAUSAL) row n's keys end before ke[n] instead (a window counting back from
    its position still); without CAUSAL (window 0) every query sees every key. With Q8 (PAGED)
    kc and vc hold int8 codes and ks, vs (NB, BS, KH) each slot's scales: key p is kc[p] * ks[p]."""
    kh = tl.program_id(2).to(tl.int64)
    if FIND_SEQ:  # the sequence of token `tok`: how many sequences end at or before it
        tok = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, B_PAD)
        ends = tl.load(qs + 1 + j, mask=j < n_seqs, other=4611686018427387904)  # (B_PAD,) qs[1:], 2^62 past B
        b = tl.sum((ends <= tok).to(tl.int64), 0)
        qblk = tok - tl.load(qs + b)
    else:
        b = tl.program_id(0).to(tl.int64)
        qblk = tl.program_id(1)
    if PAGED:
        q0 = tl.load(qs + b)
        q_len = tl.load(qs + b + 1) - q0
        ctx = tl.load(cl + b)
    else:
        q0 = tl.zeros([], tl.int64)
        q_len = n_rows + tl.zeros([], tl.int64)
        ctx = t_plain + tl.zeros([], tl.int64)
    r = tl.arange(0, ROWS)
    qi = qblk * BLOCK_Q + r // G  # (ROWS,) query index within the sequence
    head = kh * G + r % G
    row_ok = (r < BLOCK_Q * G) & (qi < q_len)
    n = q0 + qi  # its row of q and out
    pos = ctx - q_len + qi  # its position: it sees keys 0..pos
    d = tl.arange(0, DP)
    dv = tl.arange(0, DVP)
    qv = tl.load(q + n[:, None] * q_n + head[:, None] * q_h + d[None, :] * q_d,
                 mask=row_ok[:, None] & (d[None, :] < D), other=0.0)  # (ROWS, DP)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DVP], tl.float32)
    if ENDS:
        row_end = tl.load(ke + n * ke_n, mask=row_ok, other=0)  # (ROWS,) each row sees keys before this
        row_end = tl.minimum(row_end, ctx)  # unchecked, a bad end reads nothing past the sequence
        end = tl.max(row_end, 0)
    elif CAUSAL:
        end = tl.minimum(ctx - q_len + (qblk + 1) * BLOCK_Q, ctx)  # keys seen by this block's last query
    else:
        end = ctx
    end = tl.where(qblk * BLOCK_Q < q_len, end, 0)
    first = ctx - q_len + qblk * BLOCK_Q - window + 1  # the first key this block's first query sees
    lo = tl.where(window > 0, tl.maximum(first, 0) // BLOCK_N * BLOCK_N, 0)
    for start in range(lo, end, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
        p_ok = p < end
        if PAGED:
            blk = tl.load(bt + b * bt_b + p // bs, mask=p_ok, other=0)
            k_at = blk * k_b + (p % bs) * k_s
            v_at = blk * v_b + (p % bs) * v_s
        else:
            k_at = p.to(tl.int64) * k_s
            v_at = p.to(tl.int64) * v_s
        kt = tl.load(kc + k_at[None, :] + kh * k_h + d[:, None] * k_d,
                     mask=p_ok[None, :] & (d[:, None] < D), other=0)  # (DP, BLOCK_N)
        if Q8:
            kt = kt.to(tl.float32 if IEEE else qv.dtype)  # int8 codes: exact in any float type
        if IEEE:
            s = tl.dot(qv.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(qv, kt)
        if Q8:
            k_sc = tl.load(ks + blk * ks_b + (p % bs) * ks_s + kh * ks_h, mask=p_ok, other=0.0)  # (BLOCK_N,)
            s = s * k_sc[None, :]
        s = s * scale  # (ROWS, BLOCK_N)
        if CAUSAL:
            if ENDS:
                seen = (p[None, :] < row_end[:, None]) & p_ok[None, :]
            else:
                seen = (p[None, :] <= pos[:, None]) & p_ok[None, :]
            seen = seen & ((window == 0) | (p[None, :] > pos[:, None] - window))
        else:
            seen = p_ok[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        alpha = tl.exp(m_i - m_use)
        pr = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        vt = tl.load(vc + v_at[:, None] + kh * v_h + dv[None, :] * v_d,
                     mask=p_ok[:, None] & (dv[None, :] < DV), other=0)  # (BLOCK_N, DVP)
        if Q8:  # the values dequantized in registers, in the queries' type (F16 keeps its range)
            v_sc = tl.load(vs + blk * vs_b + (p % bs) * vs_s + kh * vs_h, mask=p_ok, other=0.0)  # (BLOCK_N,)
            vt = (vt.to(tl.float32) * v_sc[:, None]).to(tl.float32 if IEEE else qv.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pr, vt.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt)
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out + n[:, None] * o_n + head[:, None] * o_h + dv[None, :] * o_d, o.to(out.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < DV))


def _shape_consts(h: int, kh: int, d: int, dv: int, block_q: int, dtype: DataType) -> dict[str, Any]:
    g = h // kh
    return {"G": g, "D": d, "DV": dv, "DP": max(16, next_pow2(d)), "DVP": max(16, next_pow2(dv)),
            "BLOCK_Q": block_q, "ROWS": max(16, next_pow2(block_q * g)),
            "BLOCK_N": INTERPRETED_BLOCK_N if interpreted() else BLOCK_N,
            "IEEE": dtype is DataType.F32 or (dtype is DataType.BF16 and interpreted())}


def _block_q(decode: bool, g: int, dtype: DataType) -> int:
    # A decoding step has one query per sequence; a prefill packs queries to fill the rows
    # (half as many in F32, whose tiles take twice the shared memory).
    rows = PREFILL_ROWS // 2 if dtype is DataType.F32 else PREFILL_ROWS
    return 1 if decode else max(1, rows // g)


@register_kernel("self_attention_window", "nvidia", dtypes=FLOATS)
@register_kernel("self_attention", "nvidia", dtypes=FLOATS)
def self_attention(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """Causal grouped-query attention: q (S, H, D), k (T, KH, D), v (T, KH, Dv) into (S, H, Dv);
    attrs: scale, window (0 or absent: every key up to a query's own; else the last that many)."""
    _one_sequence(outputs[0], inputs, float(attrs["scale"]), int(attrs.get("window", 0)), True)


@register_kernel("self_attention_full", "nvidia", dtypes=FLOATS)
def self_attention_full(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...],
                        attrs: dict[str, Any]) -> None:
    """Non-causal grouped-query attention, every query seeing every key: q (S, H, D),
    k (T, KH, D), v (T, KH, Dv) into (S, H, Dv), S and T unrelated; attrs: scale."""
    _one_sequence(outputs[0], inputs, float(attrs["scale"]), 0, False)


def _one_sequence(out_t: "Tensor", inputs: tuple["Tensor | None", ...], scale: float, window: int,
                  causal: bool) -> None:
    """``_attention`` over one sequence's q, k, v (not paged) into out_t."""
    out, q, k, v = tv(out_t), *(tv(t) for t in inputs)
    s, h, d = q.shape
    t, kh, dv = v.shape
    block_q = _block_q(s == 1, h // kh, inputs[0].dtype)
    args = (out, q, k, v, q, q, q, q, q, q, s, 1, t, 1, scale, window,
            *q.stride(), *out.stride(),
            0, k.stride(0), k.stride(1), k.stride(2), 0, v.stride(0), v.stride(1), v.stride(2), 0, 0,
            0, 0, 0, 0, 0, 0)
    launch(_attention, (1, triton.cdiv(s, block_q), kh), args,
           {**_shape_consts(h, kh, d, dv, block_q, inputs[0].dtype), "PAGED": False, "FIND_SEQ": False,
            "B_PAD": 1, "CAUSAL": causal, "ENDS": False, "Q8": False},
           exact=inputs[0].dtype is DataType.F32)


@register_kernel("paged_attention_window_ends", "nvidia", dtypes=FLOATS)
@register_kernel("paged_attention_ends", "nvidia", dtypes=FLOATS)
@register_kernel("paged_attention_window", "nvidia", dtypes=FLOATS)
@register_kernel("paged_attention", "nvidia", dtypes=FLOATS)
def paged_attention(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """Causal grouped-query attention of q (N, H, D) over the paged cache into out (N, H, Dv):
    inputs (q, k_cache (NB, BS, KH, D), v_cache (NB, BS, KH, Dv), block_tables (B, MB),
    query_starts (B+1,), context_lens (B,)), and for the ``_ends`` kernels key_ends (N,) (row
    i sees keys before key_ends[i]); attrs: scale, window (as ``self_attention``'s). With
    checks on, ValueError for inconsistent index tensors, as the CPU kernel raises."""
    _paged(outputs, inputs, attrs, None)


@register_kernel("paged_attention_q8_window_ends", "nvidia", dtypes=FLOATS)
@register_kernel("paged_attention_q8_ends", "nvidia", dtypes=FLOATS)
@register_kernel("paged_attention_q8_window", "nvidia", dtypes=FLOATS)
@register_kernel("paged_attention_q8", "nvidia", dtypes=FLOATS)
def paged_attention_q8(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...],
                       attrs: dict[str, Any]) -> None:
    """``paged_attention`` over an 8-bit pool: its inputs with k_cache, v_cache I8, then
    k_scale and v_scale (NB, BS, KH) F32 last; q and out of a float type."""
    _paged(outputs, inputs[:-2], attrs, inputs[-2:])


def _paged(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any],
           scales: "tuple[Tensor, Tensor] | None") -> None:
    """``_attention`` over the paged pool of ``inputs`` (an 8-bit one where ``scales`` are given)."""
    if checks_enabled(outputs[0]):
        host = tuple(_HostIndex(t) for t in inputs)
        qs_host, cl_host = inputs[4].numpy(), inputs[5].numpy()
        check_sequences(host, qs_host, cl_host, inputs[3].numpy())
        if len(inputs) > 6:
            check_key_ends(inputs[6].numpy(), qs_host, cl_host)
    out, q, kc, vc, bt, qs, cl = tv(outputs[0]), *(tv(t) for t in inputs[:6])
    ke = tv(inputs[6]) if len(inputs) > 6 else qs  # (a placeholder pointer without ENDS)
    n, h, d = q.shape
    nb, bs, kh, _ = kc.shape
    dv = vc.shape[3]
    b = bt.shape[0]
    decode = n == b  # (as many tokens as sequences: a program per token, finding its sequence)
    block_q = _block_q(decode, h // kh, inputs[0].dtype)
    grid = (n, 1, kh) if decode else (b, triton.cdiv(n, block_q), kh)
    ks, vs = (tv(scales[0]), tv(scales[1])) if scales is not None else (kc, vc)  # (NB, BS, KH) or placeholders
    scale_strides = (*ks.stride(), *vs.stride()) if scales is not None else (0,) * 6
    args = (out, q, kc, vc, bt, qs, cl, ke, ks, vs, n, b, 0, bs, float(attrs["scale"]), int(attrs.get("window", 0)),
            *q.stride(), *out.stride(),
            *kc.stride(), *vc.stride(), bt.stride(0), ke.stride(0) if len(inputs) > 6 else 0, *scale_strides)
    launch(_attention, grid, args,
           {**_shape_consts(h, kh, d, dv, block_q, inputs[0].dtype), "PAGED": True, "FIND_SEQ": decode,
            "B_PAD": next_pow2(b) if decode else 1, "CAUSAL": True, "ENDS": len(inputs) > 6,
            "Q8": scales is not None},
           exact=inputs[0].dtype is DataType.F32)


class _HostIndex:
    """What ``check_sequences`` reads of an input: its shape, and host values on demand."""

    def __init__(self, t: "Tensor"):
        self.shape, self._t = t.shape, t

    def host_array(self):
        return self._t.numpy()


@triton.jit
def _quantized(x, m):
    """Rows x (KHP, DP) (lanes outside m ignored) as int8 codes (KHP, DP) and scales (KHP, 1):
    scale = amax / 127, code = x / scale rounded half to even (adding and taking away 1.5 * 2^23
    rounds a float32 of magnitude below 2^22 to an integer, ties to even), 0 for a zero row."""
    xf = x.to(tl.float32)
    amax = tl.max(tl.where(m, tl.abs(xf), 0.0), 1)[:, None]  # (KHP, 1)
    sc = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    y = tl.math.div_rn(xf, tl.where(sc == 0.0, 1.0, sc))
    r = (y + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8), sc


@triton.jit
def _kv_write(kc, vc, k, v, slots, ks, vs, cap, bs, KH, D, DV, k_n, k_h, k_d, v_n, v_h, v_d,
              kc_b, kc_s, kc_h, kc_d, vc_b, vc_s, vc_h, vc_d, ks_b, ks_s, ks_h, vs_b, vs_s, vs_h,
              KHP: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, Q8: tl.constexpr):
    """Token i: k[i] and v[i] (KH, D) into slot slots[i] of the pools (a slot outside [0, cap) is
    skipped); with Q8 each head quantized into int8 codes, its scale into ks / vs (NB, BS, KH)."""
    i = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, KHP)[:, None]
    slot = tl.load(slots + i) + tl.zeros([KHP, 1], tl.int64)  # as a tensor: masks are built of tensors
    ok = (slot >= 0) & (slot < cap)
    blk = slot // bs
    off = slot % bs
    d = tl.arange(0, DP)[None, :]
    m = ok & (hh < KH) & (d < D)
    x = tl.load(k + i * k_n + hh * k_h + d * k_d, mask=m)
    if Q8:
        x, k_sc = _quantized(x, m)
        tl.store(ks + blk * ks_b + off * ks_s + hh * ks_h, k_sc, mask=ok & (hh < KH))
    tl.store(kc + blk * kc_b + off * kc_s + hh * kc_h + d * kc_d, x, mask=m)
    dv = tl.arange(0, DVP)[None, :]
    mv = ok & (hh < KH) & (dv < DV)
    y = tl.load(v + i * v_n + hh * v_h + dv * v_d, mask=mv)
    if Q8:
        y, v_sc = _quantized(y, mv)
        tl.store(vs + blk * vs_b + off * vs_s + hh * vs_h, v_sc, mask=ok & (hh < KH))
    tl.store(vc + blk * vc_b + off * vc_s + hh * vc_h + dv * vc_d, y, mask=mv)


@register_kernel("kv_cache_write", "nvidia", dtypes=FLOATS)
def kv_cache_write(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """k_cache[s // BS, s % BS] = k[i] and v_cache likewise for each slot s = slots[i]:
    outputs (k_cache (NB, BS, KH, D), v_cache (NB, BS, KH, Dv)), inputs (k (N, KH, D),
    v (N, KH, Dv), slots (N,) I64). With checks on, ValueError for a slot outside [0, NB * BS)."""
    nb, bs = outputs[0].shape[:2]
    if checks_enabled(outputs[0]):
        check_slots(inputs[2].numpy(), nb, bs)
    kc, vc, k, v, slots = tv(outputs[0]), tv(outputs[1]), tv(inputs[0]), tv(inputs[1]), tv(inputs[2])
    q8 = len(outputs) == 4
    ks, vs = (tv(outputs[2]), tv(outputs[3])) if q8 else (kc, vc)  # (NB, BS, KH) or placeholders
    n, kh, d = k.shape
    dv = v.shape[2]
    scale_strides = (*ks.stride(), *vs.stride()) if q8 else (0,) * 6
    args = (kc, vc, k, v, slots, ks, vs, nb * bs, bs, kh, d, dv, *k.stride(), *v.stride(), *kc.stride(),
            *vc.stride(), *scale_strides)
    launch(_kv_write, (n,), args, {"KHP": next_pow2(kh), "DP": next_pow2(d), "DVP": next_pow2(dv), "Q8": q8})


@register_kernel("kv_cache_write_q8", "nvidia", dtypes=FLOATS)
def kv_cache_write_q8(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...],
                      attrs: dict[str, Any]) -> None:
    """``kv_cache_write`` into an 8-bit pool: outputs (k_cache, v_cache I8 (NB, BS, KH, D / Dv),
    k_scale, v_scale F32 (NB, BS, KH)), inputs (k, v of a float type, slots); each head of each
    token quantized on its own (``ops.kv_cache_write``)."""
    kv_cache_write(outputs, inputs, attrs)
