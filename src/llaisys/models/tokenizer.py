"""The tokenizer: a ``tokenizers.Tokenizer`` from a model folder's ``tokenizer.json`` or built
from a GGUF file's ``tokenizer.ggml.*`` metadata (``gguf_tokenizer``), plus special token ids and
chat template."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as _Backend

from . import gguf_tokenizer
from .errors import ModelLoadError, read_json_object
from .gguf_tokenizer import byte_alphabet
from .template_source import ChatTemplate

__all__ = ["Tokenizer", "byte_alphabet"]

_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone surrogate: a str that is not valid Unicode text


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    def __init__(self, backend: _Backend, *, bos_token: str | None = None, eos_tokens: Sequence[str] = (),
                 chat_template: str | None = None, extra_eos_ids: Sequence[int] = (), pad_token: str | None = None):
        self.backend = backend
        self.missing: str | None = None  # why there is no vocabulary, for a model folder without one
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.pad_token_id: int | None = backend.token_to_id(pad_token) if pad_token else None
        ids = [backend.token_to_id(t) for t in eos_tokens]
        self.eos_token_ids: list[int] = list(dict.fromkeys([i for i in ids if i is not None] + list(extra_eos_ids)))
        self.eos_token = backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
        self.chat_template = chat_template

    @classmethod
    def unavailable(cls, reason: str, vocab_size: int) -> "Tokenizer":
        """A stand-in for a model without a tokenizer: ids still work, text raises ``reason``."""
        tok = cls(_Backend(models.BPE()))
        tok.vocab_size, tok.missing = vocab_size, reason
        return tok

    def _require(self) -> None:
        if self.missing is not None:
            raise ValueError(self.missing)

    # ---- text <-> ids ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it are recognised. With
        ``add_special_tokens`` the tokenizer's own additions (a BOS, for some models) are made.

        Through the library's batch call: its single-text call holds the GIL for as long as it
        works (seconds for megabytes), stalling every other thread; the batch call gives the
        same ids and lets them run."""
        self._require()
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
        bad = _SURROGATE.search(text)
        if bad is not None:
            raise ValueError(f"encode: text has a lone surrogate U+{ord(bad.group()):04X} at character {bad.start()}; "
                             "expected valid Unicode text")
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: "Sequence[int] | np.ndarray", skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens left out when ``skip_special_tokens``."""
        self._require()
        ids = [_as_id(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"decode: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *, parts: bool = False,
                            **variables: Any) -> str:
        """The prompt text for ``messages`` (dicts with "role" and "content") rendered with the
        model's chat template; ``add_generation_prompt`` appends the assistant turn opener;
        ``parts``: contents go to the template as lists of text and image parts (a
        vision-language model's template)."""
        self._require()
        if not self.chat_template:
            raise ValueError("this model has no chat template; give a plain prompt instead of chat messages")
        from .chat_template import render_chat  # Jinja2 only for models that render chats

        variables.setdefault("bos_token", self.bos_token or "")
        variables.setdefault("eos_token", self.eos_token or "")
        return render_chat(self.chat_template, messages, add_generation_prompt, parts=parts, **variables)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids})"

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_folder(cls, folder: "str | os.PathLike[str]") -> "Tokenizer":
        """From a Hugging Face folder: ``tokenizer.json`` plus ``tokenizer_config.json`` (special
        tokens, chat template) and ``chat_template.jinja`` when present."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        try:
            backend = _Backend.from_file(os.fspath(path))
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: no such file; a model folder needs a tokenizer.json") from None
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
            raise ModelLoadError(f"{path}: not a readable tokenizer ({exc})") from exc
        cfg_path = folder / "tokenizer_config.json"
        cfg = read_json_object(cfg_path)
        _add_config_tokens(backend, cfg, cfg_path)
        template = _folder_chat_template(folder, cfg)
        eos = _token_content(cfg, "eos_token", cfg_path)
        return cls(backend, bos_token=_token_content(cfg, "bos_token", cfg_path), eos_tokens=[eos] if eos else [],
                   chat_template=template, pad_token=_token_content(cfg, "pad_token", cfg_path))

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], source: str) -> "Tokenizer":
        """From a GGUF file's ``tokenizer.ggml.*`` metadata and ``tokenizer.chat_template``
        (``source`` names the file in errors)."""
        built = gguf_tokenizer.build(meta, source)
        template = built.chat_template
        if template:
            template = ChatTemplate(template, f"{source} (GGUF metadata tokenizer.chat_template)")
        return cls(built.backend, bos_token=built.bos_token, eos_tokens=built.eos_tokens, chat_template=template,
                   pad_token=built.pad_token)

    @classmethod
    def from_gguf_file(cls, path: "str | os.PathLike[str]") -> "Tokenizer":
        """The tokenizer of the GGUF file ``path`` alone: its metadata is read, its tensors and
        architecture are not looked at (a file llaisys cannot run still gives its tokenizer)."""
        from .loaders.gguf import open_gguf

        source = os.fspath(path)
        return cls.from_gguf(open_gguf(source).meta, source)


def _as_id(value: Any) -> int:
    """``value`` as a token id; anything but an integer (a float, a bool, a string) is a TypeError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"decode: token ids must be integers, got {value!r} ({type(value).__name__})")
    return int(value)



def _token_content(cfg: Mapping[str, Any], key: str, path: Path) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    value = cfg.get(key)
    content = value.get("content") if isinstance(value, dict) else value
    if content is not None and not isinstance(content, str):
        raise ModelLoadError(f"{path}: {key} must be a string or an object with a string 'content', got {value!r}")
    return content


# tokenizer_config.json keys naming special tokens (transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order)
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ADDED_TOKEN_FLAGS = ("special", "lstrip", "rstrip", "normalized", "single_word")


def _added_token(value: Any, path: Path, key: str) -> AddedToken:
    """An ``AddedToken`` from a string (a special token) or an object ``{"content": ...,
    "special": ..., "lstrip": ..., ...}`` (``"__type": "AddedToken"`` allowed), as
    tokenizer_config.json writes them."""
    if isinstance(value, str):
        return AddedToken(value, special=True)
    fields = {k: v for k, v in value.items() if k != "__type"} if isinstance(value, dict) else {}
    if not isinstance(fields.get("content"), str):
        raise ModelLoadError(f"{path}: {key} must be a string or an object with a string 'content', got {value!r:.200}")
    for name, flag in fields.items():
        if name != "content" and (name not in ADDED_TOKEN_FLAGS or not isinstance(flag, bool)):
            raise ModelLoadError(f"{path}: {key} has {name}={flag!r}; expected only 'content' and the flags "
                                 f"{', '.join(ADDED_TOKEN_FLAGS)} (true or false)")
    return AddedToken(**fields)


def _add_config_tokens(backend: _Backend, cfg: Mapping[str, Any], path: Path) -> None:
    """Register the tokens tokenizer_config.json declares, as transformers does when it loads a
    folder: ``added_tokens_decoder`` entries (in id order, each with its own flags; the backend
    gives each its id, as in transformers), then the named special tokens (``eos_token`` ...)
    and ``extra_special_tokens``/``additional_special_tokens`` that are not added tokens yet, as
    special tokens. Without this a chat template's markers would be encoded as plain text."""
    declared = cfg.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        raise ModelLoadError(f"{path}: added_tokens_decoder must be an object of token id -> token, got {declared!r:.200}")
    entries = []
    for index, value in declared.items():
        if not (isinstance(index, str) and index.isascii() and index.isdigit()):
            raise ModelLoadError(f"{path}: added_tokens_decoder has key {index!r}; expected a token id (digits)")
        entries.append((int(index), _added_token(value, path, f"added_tokens_decoder[{index!r}]")))
    present = {repr(t) for t in backend.get_added_tokens_decoder().values()}
    tokens = [t for _, t in sorted(entries, key=lambda e: e[0]) if repr(t) not in present]
    named = []
    for key in NAMED_SPECIAL_TOKENS:
        if cfg.get(key) is not None:
            named.append(_added_token(cfg[key], path, key))
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
    extra = list(extra.values()) if isinstance(extra, dict) else extra
    if not isinstance(extra, list):
        raise ModelLoadError(f"{path}: extra_special_tokens must be a list of tokens, got {extra!r:.200}")
    extra = [_added_token(t, path, "extra_special_tokens") for t in extra]
    known = {t.content for t in backend.get_added_tokens_decoder().values()} | {t.content for t in tokens}
    for token in named + extra:
        if token.content not in known:
            token.special = True
            tokens.append(token)
            known.add(token.content)
    names = {t.content for t in named}
    for token in tokens:
        if token.content in names:
            token.special = True
    if tokens:
        backend.add_tokens(tokens)


def _read_text(path: Path) -> str:
    """The UTF-8 text of ``path``; ModelLoadError when it cannot be read or is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot be read as UTF-8 text ({exc})") from exc


def _folder_chat_template(folder: Path, cfg: Mapping[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return ChatTemplate(_read_text(jinja), str(jinja))
    source = folder / "tokenizer_config.json"
    template = cfg.get("chat_template")
    if not template:
        source = folder / "chat_template.json"
        template = read_json_object(source).get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in template):
            raise ModelLoadError(f"{source}: chat_template must be a string or a list of "
                                 f'{{"name": ..., "template": ...}} strings, got {template!r:.200}')
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{source}: chat_template must be a string, got {template!r:.200}")
    return ChatTemplate(template, str(source)) if template else None
