"""Batch sampling: the next token of R requests from their logits (R, V) in one call, each request
with its own ``Sampler`` (settings and random generator), picking exactly the tokens, drawing
exactly the random numbers and reporting exactly the logprobs that calling each ``Sampler.sample``
in turn would.

Where the time goes at a 49k vocabulary is the passes over V. The batch makes fewer, with the
same floating-point operations on every value that decides a choice:

- penalties and the min-tokens mask touch only the few ids concerned, in place in the batch's
  own copy of the rows (no (V,) temporary per row);
- greedy rows take one 2-D argmax (first maximum, as the 1-D one);
- sampled rows are divided by their temperatures and their maxima found in one pass each;
  top-p's softmax then runs row by row in one reused float64 buffer (the same operations as
  ``processors.softmax``, the row's sum over a contiguous 1-D array as before, so numpy's
  pairwise summation groups it the same way) and only its kept ids go on;
- the draw needs the cumulative sum only over the tokens top-p kept: the filtered tokens weigh
  exactly 0, and adding 0.0 leaves a float64 partial sum unchanged, so the cumulative sum over
  the kept ids in index order equals the full one at those ids, total included, and
  ``searchsorted(side="right")`` lands on the same id.

Top-k, min-p and rows without top-p run the single-row processors on their row (identical by
construction). ``tests/test_batch_sampling.py`` compares the batch with the single-row sampler
over many random settings, bit for bit.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import processors as P
from .processors import FILTERED
from .results import SampledToken
from .sampler import Sampler, TokenIds, sample_from_logits


def sample_batch(samplers: Sequence[Sampler], logits: np.ndarray, context_ids: Sequence[TokenIds],
                 generated_ids: Sequence[TokenIds],
                 allowed: Sequence[np.ndarray | None] | None = None) -> list[SampledToken]:
    """``[samplers[r].sample(logits[r], context_ids[r], generated_ids[r], allowed=allowed[r]) for r]``,
    computed for the batch at once: the same tokens, logprobs and random draws.

    ``logits`` (R, V) float32; ``context_ids[r]`` (S + G,) and ``generated_ids[r]`` (G,) as in
    ``Sampler.sample``; ``allowed[r]`` (V,) bool or None (a grammar's mask). Raises ValueError as
    ``Sampler.sample`` does (bad shape, NaN logits, every token filtered out); after an error the
    generators of the other rows may or may not have drawn.
    """
    if not isinstance(logits, np.ndarray) or logits.ndim != 2 or logits.shape[1] == 0:
        shape = getattr(logits, "shape", type(logits).__name__)
        raise ValueError(f"sample_batch expects logits of shape (R, V), got {shape}")
    rows = logits.shape[0]
    allowed = [None] * rows if allowed is None else list(allowed)
    if not len(samplers) == len(context_ids) == len(generated_ids) == len(allowed) == rows:
        raise ValueError(f"sample_batch: {rows} rows of logits, {len(samplers)} samplers, {len(context_ids)} "
                         f"contexts, {len(generated_ids)} generated lists and {len(allowed)} masks")
    tokens = [0] * rows
    greedy = [r for r in range(rows) if samplers[r].config.greedy]
    sampled = [r for r in range(rows) if not samplers[r].config.greedy]
    if greedy:
        x = _penalized(greedy, samplers, logits, context_ids, generated_ids, allowed, writable=False)  # (Rg, V)
        picked = x.argmax(axis=1)  # (Rg,) the first maximum of each row, as np.argmax of the row
        best = x[np.arange(len(greedy)), picked]  # (Rg,)
        if np.isnan(best).any():  # argmax stops at the first NaN
            raise ValueError("the model returned NaN logits")
        if (best == -np.inf).any():
            raise ValueError("every token was masked out (min_tokens masks the stop ids)")
        for r, t in zip(greedy, picked.tolist()):
            tokens[r] = t
    if sampled:
        for r, t in zip(sampled, _sample(sampled, samplers, logits, context_ids, generated_ids, allowed)):
            tokens[r] = t
    out = []
    for r, t in enumerate(tokens):
        k = samplers[r].config.logprobs
        if k is None:
            out.append(SampledToken(t))
        else:
            lse = P.logsumexp(logits[r])
            out.append(SampledToken(t, float(logits[r, t]) - lse, P.top_logprobs(logits[r], lse, k)))
    return out


def _penalized(rows: list[int], samplers: Sequence[Sampler], logits: np.ndarray, context_ids: Sequence[TokenIds],
               generated_ids: Sequence[TokenIds], allowed: list[np.ndarray | None], *,
               writable: bool = True) -> np.ndarray:
    """``rows`` of ``logits`` (n, V) float32 with the grammar masks applied (-inf), then each
    row's penalties and min-tokens mask, in place on the ids concerned: our own copy, or
    ``logits`` itself when nothing applies, all rows are asked for and not ``writable``. Raises
    ValueError for NaN logits the min-tokens mask would overwrite (the rest show up later)."""
    kws = []
    for r in rows:
        c = samplers[r].config
        kw = dict(repetition=c.repetition_penalty, presence=c.presence_penalty, frequency=c.frequency_penalty,
                  stop_token_ids=samplers[r].stop_token_ids, min_tokens=c.min_tokens)
        kws.append(kw if P.penalties_apply(context_ids[r], generated_ids[r], **kw) else None)
    if not writable and len(rows) == logits.shape[0] and all(
            kw is None and allowed[r] is None for kw, r in zip(kws, rows)):
        return logits
    x = logits[rows]  # (n, V) a copy
    vocab = x.shape[1]
    for i, (r, kw) in enumerate(zip(rows, kws)):
        if allowed[r] is not None:
            np.copyto(x[i], FILTERED, where=~allowed[r])  # np.where(allowed, logits, -inf), in place
        if kw is not None:
            stops = kw["stop_token_ids"]
            stops = stops[(stops >= 0) & (stops < vocab)]
            if np.isnan(x[i, stops]).any():  # Sampler checks for NaN before the mask hides it
                raise ValueError("the model returned NaN logits")
            P.penalize_(x[i], context_ids[r], generated_ids[r], **kw)
    return x


def _sample(rows: list[int], samplers: Sequence[Sampler], logits: np.ndarray, context_ids: Sequence[TokenIds],
            generated_ids: Sequence[TokenIds], allowed: list[np.ndarray | None]) -> list[int]:
    """The drawn tokens of the sampling ``rows``, in their order, each generator drawing once."""
    x = _penalized(rows, samplers, logits, context_ids, generated_ids, allowed)  # (n, V)
    configs = [samplers[r].config for r in rows]
    x /= np.array([c.temperature or 1.0 for c in configs], dtype=np.float32)[:, None]  # as x / float32(t)
    for i, c in enumerate(configs):
        if c.top_k > 0:
            x[i] = P.top_k(x[i], c.top_k, c.min_tokens_to_keep)
    top = x.max(axis=1)  # (n,) exact whatever the order; NaN propagates
    if np.isnan(top).any():
        raise ValueError("the model returned NaN logits")
    vocab = x.shape[1]
    kept: dict[int, np.ndarray] = {}
    probs = np.empty(vocab, dtype=np.float64)  # (V,) one buffer for every row, kept in cache
    for i, c in enumerate(configs):
        if c.top_p < 1.0:  # softmax as processors.softmax computes it: astype, -= max, exp, /= sum
            np.subtract(x[i], top[i], out=probs, dtype=np.float64)
            np.exp(probs, out=probs)
            np.divide(probs, probs.sum(), out=probs)
            kept[i] = P.top_p_keep(probs, c.top_p, c.min_tokens_to_keep)  # (k,)
    tokens = []
    for i, r in enumerate(rows):
        c, rng = configs[i], samplers[r].rng
        if i in kept and c.min_p <= 0.0:
            tokens.append(_draw_kept(x[i], np.sort(kept[i]), rng))
            continue
        row = x[i]
        if i in kept:  # min-p after top-p: the filtered row, as top_p returns it
            row = np.full(vocab, FILTERED, dtype=x.dtype)  # (V,)
            row[kept[i]] = x[i, kept[i]]
        tokens.append(sample_from_logits(P.min_p(row, c.min_p, c.min_tokens_to_keep), rng))
    return tokens


def _draw_kept(row: np.ndarray, ids: np.ndarray, rng: np.random.Generator) -> int:
    """``sample_from_logits`` of ``row`` (V,) with every id but ``ids`` (k,) ascending set to -inf,
    in O(k): the same weights, cumulative sums and draw."""
    if ids.size == 0:
        raise ValueError("every token was filtered out; loosen top_k / top_p / min_p")
    values = row[ids]  # (k,)
    top = float(values.max())
    if top == -np.inf:
        raise ValueError("every token was filtered out; loosen top_k / top_p / min_p")
    weights = np.exp(values.astype(np.float64) - top)  # (k,)
    cdf = np.cumsum(weights)  # (k,) the full cdf at the kept ids
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[i]) if i < ids.size else row.shape[0]  # past the end only if the draw rounds up to the total
