"""The paged KV-cache ops of a serving engine (continuous batching), output first like the
others and taking ``plan=``.

One layer's cache is a pool of NB blocks of BS token slots: k_cache (NB, BS, KH, D), v_cache
(NB, BS, KH, Dv). A step runs a flat batch of N query tokens from B sequences, each
sequence's tokens contiguous and the sequences in order; sequence b owns rows
query_starts[b]:query_starts[b + 1] and reads its keys through row b of block_tables. The
values of the index tensors are checked by the kernels (they live on the device).

An 8-bit pool holds k_cache and v_cache as I8 codes with a float32 scale per slot and head,
k_scale and v_scale (NB, BS, KH): given both, ``kv_cache_write`` quantizes each head of each
token on its own (scale = amax / 127, codes rounded half to even) and ``paged_attention`` reads
code * scale; such calls dispatch as ``kv_cache_write_q8`` and ``paged_attention_q8`` (with the
same ``_window`` / ``_ends`` suffixes), so a device without them is never handed int8 caches.
"""
from __future__ import annotations

from ..kernels import find_kernel
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from .plan import Plan
from ._checks import FLOAT_TYPES, INDEX_TYPES, dtype_in, ndim_is, number, shape_is, tensors_match
from .core import _launch, window_size


I8_TYPES = frozenset((DataType.I8,))
SCALE_TYPES = frozenset((DataType.F32,))


def _scales(op: str, k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> bool:
    """Whether the call is over an 8-bit pool (k_scale and v_scale given), checking that both or
    neither are given, and that with them the caches are I8 and the scales F32 (NB, BS, KH)."""
    if k_scale is None and v_scale is None:
        if getattr(k_cache, "dtype", None) is DataType.I8 or getattr(v_cache, "dtype", None) is DataType.I8:
            raise ValueError(f"{op}: k_cache and v_cache of data type I8 are an 8-bit cache; give its k_scale and "
                             f"v_scale (NB, BS, KH) F32 too")
        return False
    if k_scale is None or v_scale is None:
        given, missing = ("k_scale", "v_scale") if v_scale is None else ("v_scale", "k_scale")
        raise ValueError(f"{op}: {given} given without {missing}; an 8-bit cache takes both k_scale and v_scale "
                         f"(NB, BS, KH), a float cache neither")
    tensors_match(op, ("k_cache", "v_cache", "k_scale", "v_scale"), (k_cache, v_cache, k_scale, v_scale), dtypes=0)
    for name, t, allowed in (("k_cache", k_cache, I8_TYPES), ("v_cache", v_cache, I8_TYPES),
                             ("k_scale", k_scale, SCALE_TYPES), ("v_scale", v_scale, SCALE_TYPES)):
        dtype_in(op, name + " (with k_scale and v_scale: an 8-bit cache)", t, allowed)
    ndim_is(op, "k_cache", k_cache, 4, "(NB, BS, KH, D) block pool")
    shape_is(op, "k_scale", k_scale, k_cache.shape[:3])
    shape_is(op, "v_scale", v_scale, k_cache.shape[:3])
    return True


def kv_cache_write(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor, *,
                   k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                   plan: Plan | None = None) -> tuple[Tensor, Tensor]:
    """Store this step's keys and values in the block pool, in place: for each token i,
    k_cache[s // BS, s % BS] = k[i] and v_cache[s // BS, s % BS] = v[i], s = slots[i].

    k_cache (NB, BS, KH, D), v_cache (NB, BS, KH, Dv) of one float type (F32, F16, BF16);
    k (N, KH, D), v (N, KH, Dv) of that type, any strides (slices of a fused qkv buffer);
    slots (N,) I64, flat slot indices block * BS + offset. With k_scale and v_scale (NB, BS, KH)
    F32 (both or neither), the caches are I8 and each head of each token is stored quantized
    (k of any float type): k_scale[b, o, h] = max |k[i, h]| / 127 (0 for a row of zeros) and
    k_cache[b, o, h] = k[i, h] / k_scale[b, o, h] rounded half to even, v likewise; a slot's
    codes and scale depend on its own row only (dispatched as ``kv_cache_write_q8``). The kernel
    raises ValueError for a slot outside [0, NB * BS), before writing anything. Returns
    (k_cache, v_cache).
    """
    op = "kv_cache_write"
    q8 = _scales(op, k_cache, v_cache, k_scale, v_scale)
    if q8:
        tensors_match(op, ("k", "v", "k_cache", "v_cache", "slots"), (k, v, k_cache, v_cache, slots), dtypes=2)
        dtype_in(op, "k", k, FLOAT_TYPES)
    else:
        tensors_match(op, ("k_cache", "v_cache", "k", "v", "slots"), (k_cache, v_cache, k, v, slots), dtypes=4)
        dtype_in(op, "k_cache", k_cache, FLOAT_TYPES)
    dtype_in(op, "slots", slots, INDEX_TYPES)
    ndim_is(op, "k_cache", k_cache, 4, "(NB, BS, KH, D) block pool")
    ndim_is(op, "v_cache", v_cache, 4, "(NB, BS, KH, Dv) block pool")
    ndim_is(op, "slots", slots, 1, "(N,) slot indices")
    nb, bs, kh, d = k_cache.shape
    if v_cache.shape[:3] != (nb, bs, kh):
        raise ValueError(f"{op}: v_cache has shape {v_cache.shape}; expected ({nb}, {bs}, {kh}, Dv) to match "
                         f"k_cache {k_cache.shape}")
    n = slots.shape[0]
    shape_is(op, "k", k, (n, kh, d))
    shape_is(op, "v", v, (n, kh, v_cache.shape[3]))
    if n:
        inputs = (k, v, slots)
        device = k_cache.device
        name, outputs = (op + "_q8", (k_cache, v_cache, k_scale, v_scale)) if q8 else (op, (k_cache, v_cache))
        if not device.is_cpu and find_kernel(name, device.type.name, k.dtype) is None:
            # The CPU fallback gives a kernel uninitialised host copies of dense outputs (ops
            # write them whole); the caches go in as inputs too, so unwritten slots survive.
            inputs += outputs
        _launch(plan, name, k.dtype, outputs, inputs, {})
    return k_cache, v_cache


def paged_attention(out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    query_starts: Tensor, context_lens: Tensor, scale: float, *, window: int = 0,
                    key_ends: Tensor | None = None, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                    plan: Plan | None = None) -> Tensor:
    """Causal grouped-query attention of a flat batch of queries over the paged KV cache.

    q (N, H, D) (any strides), out (N, H, Dv), k_cache (NB, BS, KH, D), v_cache
    (NB, BS, KH, Dv), all of one float type, H a multiple of KH (query head h uses KV head
    h // (H / KH)). block_tables (B, MB), query_starts (B+1,), context_lens (B,), all I64.
    Sequence b has q_len = query_starts[b+1] - query_starts[b] queries and context_lens[b]
    keys (this step's included: kv_cache_write them first); its query j sits at position
    context_lens[b] - q_len + j and sees keys 0..that position, key p being
    k_cache[block_tables[b, p // BS], p % BS] (table entries past what it needs are ignored).
    With ``window`` > 0 a query sees only its last ``window`` keys, its own included (a
    sliding window; such a call dispatches as ``paged_attention_window``, so a kernel that
    knows no window is never handed one); a sequence's blocks before the first key its queries
    see are never read. With ``key_ends`` (N,) I64, row i (a query at position p_i) sees keys
    up to key_ends[i] - 1 instead of up to p_i, p_i + 1 <= key_ends[i] <= context_lens[b]
    (the tokens of an image that attend to each other both ways, as Gemma 3's do); a window
    still counts back from p_i, so it sees keys max(0, p_i + 1 - window) .. key_ends[i] - 1.
    key_ends[i] = p_i + 1 everywhere is the plain call, with the same bits. Such a call
    dispatches as ``paged_attention_ends`` (``paged_attention_window_ends`` with a window), so
    only kernels that know key_ends see them. out = softmax(q k^T * scale + mask) v. The
    kernel raises ValueError unless query_starts runs from 0 to N without going down,
    q_len <= context_lens[b] <= MB * BS and each key_ends[i] is in its bounds (naming the row).
    With k_scale and v_scale (NB, BS, KH) F32 (both or neither) the caches are an 8-bit pool
    (``kv_cache_write``'s): I8 codes, key p being k_cache[blk, o] * k_scale[blk, o, :, None]
    and value p likewise, read as such (q and out keep their float type); the call dispatches as
    ``paged_attention_q8`` (``_q8_window``, ``_q8_ends``, ``_q8_window_ends``).
    The F32 CPU kernel is batch invariant: a row's result does not depend on the rest of the
    batch. Returns out.
    """
    op = "paged_attention"
    q8 = _scales(op, k_cache, v_cache, k_scale, v_scale)
    tensors_match(op, ("out", "q", "k_cache", "v_cache", "block_tables", "query_starts", "context_lens", "key_ends"),
                  (out, q, k_cache, v_cache, block_tables, query_starts, context_lens, key_ends), dtypes=2 if q8 else 4)
    dtype_in(op, "q", q, FLOAT_TYPES)
    for name, t in (("block_tables", block_tables), ("query_starts", query_starts), ("context_lens", context_lens)):
        dtype_in(op, name, t, INDEX_TYPES)
    if key_ends is not None:
        dtype_in(op, "key_ends", key_ends, INDEX_TYPES)
    ndim_is(op, "q", q, 3, "(N, H, D)")
    ndim_is(op, "k_cache", k_cache, 4, "(NB, BS, KH, D) block pool")
    ndim_is(op, "v_cache", v_cache, 4, "(NB, BS, KH, Dv) block pool")
    ndim_is(op, "block_tables", block_tables, 2, "(B, MB) block ids")
    n, h, d = q.shape
    nb, bs, kh, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"{op}: k_cache has head dim {dk} (shape {k_cache.shape}) but q has {d} (shape {q.shape})")
    if v_cache.shape[:3] != (nb, bs, kh):
        raise ValueError(f"{op}: v_cache has shape {v_cache.shape}; expected ({nb}, {bs}, {kh}, Dv) to match "
                         f"k_cache {k_cache.shape}")
    if kh == 0 or h % kh:
        raise ValueError(f"{op}: q has {h} heads, not a multiple of the {kh} key/value heads of k_cache")
    if bs == 0:
        raise ValueError(f"{op}: k_cache has shape {k_cache.shape}; blocks of BS = 0 slots hold no keys")
    shape_is(op, "out", out, (n, h, v_cache.shape[3]))
    b = block_tables.shape[0]
    shape_is(op, "query_starts", query_starts, (b + 1,))
    shape_is(op, "context_lens", context_lens, (b,))
    if key_ends is not None:
        shape_is(op, "key_ends", key_ends, (n,))
    scale = number(op, "scale", scale)
    window = window_size(op, window)
    if 0 not in out.shape:
        attrs = {"scale": scale, "window": window} if window else {"scale": scale}
        inputs = (q, k_cache, v_cache, block_tables, query_starts, context_lens)
        inputs += (key_ends,) if key_ends is not None else ()
        inputs += (k_scale, v_scale) if q8 else ()  # an 8-bit pool's scales: always the last two inputs
        name = op + ("_q8" if q8 else "") + ("_window" if window else "") + ("_ends" if key_ends is not None else "")
        _launch(plan, name, q.dtype, (out,), inputs, attrs)
    return out
