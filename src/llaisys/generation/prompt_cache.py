"""A KV cache that remembers which tokens it holds, so a prompt that extends an earlier one
(the next turn of a chat) runs only its new tokens."""
from __future__ import annotations

from collections.abc import Sequence

from .protocol import KVCacheLike, LanguageModel


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading token ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """A model's KV cache plus the token ids whose keys and values it holds, in order."""

    __slots__ = ("cache", "token_ids")

    def __init__(self, model: LanguageModel, max_tokens: int | None = None) -> None:
        self.cache: KVCacheLike = model.new_cache(max_tokens)
        self.token_ids: list[int] = []

    @property
    def max_tokens(self) -> int:
        return self.cache.max_tokens

    def reuse(self, prompt_ids: Sequence[int]) -> int:
        """Keep the longest prefix shared with ``prompt_ids`` and drop the rest; return its length.

        At least the last prompt token is left to run, since its logits pick the next token.
        """
        keep = min(common_prefix_length(self.token_ids, prompt_ids), len(prompt_ids) - 1)
        keep = max(keep, 0)
        if keep < len(self.token_ids):
            self.cache.truncate(keep)
            del self.token_ids[keep:]
        return keep

    def reset(self) -> None:
        """Forget everything."""
        self.cache.reset()
        self.token_ids.clear()
