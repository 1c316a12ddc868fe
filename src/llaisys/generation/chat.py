"""Chat messages: checked, then rendered with the model's chat template into the reply's prompt ids
(``engine.stream.stream_chat`` generates the reply)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .prompts import image_prompt, message_images
from .protocol import LanguageModel

ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Sequence[dict]) -> list[dict]:
    """Validate chat messages: a non-empty list of {"role": one of ROLES, "content": ...} with
    content a str, a list of text parts ({"type": "text", "text": ...}, joined by the template
    renderer) or, for an assistant message, None. Raises TypeError or ValueError naming the
    bad message."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise TypeError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise TypeError(f"messages[{i}]['role'] must be a str, one of {ROLES}, got {type(role).__name__} {role!r}")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {ROLES}, got {role!r}")
        if not (isinstance(content, (str, list)) or (content is None and role == "assistant")):
            allowed = "a str, a list of text parts or None" if role == "assistant" else "a str or a list of text parts"
            raise TypeError(f"messages[{i}]['content'] ({role}) must be {allowed}, got {type(content).__name__}")
    return list(messages)


def chat_prompt_ids(model: LanguageModel, messages: Sequence[dict]) -> list[int]:
    """Token ids (S,) of ``messages`` rendered with the chat template, ready for the reply.

    The template writes any BOS itself, so the tokenizer adds no special tokens (as HF does)."""
    text = model.tokenizer.apply_chat_template(check_messages(messages), add_generation_prompt=True)
    ids = list(model.tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ValueError("the chat template rendered an empty prompt")
    return ids


def chat_prompt(model: LanguageModel, messages: Sequence[dict]) -> tuple[list[int], Any]:
    """``chat_prompt_ids`` of messages that may hold images (parts {"type": "image", "image":
    <RGB PIL image>}): the prompt ids (S,) and where the images' rows go (``PromptImages``, None
    without images). A vision-language model's template gets every content as a list of parts.
    ValueError for images given to a model without a vision encoder."""
    messages = check_messages(messages)
    images = message_images(messages)
    vision = getattr(model, "vision", None)
    if vision is None and not images:
        return chat_prompt_ids(model, messages), None
    if vision is None:
        raise ValueError("this model has no vision encoder; it takes text only (send no images)")
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, parts=True)
    ids, placed = image_prompt(model, text, images, add_special_tokens=False)
    if not ids:
        raise ValueError("the chat template rendered an empty prompt")
    return ids, placed
