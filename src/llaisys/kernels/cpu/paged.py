"""The paged KV cache on the CPU in NumPy: the readable reference of the native kernels
(``paged_native``), and the kernels of F16/BF16 attention.

The pool of one layer holds NB blocks of BS token slots: k_cache (NB, BS, KH, D), v_cache
(NB, BS, KH, Dv). A flat batch of N query tokens comes from B sequences, each sequence's
tokens contiguous: sequence b owns rows query_starts[b]:query_starts[b + 1], has
context_lens[b] keys, and its key at position p lies in block block_tables[b, p // BS], slot
p % BS. Query j of sequence b sits at position context_lens[b] - q_len + j; with key_ends
(the ``_ends`` kernels) row i sees keys up to key_ends[i] - 1 rather than up to its position.
The index checks (and their messages, shared with the native kernels) are here.

An 8-bit pool (the ``_q8`` kernels) holds int8 codes in k_cache and v_cache and a float32
scale per slot and head in k_scale, v_scale (NB, BS, KH): ``quantize`` is how a row is stored
(symmetric, absmax / 127, rounded half to even), ``dequantize`` what attention reads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...runtime.dtypes import DataType
from ..registry import register_kernel
from ._common import f32
from .attention import windowed_attention

if TYPE_CHECKING:
    from ...tensor import Tensor

# The kernel names of attention over an 8-bit pool (as ``ops.paged_attention`` composes them).
Q8_ATTENTION = ("paged_attention_q8", "paged_attention_q8_window", "paged_attention_q8_ends",
                "paged_attention_q8_window_ends")

# What went wrong in the index tensors, as the native kernels report it (paged_attention.c).
START0, ORDER, END, SHORT, LONG, BLOCK, SLOT, PAST_N, KEY_END = -1, -2, -3, -4, -5, -6, -8, -10, -11


def slot_error(i: int, slot: int, nb: int, bs: int) -> ValueError:
    """The error for slots[i] = slot outside a pool of nb blocks of bs slots."""
    return ValueError(f"kv_cache_write: slots[{i}] = {slot} is outside [0, {nb * bs}): the cache holds "
                      f"NB * BS = {nb} * {bs} token slots")


def sequence_error(code: int, where: int, value: int, inputs: tuple) -> ValueError:
    """The error for index-check ``code`` about sequence (or table entry, or row of key_ends)
    ``where`` holding ``value``; ``inputs`` are paged_attention's (for the shapes and q_len)."""
    q, k_cache, block_tables, query_starts = inputs[0], inputs[1], inputs[3], inputs[4]
    n, (nb, bs), (b_count, mb) = q.shape[0], k_cache.shape[:2], block_tables.shape
    op = "paged_attention"
    if code == START0:
        return ValueError(f"{op}: query_starts[0] is {value}; expected 0")
    if code == ORDER:
        return ValueError(f"{op}: query_starts must be nondecreasing, but query_starts[{where + 1}] = {value} is "
                          f"less than query_starts[{where}]")
    if code in (END, PAST_N):
        return ValueError(f"{op}: query_starts[{where}] is {value}; query_starts must end at N = {n} (the rows of q) "
                          f"and never exceed it")
    if code == SHORT:
        qs = query_starts.host_array()
        return ValueError(f"{op}: context_lens[{where}] = {value} is less than the {int(qs[where + 1] - qs[where])} "
                          f"queries of sequence {where}; it counts the keys after this step, its new tokens included")
    if code == LONG:
        return ValueError(f"{op}: context_lens[{where}] = {value} exceeds the MB * BS = {mb} * {bs} = {mb * bs} keys "
                          f"a row of block_tables can address")
    if code == BLOCK:
        b, i = divmod(where, mb)
        return ValueError(f"{op}: block_tables[{b}, {i}] = {value} is outside [0, {nb}) (the blocks of k_cache), "
                          f"yet sequence {b} of {b_count} reads keys from it")
    if code == KEY_END:
        return key_end_error(where, value, query_starts.host_array(), inputs[5].host_array())
    return ValueError(f"{op}: index check failed with status {code}")


def key_end_error(i: int, value: int, qs: np.ndarray, cl: np.ndarray) -> ValueError:
    """The error for key_ends[i] = value outside [p + 1, context_lens[b]], row i being the query
    at position p of sequence b (query_starts qs (B+1,), context_lens cl (B,))."""
    b = int(np.searchsorted(qs, i, side="right")) - 1
    lo = int(cl[b] - (qs[b + 1] - qs[b]) + (i - qs[b])) + 1
    return ValueError(f"paged_attention: key_ends[{i}] = {value} is outside [{lo}, {int(cl[b])}]: row {i} is the query "
                      f"at position {lo - 1} of sequence {b}, which sees at least the keys up to its own and at most "
                      f"the context_lens[{b}] = {int(cl[b])} keys of its sequence")


def check_slots(slots: np.ndarray, nb: int, bs: int) -> None:
    """ValueError unless every slot (N,) lies in [0, nb * bs)."""
    bad = (slots < 0) | (slots >= nb * bs)
    if bad.any():
        i = int(np.argmax(bad))
        raise slot_error(i, int(slots[i]), nb, bs)


def check_sequences(inputs: tuple, qs: np.ndarray, cl: np.ndarray, bt: np.ndarray) -> None:
    """ValueError unless query_starts qs (B+1,) runs from 0 to N without going down, each
    context_lens[b] lies in [q_len, MB * BS], and the blocks a sequence reads are in [0, NB)."""
    n, (nb, bs), mb = inputs[0].shape[0], inputs[1].shape[:2], bt.shape[1]
    if qs[0] != 0:
        raise sequence_error(START0, 0, int(qs[0]), inputs)
    q_len = np.diff(qs)  # (B,)
    for code, bad in ((ORDER, q_len < 0), (SHORT, cl < q_len), (LONG, cl > mb * bs)):
        if bad.any():
            b = int(np.argmax(bad))
            raise sequence_error(code, b, int(qs[b + 1] if code == ORDER else cl[b]), inputs)
    if qs[-1] != n:
        raise sequence_error(END, len(qs) - 1, int(qs[-1]), inputs)
    needed = (np.arange(mb)[None, :] < -(-cl // bs)[:, None]) & (q_len > 0)[:, None]  # (B, MB)
    bad = needed & ((bt < 0) | (bt >= nb))
    if bad.any():
        where = int(np.argmax(bad))
        raise sequence_error(BLOCK, where, int(bt.reshape(-1)[where]), inputs)


def check_key_ends(key_ends: np.ndarray, qs: np.ndarray, cl: np.ndarray) -> None:
    """ValueError unless each key_ends[i] (N,) lies in [p_i + 1, context_lens[b]], row i being
    the query at position p_i of sequence b; query_starts qs (B+1,) and context_lens cl (B,)
    already checked."""
    q_len = np.diff(qs)  # (B,)
    seq = np.repeat(np.arange(len(cl)), q_len)  # (N,) each row's sequence
    own = cl[seq] - q_len[seq] + (np.arange(len(seq)) - qs[seq]) + 1  # (N,) natural ends
    bad = (key_ends < own) | (key_ends > cl[seq])
    if bad.any():
        i = int(np.argmax(bad))
        raise key_end_error(i, int(key_ends[i]), qs, cl)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows x (..., D) as int8 codes (..., D) and float32 scales (...): scale = amax / 127 of
    the row, code = x / scale rounded half to even, within [-127, 127]; a row of zeros gets
    scale 0 and codes 0. The arithmetic is float32 (the native kernel's, bit for bit)."""
    x = f32(x)
    scale = np.abs(x).max(axis=-1) / np.float32(127)  # (...)
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]  # a zero row divides 0 by 1
    codes = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)  # (..., D)
    return codes, scale.astype(np.float32, copy=False)


def dequantize(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What an 8-bit slot holds: codes (..., D) int8 times their row's scale (...), float32."""
    return codes.astype(np.float32) * scale[..., None]


def kv_cache_write_q8(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """``kv_cache_write`` into an 8-bit pool: each head of each token quantized on its own
    (``quantize``) into its slot: outputs (k_cache (NB, BS, KH, D) I8, v_cache (NB, BS, KH, Dv)
    I8, k_scale (NB, BS, KH) F32, v_scale (NB, BS, KH) F32), inputs (k (N, KH, D), v (N, KH, Dv)
    of a float type, slots (N,) I64), then, under the CPU fallback, the four stores' current
    contents. ValueError for a slot outside [0, NB * BS)."""
    stores = [t.host_array() for t in outputs]  # k_cache, v_cache, k_scale, v_scale
    k, v, slots = (t.host_array() for t in inputs[:3])
    nb, bs = stores[0].shape[:2]
    check_slots(slots, nb, bs)
    if len(inputs) > 3:
        for store, now in zip(stores, inputs[3:7]):
            store[...] = now.host_array()
    block, offset = np.divmod(slots, bs)  # (N,), (N,)
    stores[0][block, offset], stores[2][block, offset] = quantize(k)
    stores[1][block, offset], stores[3][block, offset] = quantize(v)


def kv_cache_write(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """k_cache[s // BS, s % BS] = k[i] and v_cache likewise for each slot s = slots[i]:
    outputs (k_cache (NB, BS, KH, D), v_cache (NB, BS, KH, Dv)), inputs (k (N, KH, D),
    v (N, KH, Dv), slots (N,) I64), then, under the CPU fallback, the caches' current
    contents (copied into the outputs first). ValueError for a slot outside [0, NB * BS)."""
    k_cache, v_cache = outputs[0].host_array(), outputs[1].host_array()
    k, v, slots = (t.host_array() for t in inputs[:3])
    nb, bs = k_cache.shape[:2]
    check_slots(slots, nb, bs)
    if len(inputs) > 3:
        k_cache[...], v_cache[...] = inputs[3].host_array(), inputs[4].host_array()
    block, offset = np.divmod(slots, bs)  # (N,), (N,)
    k_cache[block, offset] = k
    v_cache[block, offset] = v


def paged_attention(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """Causal grouped-query attention of q (N, H, D) over the paged cache into out (N, H, Dv),
    one sequence at a time: inputs (q, k_cache, v_cache, block_tables (B, MB), query_starts
    (B+1,), context_lens (B,)), and for the ``_ends`` kernels key_ends (N,) (row i sees keys
    before key_ends[i]); attrs: scale, and for ``paged_attention_window(_ends)`` window (each
    query sees at most the last that many keys up to its own position: the blocks before the
    first any of its queries sees are not gathered). ValueError for inconsistent index tensors."""
    _attention(outputs, inputs, attrs, None)


def paged_attention_q8(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                       attrs: dict[str, Any]) -> None:
    """``paged_attention`` (and its ``_window``, ``_ends`` forms) over an 8-bit pool: inputs as
    there with k_cache, v_cache I8, then k_scale and v_scale (NB, BS, KH) F32 last; each key
    and value the sequence sees is ``dequantize``d, then attended to as float32."""
    _attention(outputs, inputs[:-2], attrs, (inputs[-2].host_array(), inputs[-1].host_array()))


def _attention(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any],
               scales: "tuple[np.ndarray, np.ndarray] | None") -> None:
    """``paged_attention``, over int8 caches where ``scales`` (k_scale, v_scale (NB, BS, KH)) are given."""
    out = outputs[0].host_array()  # (N, H, Dv)
    q = inputs[0].host_array()  # (N, H, D)
    k_cache, v_cache = inputs[1].host_array(), inputs[2].host_array()  # (NB, BS, KH, D), (NB, BS, KH, Dv)
    bt, qs, cl = (t.host_array() for t in inputs[3:6])  # (B, MB), (B+1,), (B,)
    check_sequences(inputs, qs, cl, bt)
    key_ends = inputs[6].host_array() if len(inputs) > 6 else None  # (N,)
    if key_ends is not None:
        check_key_ends(key_ends, qs, cl)
    _, bs, kh, d = k_cache.shape
    window = int(attrs.get("window", 0))
    for b in range(len(cl)):
        q0, q1, t = int(qs[b]), int(qs[b + 1]), int(cl[b])
        if q1 == q0:
            continue
        lo = max(0, t - (q1 - q0) - window + 1) // bs if window else 0  # the first block a query sees
        blocks = bt[b, lo: -(-t // bs)]
        k, v = k_cache[blocks], v_cache[blocks]  # (blocks, BS, KH, D), (blocks, BS, KH, Dv)
        if scales is not None:
            k, v = dequantize(k, scales[0][blocks]), dequantize(v, scales[1][blocks])
        k = f32(k.reshape(-1, kh, d)[:t - lo * bs])  # (T - lo*BS, KH, D)
        v = f32(v.reshape(-1, kh, v_cache.shape[3])[:t - lo * bs])
        # positions counted from the first gathered key: a window needs only their differences
        ends = None if key_ends is None else key_ends[q0:q1] - lo * bs  # (S,)
        out[q0:q1] = windowed_attention(f32(q[q0:q1]), k, v, attrs["scale"], window, ends)


for _name in ("paged_attention_window", "paged_attention_ends", "paged_attention_window_ends"):
    register_kernel(_name, "cpu", dtypes=(DataType.F16, DataType.BF16), kernel=paged_attention)
for _name in Q8_ATTENTION:
    register_kernel(_name, "cpu", dtypes=(DataType.F16, DataType.BF16), kernel=paged_attention_q8)
register_kernel("kv_cache_write_q8", "cpu", dtypes=(DataType.F16, DataType.BF16), kernel=kv_cache_write_q8)


# F32 attention and every kv_cache_write (F32 kv_cache_write_q8 and paged_attention_q8 too) go
# through paged_native, which runs these where the native library is missing or a layout does
# not suit it.
register_kernel("paged_attention", "cpu", dtypes=(DataType.F16, DataType.BF16), kernel=paged_attention)
