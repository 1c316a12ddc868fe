"""Chat: render messages with the model's chat template, then generate the assistant's reply."""
from __future__ import annotations

from collections.abc import Sequence

from .config import GenerationConfig
from .loop import GenerationStream, PrefillProgress
from .prompt_cache import PromptCache
from .protocol import LanguageModel
from .results import GenerationResult

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


def stream_chat(model: LanguageModel, messages: Sequence[dict], config: GenerationConfig | None = None, *,
                prompt_cache: PromptCache | None = None,
                prefill_progress: PrefillProgress | None = None) -> GenerationStream:
    """Stream the assistant's reply to ``messages``; see ``stream``. With a ``prompt_cache``
    kept across turns, each turn runs only what the previous one did not."""
    return GenerationStream(model, chat_prompt_ids(model, messages), config or GenerationConfig(), prompt_cache,
                            prefill_progress)


def chat(model: LanguageModel, messages: Sequence[dict], config: GenerationConfig | None = None, *,
         prompt_cache: PromptCache | None = None, prefill_progress: PrefillProgress | None = None) -> GenerationResult:
    """The assistant's reply to ``messages`` as a GenerationResult."""
    return stream_chat(model, messages, config, prompt_cache=prompt_cache, prefill_progress=prefill_progress).result()
