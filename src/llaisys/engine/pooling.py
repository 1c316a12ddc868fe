"""Embeddings: a request that is prefilled only, its final hidden states pooled into one vector.

    engine = LLMEngine(model, prefix_caching=False)      # mean pooling needs every token computed
    engine.add_request(None, ids, PoolingConfig(pooling="mean"))
    (out,) = [o for o in engine.step() if o.finished]  # out.embedding: (D,) float32, unit length

The hidden states are the model's last ones, after the final norm (transformers'
``hidden_states[-1]``), read from the step's batch for the request's rows. ``"last"`` takes the
last prompt token's (always computed, so any engine does); ``"mean"`` averages over every prompt
token, which a prefix-cache hit would skip, so it wants an engine without prefix caching.
Positions already seen are not counted twice, so preemption (a recomputed prompt) changes
nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..generation import GenerationConfig

POOLINGS = ("last", "mean")


@dataclass(slots=True)
class PoolingConfig(GenerationConfig):
    """A request for an embedding: ``pooling`` "last" or "mean" over the prompt's final hidden
    states, L2-normalized when ``normalize``. Nothing is generated."""

    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        GenerationConfig.__post_init__(self)
        if self.pooling not in POOLINGS:
            raise ValueError(f"PoolingConfig.pooling must be one of {POOLINGS}, got {self.pooling!r}")


def pooling_of(config: GenerationConfig) -> PoolingConfig | None:
    """The config itself when it asks for an embedding, else None."""
    return config if isinstance(config, PoolingConfig) else None


class Pooler:
    """One embedding request's running pool over its prompt's hidden rows."""

    __slots__ = ("config", "length", "seen", "total", "last")

    def __init__(self, config: PoolingConfig, length: int) -> None:
        self.config = config
        self.length = length  # prompt tokens
        self.seen = 0  # positions pooled so far (a recomputation sees them again)
        self.total: np.ndarray | None = None  # (D,) float64 sum, mean pooling
        self.last: np.ndarray | None = None  # (D,) the last token's row

    def add(self, rows: np.ndarray, start: int) -> None:
        """Take the hidden rows (k, D) of positions ``start:start + k``."""
        end = start + rows.shape[0]
        if self.config.pooling == "last":  # only the last row counts: cached positions do not matter
            if end == self.length:
                self.last = rows[-1].astype(np.float64)
            return
        if end <= self.seen:
            return
        if start > self.seen:
            raise RuntimeError(f"pooling missed positions {self.seen}:{start} (a prefix-cache hit?)")
        fresh = rows[self.seen - start:].astype(np.float64)  # (k', D)
        self.total = fresh.sum(axis=0) if self.total is None else self.total + fresh.sum(axis=0)
        self.seen = end

    def result(self) -> np.ndarray:
        """The embedding (D,) float32."""
        vec = self.total / self.length if self.config.pooling == "mean" else self.last  # (D,)
        assert vec is not None, "the prompt's last token was not pooled"
        if self.config.normalize:
            norm = float(np.linalg.norm(vec))
            vec = vec / norm if norm > 0 else vec
        return vec.astype(np.float32)
