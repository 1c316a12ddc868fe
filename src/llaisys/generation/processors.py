"""Logits processors: pure functions on one logits vector (V,) float32, each returning a new array
(or the input itself when it has nothing to do; the input is never written).

The filters follow the Hugging Face processors of the same names; the presence and frequency
penalties and the min-tokens mask follow OpenAI and vLLM. ``penalize_`` applies the penalties
and the mask in place on the caller's copy, in vLLM's order (repetition, frequency and presence
penalties). A filtered-out token gets ``-inf``. ``logsumexp`` and ``top_logprobs`` give the
model's own log-probabilities of the raw logits. The sampler (``sampler.sample_batch``) composes
these, with temperature, in Hugging Face's order; ``top_p_keep`` is its top-p (the ids kept).
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


def _in_vocab(ids: np.ndarray, vocab: int) -> np.ndarray:
    """A mask (U,) of the ``ids`` (U,) that index a vocabulary of ``vocab`` tokens."""
    return (ids >= 0) & (ids < vocab)


def _repetition_penalty_(x: np.ndarray, context_ids: Sequence[int] | np.ndarray, penalty: float) -> None:
    """``repetition_penalty`` in place on ``x`` (V,)."""
    ids = np.unique(np.asarray(context_ids, dtype=np.int64))  # (U,)
    ids = ids[_in_vocab(ids, x.shape[0])]
    picked = x[ids]  # (U,)
    x[ids] = np.where(picked < 0, picked * np.float32(penalty), picked / np.float32(penalty))


def _presence_frequency_penalty_(x: np.ndarray, generated_ids: Sequence[int] | np.ndarray, presence: float,
                                 frequency: float) -> None:
    """``presence_frequency_penalty`` in place on ``x`` (V,)."""
    ids, counts = np.unique(np.asarray(generated_ids, dtype=np.int64), return_counts=True)  # (U,), (U,)
    ok = _in_vocab(ids, x.shape[0])
    ids, counts = ids[ok], counts[ok]
    # The penalty is formed in float64 and the result rounded to x's dtype once.
    x[ids] = x[ids] - (presence + frequency * counts)  # (U,)


def _mask_(x: np.ndarray, token_ids: np.ndarray) -> None:
    """Set ``x[token_ids]`` to -inf in place, ids outside ``x`` (V,) ignored."""
    x[token_ids[_in_vocab(token_ids, x.shape[0])]] = FILTERED


def _min_tokens_active(stop_token_ids: Sequence[int] | np.ndarray, num_generated: int, min_tokens: int) -> bool:
    return num_generated < min_tokens and len(stop_token_ids) > 0


def repetition_penalty(logits: np.ndarray, context_ids: Sequence[int] | np.ndarray, penalty: float) -> np.ndarray:
    """Penalize every token id in ``context_ids`` (prompt and generated so far), as CTRL does:
    a positive logit is divided by ``penalty``, a negative one multiplied. Each id counts once."""
    if penalty == 1.0 or len(context_ids) == 0:
        return logits
    out = logits.copy()  # (V,)
    _repetition_penalty_(out, context_ids, penalty)
    return out


def presence_frequency_penalty(logits: np.ndarray, generated_ids: Sequence[int] | np.ndarray, presence: float,
                               frequency: float) -> np.ndarray:
    """OpenAI's penalties: ``logits[t] - presence * (count[t] > 0) - frequency * count[t]``, where
    ``count[t]`` is how often token ``t`` occurs in ``generated_ids`` (the generated tokens only,
    not the prompt, as in OpenAI and vLLM). Negative values reward repeats instead."""
    if (presence == 0.0 and frequency == 0.0) or len(generated_ids) == 0:
        return logits
    out = logits.copy()  # (V,)
    _presence_frequency_penalty_(out, generated_ids, presence, frequency)
    return out


def min_tokens_mask(logits: np.ndarray, stop_token_ids: Sequence[int] | np.ndarray, num_generated: int,
                    min_tokens: int) -> np.ndarray:
    """Logits (V,) with ``-inf`` on ``stop_token_ids`` (E,) (EOS and stop token ids) while
    ``num_generated`` < ``min_tokens``, so that generation cannot end before ``min_tokens`` tokens
    (vLLM's ``min_tokens``); ids outside the vocabulary are ignored."""
    if not _min_tokens_active(stop_token_ids, num_generated, min_tokens):
        return logits
    out = logits.copy()  # (V,)
    _mask_(out, np.asarray(stop_token_ids, dtype=np.int64))
    return out


def penalties_apply(context_ids: Sequence[int] | np.ndarray = (), generated_ids: Sequence[int] | np.ndarray = (), *,
                    repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0,
                    stop_token_ids: Sequence[int] | np.ndarray = (), min_tokens: int = 0) -> bool:
    """Whether ``penalize_`` with these arguments would change anything."""
    return (repetition != 1.0 and len(context_ids) > 0
            or (presence != 0.0 or frequency != 0.0) and len(generated_ids) > 0
            or _min_tokens_active(stop_token_ids, len(generated_ids), min_tokens))


def penalize_(x: np.ndarray, context_ids: Sequence[int] | np.ndarray = (),
              generated_ids: Sequence[int] | np.ndarray = (), *, repetition: float = 1.0, presence: float = 0.0,
              frequency: float = 0.0, stop_token_ids: Sequence[int] | np.ndarray = (),
              min_tokens: int = 0) -> None:
    """``repetition_penalty`` over ``context_ids`` (prompt + generated), then
    ``presence_frequency_penalty`` over ``generated_ids`` (generated only), then ``min_tokens_mask``
    with ``len(generated_ids)`` tokens generated, in place on ``x`` (V,) float32 (the caller's own
    copy): the same operations on the same few entries, no (V,) temporary."""
    if repetition != 1.0 and len(context_ids) > 0:
        _repetition_penalty_(x, context_ids, repetition)
    if (presence != 0.0 or frequency != 0.0) and len(generated_ids) > 0:
        _presence_frequency_penalty_(x, generated_ids, presence, frequency)
    if _min_tokens_active(stop_token_ids, len(generated_ids), min_tokens):
        _mask_(x, np.asarray(stop_token_ids, dtype=np.int64))


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
    keep = top_p_keep(softmax(logits), p, min_tokens_to_keep)  # (n,)
    out = np.full_like(logits, FILTERED)
    out[keep] = logits[keep]
    return out


def top_p_keep(probs: np.ndarray, p: float, min_tokens_to_keep: int = 1, top: float | None = None) -> np.ndarray:
    """The ids (n,) int64 ``top_p`` keeps, most likely first, given ``probs`` (V,) float64 (the
    softmax of the logits) and ``top`` (``probs.max()``, computed here when None)."""
    # The kept tokens are a prefix of the descending order, so all tokens at or above a
    # threshold hold it once their mass reaches p; only those are sorted.
    threshold = (probs.max() if top is None else top) * 1e-3
    while True:
        head = np.flatnonzero(probs >= threshold)  # (m,)
        if head.size >= min_tokens_to_keep and probs[head].sum() >= p or threshold == 0.0:
            break
        threshold = threshold * 1e-3 if threshold > 1e-300 else 0.0
    head = head[np.argsort(-probs[head], kind="stable")]  # (m,) descending
    cumulative = np.cumsum(probs[head])  # (m,)
    n_keep = max(int(np.searchsorted(cumulative, p, side="left")) + 1, min_tokens_to_keep)
    return head[:n_keep]


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


def logsumexp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))) of logits (V,), computed in float64; ``-inf`` entries add nothing.

    ``logits[t] - logsumexp(logits)`` is log_softmax(logits)[t]. Raises ValueError when the
    largest logit is not finite (no distribution)."""
    top = float(logits.max())
    if not np.isfinite(top):
        raise ValueError(f"logits must have a finite maximum to give logprobs, got {top}")
    x = logits.astype(np.float64)  # (V,)
    x -= top
    np.exp(x, out=x)
    return top + float(np.log(x.sum()))


def top_logprobs(logits: np.ndarray, lse: float, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of logits (V,) as ``(token_id, logprob)``, logprob =
    ``logits[t] - lse`` in float64 (``lse = logsumexp(logits)``), by descending logprob, ties by
    lower token id; ``min(k, V)`` pairs, [] for k == 0."""
    n = logits.shape[0]
    k = min(k, n)
    if k <= 0:
        return []
    kth = np.partition(logits, n - k)[n - k]  # the k-th largest logit
    ids = np.flatnonzero(logits >= kth)  # (m,) ascending, m >= k when the k-th value ties
    ids = ids[np.argsort(-logits[ids], kind="stable")[:k]]  # (k,) descending, ties by lower id
    return [(int(t), float(logits[t]) - lse) for t in ids]
