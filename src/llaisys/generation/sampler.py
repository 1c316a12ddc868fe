"""Sampler: logits (V,) float32 -> one token id, under a GenerationConfig and its own random Generator."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .config import GenerationConfig
from .processors import process_logits, repetition_penalty


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
    """Picks the next token. Greedy (argmax after the repetition penalty) when the config is greedy;
    otherwise repetition penalty, temperature, top-k, top-p, min-p (Hugging Face's order), then a draw
    from ``numpy.random.default_rng(config.seed)``, so the same seed repeats the same choices."""

    __slots__ = ("config", "rng")

    def __init__(self, config: GenerationConfig, rng: np.random.Generator | None = None) -> None:
        self.config = config
        self.rng = rng if rng is not None else np.random.default_rng(config.seed)

    def process(self, logits: np.ndarray, context_ids: Sequence[int] | np.ndarray = ()) -> np.ndarray:
        """The filtered logits (V,) float32 a sampling draw would use."""
        c = self.config
        return process_logits(logits, context_ids, penalty=c.repetition_penalty, temp=c.temperature or 1.0,
                              k=c.top_k, p=c.top_p, min_prob=c.min_p, min_tokens_to_keep=c.min_tokens_to_keep)

    def __call__(self, logits: np.ndarray, context_ids: Sequence[int] | np.ndarray = ()) -> int:
        """The next token id for ``logits`` (V,) given every token id so far (prompt and generated)."""
        if not isinstance(logits, np.ndarray) or logits.ndim != 1 or logits.size == 0:
            shape = getattr(logits, "shape", type(logits).__name__)
            raise ValueError(f"Sampler expects logits of shape (V,), got {shape}")
        if np.isnan(logits).any():
            raise ValueError("the model returned NaN logits")
        if self.config.greedy:
            x = repetition_penalty(logits, context_ids, self.config.repetition_penalty)
            return int(np.argmax(x))
        return sample_from_logits(self.process(logits, context_ids), self.rng)
