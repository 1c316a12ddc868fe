"""A request's prompt as token ids: text encoded with the model's tokenizer, or ids checked
against its vocabulary."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .protocol import LanguageModel


def has_tokenizer(model: LanguageModel) -> bool:
    """False for a model that takes token ids only (its tokenizer says what is ``missing``)."""
    return getattr(model.tokenizer, "missing", None) is None


def encode_prompt(model: LanguageModel, prompt: str | Sequence[int] | np.ndarray) -> list[int]:
    """Token ids (S,) of ``prompt``: text is encoded with the tokenizer's special tokens (BOS),
    ids are checked against the vocabulary. Raises ValueError for an empty or bad prompt."""
    if isinstance(prompt, str):
        ids = list(model.tokenizer.encode(prompt, add_special_tokens=True))
    elif isinstance(prompt, (np.ndarray, Sequence)) and not isinstance(prompt, (bytes, bytearray)):
        arr = np.asarray(prompt)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"prompt ids must be a 1-D sequence of ints, got {arr.dtype} array of shape {arr.shape}")
        ids = [int(t) for t in arr]
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty: give some text or at least one token id")
    vocab = getattr(model.tokenizer, "vocab_size", None) or getattr(model.config, "vocab_size", None)
    bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
    return ids
