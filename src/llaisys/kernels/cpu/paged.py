"""The paged KV cache on the CPU in NumPy: the readable reference of the native kernels
(``paged_native``), and the kernels of F16/BF16 attention.

The pool of one layer holds NB blocks of BS token slots: k_cache (NB, BS, KH, D), v_cache
(NB, BS, KH, Dv). A flat batch of N query tokens comes from B sequences, each sequence's
tokens contiguous: sequence b owns rows query_starts[b]:query_starts[b + 1], has
context_lens[b] keys, and its key at position p lies in block block_tables[b, p // BS], slot
p % BS. Query j of sequence b sits at position context_lens[b] - q_len + j; with key_ends
(the ``_ends`` kernels) row i sees keys up to key_ends[i] - 1 rather than up to its position.
The index checks (and their messages, shared with the native kernels) are here.
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
        k = f32(k_cache[blocks].reshape(-1, kh, d)[:t - lo * bs])  # (T - lo*BS, KH, D)
        v = f32(v_cache[blocks].reshape(-1, kh, v_cache.shape[3])[:t - lo * bs])
        # positions counted from the first gathered key: a window needs only their differences
        ends = None if key_ends is None else key_ends[q0:q1] - lo * bs  # (S,)
        out[q0:q1] = windowed_attention(f32(q[q0:q1]), k, v, attrs["scale"], window, ends)


for _name in ("paged_attention_window", "paged_attention_ends", "paged_attention_window_ends"):
    register_kernel(_name, "cpu", dtypes=(DataType.F16, DataType.BF16), kernel=paged_attention)


# F32 attention and every kv_cache_write go through paged_native, which runs these where the
# native library is missing or a layout does not suit it.
register_kernel("paged_attention", "cpu", dtypes=(DataType.F16, DataType.BF16), kernel=paged_attention)
