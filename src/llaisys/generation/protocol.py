"""What generation needs from a model: the ``llaisys.models`` contract, as typing Protocols.

Any object with these members works, which lets tests drive the engine with a small fake model.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


class TokenizerLike(Protocol):
    """Text <-> ids. A tokenizer may also have ``missing`` (why there is no vocabulary, or
    None): a model whose tokenizer is missing takes and streams token ids only."""

    vocab_size: int
    eos_token_ids: list[int]
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


class PagedCacheLike(Protocol):
    """KV slots in ``num_blocks`` blocks of ``block_size`` tokens; ``max_blocks``: the width of
    a block table."""

    block_size: int
    max_blocks: int


class ModelRunnerLike(Protocol):
    """How a model runs (``models.runner.ModelRunner``): a paged cache of its own and one pass
    over a batch of sequences returning the float32 logits (R, V) of the batch's
    ``logit_rows``. It may also have ``hidden_states`` (embeddings) and
    ``forward_batch_logits`` (logits left on an nvidia device). ``kv_dtype``: None for the
    model's own type, or the 8-bit layout (``DataType.I8``; the engine only passes it when asked)."""

    def kv_bytes_per_token(self, kv_dtype: Any = None) -> int: ...

    def new_paged_cache(self, num_blocks: int, block_size: int = 16, kv_dtype: Any = None) -> PagedCacheLike: ...

    def forward_batch(self, batch: Any, cache: PagedCacheLike) -> np.ndarray: ...


class LanguageModel(Protocol):
    """What the engine runs: the model's config (``vocab_size``, ``max_position_embeddings``),
    tokenizer and end ids, and its ``runner``. A model may also have ``device`` (speculation
    and device sampling look at it) and ``shard`` (tensor parallelism)."""

    config: Any
    tokenizer: TokenizerLike
    eos_token_ids: list[int]
    generation_defaults: dict
    runner: ModelRunnerLike
