"""Self-attention with grouped KV heads on the CPU: causal, with an optional sliding window, or
non-causal (every query sees every key)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..registry import register_kernel
from ._common import FLOATS, f32

if TYPE_CHECKING:
    from ...tensor import Tensor


@register_kernel("self_attention", "cpu", dtypes=FLOATS)
def self_attention(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """Causal grouped-query attention: q (S, H, D), k (T, KH, D), v (T, KH, Dv) into (S, H, Dv); attrs: scale."""
    out = outputs[0].host_array()  # (S, H, Dv)
    q, k, v = (f32(t.host_array()) for t in inputs)  # (S, H, D), (T, KH, D), (T, KH, Dv)
    s, h, d = q.shape
    t, kh, dv = v.shape
    g = h // kh
    if s == 1:
        out[...] = _one_query(q, k, v, attrs["scale"]).reshape(1, h, dv)
        return
    qg = q.reshape(s, kh, g, d).transpose(1, 2, 0, 3)  # (KH, G, S, D)
    scores = np.matmul(qg, k.transpose(1, 2, 0)[:, None])  # (KH, G, S, T)
    scores *= attrs["scale"]
    if s > 1:
        # query i sits at T - S + i and may see keys up to there
        future = np.arange(t)[None, :] > (np.arange(s)[:, None] + (t - s))  # (S, T)
        np.copyto(scores, -np.inf, where=future)  # as scores[..., future] = -inf, without building an index
    _softmax(scores)
    ctx = np.matmul(scores, v.transpose(1, 0, 2)[:, None])  # (KH, G, S, Dv)
    out[...] = ctx.transpose(2, 0, 1, 3).reshape(s, h, dv)


def _one_query(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Attention of one query q (1, H, D) over every key (no mask): (KH, G, Dv), fewer and
    smaller temporaries than the general path (one decoded token)."""
    t, kh, dv = v.shape
    qg = q.reshape(kh, -1, q.shape[2])  # (KH, G, D)
    scores = np.matmul(qg, k.transpose(1, 2, 0))  # (KH, G, T)
    scores *= scale
    _softmax(scores)
    return np.matmul(scores, v.transpose(1, 0, 2))  # (KH, G, Dv)


@register_kernel("self_attention_window", "cpu", dtypes=FLOATS)
def self_attention_window(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                          attrs: dict[str, Any]) -> None:
    """``self_attention`` where query i (at position T - S + i) sees only its last ``window``
    keys, its own included: keys T - S + i - window + 1 .. T - S + i; attrs: scale, window."""
    out = outputs[0].host_array()  # (S, H, Dv)
    q, k, v = (f32(t.host_array()) for t in inputs)  # (S, H, D), (T, KH, D), (T, KH, Dv)
    out[...] = windowed_attention(q, k, v, attrs["scale"], int(attrs["window"]))


def windowed_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, window: int,
                       ends: np.ndarray | None = None) -> np.ndarray:
    """q (S, H, D) at positions T-S .. T-1 over k (T, KH, D), v (T, KH, Dv), each query seeing
    its last ``window`` keys (0: all up to its own): (S, H, Dv) float32. ``ends`` (S,) moves
    where each query's keys end (query i sees keys before ends[i], ends[i] > its position; the
    window still counts back from its position)."""
    s, h, d = q.shape
    t, kh, dv = v.shape
    lo = max(0, t - s - window + 1) if window else 0  # keys before this no query sees
    k, v = k[lo:], v[lo:]
    qg = q.reshape(s, kh, h // kh, d).transpose(1, 2, 0, 3)  # (KH, G, S, D)
    scores = np.matmul(qg, k.transpose(1, 2, 0)[:, None])  # (KH, G, S, T - lo)
    scores *= scale
    key = np.arange(lo, t)[None, :]  # (1, T - lo) key positions
    pos = np.arange(s)[:, None] + (t - s)  # (S, 1) query positions
    hidden = key > pos if ends is None else key >= ends[:, None]
    if window:
        hidden |= key <= pos - window
    np.copyto(scores, -np.inf, where=hidden)
    _softmax(scores)
    ctx = np.matmul(scores, v.transpose(1, 0, 2)[:, None])  # (KH, G, S, Dv)
    return ctx.transpose(2, 0, 1, 3).reshape(s, h, dv).astype(np.float32, copy=False)


@register_kernel("self_attention_full", "cpu", dtypes=FLOATS)
def self_attention_full(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                        attrs: dict[str, Any]) -> None:
    """Non-causal grouped-query attention, every query seeing every key: q (S, H, D),
    k (T, KH, D), v (T, KH, Dv) into (S, H, Dv), S and T unrelated; attrs: scale."""
    out = outputs[0].host_array()  # (S, H, Dv)
    q, k, v = (f32(t.host_array()) for t in inputs)  # (S, H, D), (T, KH, D), (T, KH, Dv)
    s, h, d = q.shape
    t, kh, dv = v.shape
    qg = q.reshape(s, kh, h // kh, d).transpose(1, 2, 0, 3)  # (KH, G, S, D)
    scores = np.matmul(qg, k.transpose(1, 2, 0)[:, None])  # (KH, G, S, T)
    scores *= attrs["scale"]
    _softmax(scores)
    ctx = np.matmul(scores, v.transpose(1, 0, 2)[:, None])  # (KH, G, S, Dv)
    out[...] = ctx.transpose(2, 0, 1, 3).reshape(s, h, dv)


def _softmax(scores: np.ndarray) -> None:
    """Softmax over the last axis of ``scores`` (..., T) in place; each row holds a finite entry
    (masked entries are -inf)."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
