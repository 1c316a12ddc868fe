"""Incremental detokenization: token ids in, text deltas out, never half a UTF-8 character."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    A byte-level token may hold only part of a character; decoding it alone gives U+FFFD, so
    text is held back while the decoded window ends in U+FFFD and released once the character
    is complete. Each step decodes a short window (the last released tokens plus the new
    ones), not the whole sequence, so the cost per token stays flat; the window keeps a few
    earlier tokens because some decoders drop a leading space at the start of a sequence.
    """

    __slots__ = ("_tokenizer", "_skip_special", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Decoder, context_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, context: int = 4) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(context_ids[-context:]) if context > 0 else []
        self._prefix = 0  # window start: tokens before it are released and out of view
        self._read = len(self._ids)  # tokens before it are released

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is unfinished)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """Release whatever is held back (an unfinished character decodes as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text):]
