"""What generation needs from a model: the ``llaisys.models`` contract, as typing Protocols.

Any object with these members works, which lets tests drive generation with a small fake model.
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


class KVCacheLike(Protocol):
    length: int
    max_tokens: int

    def reset(self) -> None: ...

    def truncate(self, length: int) -> None: ...


class LanguageModel(Protocol):
    config: Any
    tokenizer: TokenizerLike
    eos_token_ids: list[int]
    generation_defaults: dict

    def new_cache(self, max_tokens: int | None = None) -> KVCacheLike: ...

    def forward(self, token_ids: Sequence[int] | np.ndarray, cache: KVCacheLike,
                all_logits: bool = False) -> np.ndarray: ...
