"""A request's prompt as token ids: text encoded with the model's tokenizer, or ids checked
against its vocabulary."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


def image_prompt(model: LanguageModel, text: str, images: Sequence, add_special_tokens: bool = True) -> tuple[list[int], Any]:
    """The prompt ids (S,) of ``text`` with ``images`` (RGB PIL images) in it, and where their
    rows go (``PromptImages``, None without images). Each image is encoded by the model's vision
    tower (once per picture while it is kept) and its placeholder in ``text`` (the tower's, as
    the chat template writes it: SmolVLM's "<image>") becomes the image's tokens; a text with no
    placeholder takes the images before it. ValueError for images given to a model without a
    vision encoder, or placeholders that do not match the images in number."""
    vision = getattr(model, "vision", None)
    if not images:
        return list(model.tokenizer.encode(text, add_special_tokens=add_special_tokens)), None
    if vision is None:
        raise ValueError("this model has no vision encoder; it takes text only (send no images)")
    if vision.placeholder not in text:
        text = vision.standalone * len(images) + text
    embedded = [vision.embed(image) for image in images]
    ids = list(model.tokenizer.encode(vision.expand(text, embedded), add_special_tokens=add_special_tokens))
    return ids, vision.place(ids, embedded)


def message_images(messages: Sequence[dict]) -> list:
    """The images of chat ``messages`` in order: the "image" of each part {"type": "image",
    "image": <RGB PIL image>}."""
    return [part.get("image") for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]
