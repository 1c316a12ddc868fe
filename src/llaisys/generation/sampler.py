"""Sampler: logits (V,) float32 -> one token (id, and logprobs when asked), under a GenerationConfig
and its own random Generator."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .config import GenerationConfig
from .processors import FILTERED, logsumexp, penalize, process_logits, top_logprobs
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

    ``batch_sampler.sample_batch`` picks the tokens of many samplers' rows (R, V) in one call,
    exactly as ``sample`` on each row would (the engine's step uses it).
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
        c = self.config
        return process_logits(logits, context_ids, penalty=c.repetition_penalty, temp=c.temperature or 1.0,
                              k=c.top_k, p=c.top_p, min_prob=c.min_p, min_tokens_to_keep=c.min_tokens_to_keep,
                              generated_ids=generated_ids, presence=c.presence_penalty,
                              frequency=c.frequency_penalty, stop_token_ids=self.stop_token_ids,
                              min_tokens=c.min_tokens)

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
        picked_from = logits if allowed is None else np.where(allowed, logits, FILTERED)  # (V,)
        token = self._pick(picked_from, context_ids, generated_ids)
        k = self.config.logprobs
        if k is None:
            return SampledToken(token)
        lse = logsumexp(logits)
        return SampledToken(token, float(logits[token]) - lse, top_logprobs(logits, lse, k))

    def __call__(self, logits: np.ndarray, context_ids: TokenIds = (), generated_ids: TokenIds = ()) -> int:
        """The next token id for ``logits`` (V,): ``sample(...).token_id``, no logprobs computed.
        ``generated_ids`` left empty means no presence/frequency penalty and no min-tokens mask."""
        return self._pick(logits, context_ids, generated_ids)

    def _pick(self, logits: np.ndarray, context_ids: TokenIds, generated_ids: TokenIds) -> int:
        if not isinstance(logits, np.ndarray) or logits.ndim != 1 or logits.size == 0:
            shape = getattr(logits, "shape", type(logits).__name__)
            raise ValueError(f"Sampler expects logits of shape (V,), got {shape}")
        if np.isnan(logits.max()):  # max propagates NaN: a check without a (V,) temporary
            raise ValueError("the model returned NaN logits")
        c = self.config
        if c.greedy:
            x = penalize(logits, context_ids, generated_ids, repetition=c.repetition_penalty,
                         presence=c.presence_penalty, frequency=c.frequency_penalty,
                         stop_token_ids=self.stop_token_ids, min_tokens=c.min_tokens)  # (V,)
            token = int(np.argmax(x))
            if x[token] == -np.inf:
                raise ValueError("every token was masked out (min_tokens masks the stop ids)")
            return token
        return sample_from_logits(self.process(logits, context_ids, generated_ids), self.rng)
