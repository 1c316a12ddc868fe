"""Logits processors: pure functions on one logits vector (V,) float32, each returning a new array.

They follow the Hugging Face processors of the same names, and ``process_logits`` applies them
in Hugging Face's order: repetition penalty, temperature, top-k, top-p, min-p. A filtered-out
token gets ``-inf``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FILTERED = np.float32(-np.inf)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities (V,) float64 of logits (V,); ``-inf`` entries get probability 0."""
    x = logits.astype(np.float64)  # (V,)
    x -= x.max()
    np.exp(x, out=x)
    x /= x.sum()
    return x


def repetition_penalty(logits: np.ndarray, context_ids: Sequence[int] | np.ndarray, penalty: float) -> np.ndarray:
    """Penalize every token id in ``context_ids`` (prompt and generated so far), as CTRL does:
    a positive logit is divided by ``penalty``, a negative one multiplied. Each id counts once."""
    if penalty == 1.0 or len(context_ids) == 0:
        return logits
    ids = np.unique(np.asarray(context_ids, dtype=np.int64))  # (U,)
    ids = ids[(ids >= 0) & (ids < logits.shape[0])]
    out = logits.copy()  # (V,)
    picked = out[ids]  # (U,)
    out[ids] = np.where(picked < 0, picked * np.float32(penalty), picked / np.float32(penalty))
    return out


def temperature(logits: np.ndarray, value: float) -> np.ndarray:
    """logits / value (value > 0)."""
    if value == 1.0:
        return logits
    return logits / np.float32(value)


def top_k(logits: np.ndarray, k: int, min_tokens_to_keep: int = 1) -> np.ndarray:
    """Keep the ``k`` largest logits (ties with the k-th are kept too); k == 0 keeps all."""
    if k <= 0:
        return logits
    k = min(max(k, min_tokens_to_keep), logits.shape[0])
    kth = np.partition(logits, logits.shape[0] - k)[logits.shape[0] - k]
    return np.where(logits < kth, FILTERED, logits)


def top_p(logits: np.ndarray, p: float, min_tokens_to_keep: int = 1) -> np.ndarray:
    """Nucleus filter: keep the most likely tokens whose probabilities sum to at least ``p``.

    As in Hugging Face, a token stays when the probability of the tokens more likely than it
    sums to less than ``p``; the ``min_tokens_to_keep`` most likely always stay.
    """
    if p >= 1.0:
        return logits
    probs = softmax(logits)  # (V,)
    # The kept tokens are a prefix of the descending order, so all tokens at or above a
    # threshold hold it once their mass reaches p; only those are sorted.
    threshold = probs.max() * 1e-3
    while True:
        head = np.flatnonzero(probs >= threshold)  # (m,)
        if head.size >= min_tokens_to_keep and probs[head].sum() >= p or threshold == 0.0:
            break
        threshold = threshold * 1e-3 if threshold > 1e-300 else 0.0
    head = head[np.argsort(-probs[head], kind="stable")]  # (m,) descending
    cumulative = np.cumsum(probs[head])  # (m,)
    n_keep = max(int(np.searchsorted(cumulative, p, side="left")) + 1, min_tokens_to_keep)
    out = np.full_like(logits, FILTERED)
    keep = head[:n_keep]
    out[keep] = logits[keep]
    return out


def min_p(logits: np.ndarray, p: float, min_tokens_to_keep: int = 1) -> np.ndarray:
    """Drop tokens whose probability is below ``p`` times the top token's; p == 0 keeps all."""
    if p <= 0.0:
        return logits
    probs = softmax(logits)  # (V,)
    drop = probs < p * probs.max()  # (V,)
    keep_n = min(min_tokens_to_keep, logits.shape[0])
    if keep_n > 1:
        drop[np.argpartition(-probs, keep_n - 1)[:keep_n]] = False
    else:
        drop[np.argmax(probs)] = False
    return np.where(drop, FILTERED, logits)


def process_logits(logits: np.ndarray, context_ids: Sequence[int] | np.ndarray, *, penalty: float = 1.0,
                   temp: float = 1.0, k: int = 0, p: float = 1.0, min_prob: float = 0.0,
                   min_tokens_to_keep: int = 1) -> np.ndarray:
    """All processors in Hugging Face's order; returns the filtered logits (V,) float32."""
    x = repetition_penalty(logits, context_ids, penalty)
    x = temperature(x, temp)
    x = top_k(x, k, min_tokens_to_keep)
    x = top_p(x, p, min_tokens_to_keep)
    return min_p(x, min_prob, min_tokens_to_keep)
