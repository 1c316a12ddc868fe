"""The sampler: logits -> the next token (id, and logprobs when asked) of each request, under its
GenerationConfig and its own random Generator. ``Sampler`` holds one request's settings and
generator; ``sample_batch`` picks the tokens of R requests from their logits (R, V) in one call
(the engine's step), and ``Sampler.sample`` is the same call with one row: one code path applies
the penalties, temperature and filters for the CPU.

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

Top-k and min-p run the single-row processors on their row. ``tests/test_batch_sampling.py``
compares the batch with the processors applied row by row in Hugging Face's order (each
processor checked against Hugging Face's in ``tests/test_sampling.py``), bit for bit.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from . import processors as P
from .config import GenerationConfig
from .processors import FILTERED
from .results import SampledToken

TokenIds = Sequence[int] | np.ndarray


def sample_from_logits(logits: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from softmax(logits) (V,); ``-inf`` entries are never drawn.

    One uniform number per draw, inverted through the cumulative distribution.
    """
    top = float(logits.max())
    if top == -np.inf:
        raise ValueError("every token was filtered out; loosen top_k / top_p / min_p")
    weights = np.exp(logits.astype(np.float64) - top)  # (V,) filtered tokens weigh 0
    cdf = np.cumsum(weights)  # (V,)
    # side="right": the first index whose cdf exceeds the draw, never a zero-weight one
    return int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))


class Sampler:
    """Picks the next token of one request.

    The logits are penalized (repetition penalty over the prompt and generated tokens, then the
    presence and frequency penalties over the generated tokens, vLLM's order) and the stop ids
    masked while fewer than ``config.min_tokens`` tokens were generated. A greedy config then takes
    the argmax; otherwise temperature, top-k, top-p, min-p (Hugging Face's order) and one draw from
    the sampler's own ``numpy.random.default_rng(config.seed)`` (or ``rng``), so a choice depends
    only on this request's logits and generator: the same seed repeats the same choices whether
    the request runs alone or beside others. A greedy step draws nothing.

    ``stop_token_ids`` are the ids masked until ``config.min_tokens`` tokens were generated: every
    id that would end the request (the model's EOS ids and ``config.eos_token_ids``; none when
    ``config.ignore_eos``). None takes ``config.eos_token_ids`` (unless ``ignore_eos``), which does
    not know the model's own EOS ids: a caller that has a model should pass them.

    ``sample_batch`` picks the tokens of many samplers' rows (R, V) in one call; ``sample`` is
    that call with one row.
    """

    __slots__ = ("config", "rng", "stop_token_ids")

    def __init__(self, config: GenerationConfig, rng: np.random.Generator | None = None, *,
                 stop_token_ids: Iterable[int] | None = None) -> None:
        self.config = config
        self.rng = rng if rng is not None else np.random.default_rng(config.seed)
        if stop_token_ids is None:
            stop_token_ids = () if config.ignore_eos else config.eos_token_ids
        self.stop_token_ids = np.array(sorted({int(t) for t in stop_token_ids}), dtype=np.int64)  # (E,)

    def process(self, logits: np.ndarray, context_ids: TokenIds = (), generated_ids: TokenIds = ()) -> np.ndarray:
        """The filtered logits (V,) float32 a sampling draw would use: penalties and the min-tokens
        mask, then temperature, top-k, top-p, min-p. ``context_ids``: prompt and generated ids;
        ``generated_ids``: generated ids only (see ``sample``)."""
        _check_row(logits)
        x, _, kept = _filtered([0], [self], logits[None], [context_ids], [generated_ids], [None])
        return _kept_row(x[0], kept.get(0), self.config)

    def sample(self, logits: np.ndarray, context_ids: TokenIds, generated_ids: TokenIds, *,
               allowed: np.ndarray | None = None) -> SampledToken:
        """The next token for ``logits`` (V,) float32, the model's output after ``context_ids``.

        ``context_ids`` (S + G,): every token id so far, prompt then generated (the repetition
        penalty counts these); ``generated_ids`` (G,): the ids this request generated so far, the
        tail of ``context_ids`` (the presence and frequency penalties count these, and
        ``len(generated_ids)`` is the number generated that ``config.min_tokens`` compares with).
        With ``config.logprobs`` set, the SampledToken also carries the model's raw logprobs
        (computed only then, and without touching the random generator). ``allowed`` (V,) bool:
        the only tokens that may be picked (a grammar's mask; the others get ``-inf`` before the
        penalties), the logprobs still being the raw logits'.
        """
        _check_row(logits)
        return sample_batch([self], logits[None], [context_ids], [generated_ids], [allowed])[0]

    def __call__(self, logits: np.ndarray, context_ids: TokenIds = (), generated_ids: TokenIds = ()) -> int:
        """The next token id for ``logits`` (V,): ``sample(...).token_id``.
        ``generated_ids`` left empty means no presence/frequency penalty and no min-tokens mask."""
        return self.sample(logits, context_ids, generated_ids).token_id


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
    _check_rows(logits, "sample_batch")
    rows = logits.shape[0]
    allowed = [None] * rows if allowed is None else list(allowed)
    if not len(samplers) == len(context_ids) == len(generated_ids) == len(allowed) == rows:
        raise ValueError(f"sample_batch: {rows} rows of logits, {len(samplers)} samplers, {len(context_ids)} "
                         f"contexts, {len(generated_ids)} generated lists and {len(allowed)} masks")
    tokens = [0] * rows
    greedy, sampled = [], []
    for r, s in enumerate(samplers):
        (greedy if s.config.greedy else sampled).append(r)
    if greedy:
        x = _penalized(greedy, samplers, logits, context_ids, generated_ids, allowed, writable=False)  # (Rg, V)
        picked = x.argmax(axis=1).tolist()  # (Rg,) the first maximum of each row, as np.argmax of the row
        for i, (r, t) in enumerate(zip(greedy, picked)):
            best = float(x[i, t])
            if best != best:  # NaN: argmax stops at the first NaN
                raise ValueError("the model returned NaN logits")
            if best == -np.inf:
                raise ValueError("every token was masked out (min_tokens masks the stop ids)")
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


def _check_row(logits: np.ndarray) -> None:
    if not isinstance(logits, np.ndarray) or logits.ndim != 1 or logits.size == 0:
        shape = getattr(logits, "shape", type(logits).__name__)
        raise ValueError(f"Sampler expects logits of shape (V,), got {shape}")


def _check_rows(logits: np.ndarray, who: str) -> None:
    if not isinstance(logits, np.ndarray) or logits.ndim != 2 or logits.shape[1] == 0:
        shape = getattr(logits, "shape", type(logits).__name__)
        raise ValueError(f"{who} expects logits of shape (R, V), got {shape}")


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


def _filtered(rows: list[int], samplers: Sequence[Sampler], logits: np.ndarray, context_ids: Sequence[TokenIds],
              generated_ids: Sequence[TokenIds], allowed: list[np.ndarray | None]
              ) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    """The sampling ``rows`` after the grammar masks, penalties, temperature and top-k: (n, V)
    float32, their maxima (n,), and by row position the ids top-p keeps (k,) most likely first
    (rows without top-p absent). Min-p is left for the draw (``_kept_row``)."""
    x = _penalized(rows, samplers, logits, context_ids, generated_ids, allowed)  # (n, V)
    configs = [samplers[r].config for r in rows]
    x /= np.array([c.temperature or 1.0 for c in configs], dtype=np.float32)[:, None]  # as x / float32(t)
    for i, c in enumerate(configs):
        if c.top_k > 0:
            x[i] = P.top_k(x[i], c.top_k, c.min_tokens_to_keep)
    top = x.max(axis=1)  # (n,) exact whatever the order; NaN propagates
    if np.isnan(top).any():
        raise ValueError("the model returned NaN logits")
    kept: dict[int, np.ndarray] = {}
    probs = np.empty(x.shape[1], dtype=np.float64)  # (V,) one buffer for every row, kept in cache
    for i, c in enumerate(configs):
        if c.top_p < 1.0:  # softmax as processors.softmax computes it: astype, -= max, exp, /= sum
            np.subtract(x[i], top[i], out=probs, dtype=np.float64)
            np.exp(probs, out=probs)
            np.divide(probs, probs.sum(), out=probs)
            kept[i] = P.top_p_keep(probs, c.top_p, c.min_tokens_to_keep)  # (k,)
    return x, top, kept


def _kept_row(row: np.ndarray, kept: np.ndarray | None, config: GenerationConfig) -> np.ndarray:
    """``row`` (V,) with only the ``kept`` ids (None: all) left, then min-p: what is drawn from."""
    if kept is not None:
        out = np.full(row.shape[0], FILTERED, dtype=row.dtype)  # (V,)
        out[kept] = row[kept]
        row = out
    return P.min_p(row, config.min_p, config.min_tokens_to_keep)


def _sample(rows: list[int], samplers: Sequence[Sampler], logits: np.ndarray, context_ids: Sequence[TokenIds],
            generated_ids: Sequence[TokenIds], allowed: list[np.ndarray | None]) -> list[int]:
    """The drawn tokens of the sampling ``rows``, in their order, each generator drawing once."""
    x, _, kept = _filtered(rows, samplers, logits, context_ids, generated_ids, allowed)
    tokens = []
    for i, r in enumerate(rows):
        c, rng = samplers[r].config, samplers[r].rng
        if i in kept and c.min_p <= 0.0:
            tokens.append(_draw_kept(x[i], np.sort(kept[i]), rng))
        else:
            tokens.append(sample_from_logits(_kept_row(x[i], kept.get(i), c), rng))
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
