"""A chat template's source text with where it came from; rendering is ``chat_template``'s job
(kept apart so loading a model does not import Jinja2)."""
from __future__ import annotations


class ChatTemplate(str):
    """Template source text that remembers where it came from, for error messages: a file
    path, or "GGUF metadata tokenizer.chat_template"."""

    origin: str

    def __new__(cls, source: str, origin: str) -> "ChatTemplate":
        self = super().__new__(cls, source)
        self.origin = origin
        return self


def template_origin(source: str) -> str:
    """How error messages name the template ``source``: with its origin when it has one."""
    origin = getattr(source, "origin", None)
    return f"chat template from {origin}" if origin else "chat template"
