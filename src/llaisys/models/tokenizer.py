"""The tokenizer: a ``tokenizers.Tokenizer`` from a model folder's ``tokenizer.json`` or built
from a GGUF file's ``tokenizer.ggml.*`` metadata, plus special token ids and chat template."""
from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from .config import is_int
from .errors import ModelLoadError, read_json_object
from .template_source import ChatTemplate

log = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS = "digits"  # each digit alone, then the GPT-2 split (llama.cpp: "\p{N}" before the GPT-2 regex)
_GPT2 = "gpt2"  # the GPT-2 split built into ByteLevel

# tokenizer.ggml.pre -> how text is split before byte-level BPE (names as llama.cpp writes them)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2,
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), _DIGITS),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.lru_cache(maxsize=1)
def _outside_byte_alphabet() -> re.Pattern:
    """A pattern matching any character that is not in ``byte_alphabet``."""
    return re.compile("[^" + "".join(re.escape(c) for c in sorted(byte_alphabet().values())) + "]")


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
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: "Sequence[int] | np.ndarray", skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens left out when ``skip_special_tokens``."""
        self._require()
        ids = [_as_id(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"decode: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text for ``messages`` (dicts with "role" and "content") rendered with the
        model's chat template; ``add_generation_prompt`` appends the assistant turn opener."""
        self._require()
        if not self.chat_template:
            raise ValueError("this model has no chat template; give a plain prompt instead of chat messages")
        from .chat_template import render_chat  # Jinja2 only for models that render chats

        variables.setdefault("bos_token", self.bos_token or "")
        variables.setdefault("eos_token", self.eos_token or "")
        return render_chat(self.chat_template, messages, add_generation_prompt, **variables)

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
        """From a GGUF file's ``tokenizer.ggml.*`` metadata and ``tokenizer.chat_template``."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = _array(meta, "tokenizer.ggml.tokens", source, "strings", _is_str)
        if not tokens:
            raise ModelLoadError(f"{source}: no tokenizer.ggml.tokens; the file carries no tokenizer")
        types = _array(meta, "tokenizer.ggml.token_type", source, "integers", is_int) or [NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ModelLoadError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        if kind == "gpt2":
            backend = _byte_level_bpe(meta, tokens, source)
        elif kind == "llama":
            backend = _sentencepiece_bpe(meta, tokens, types, source)
        else:
            raise ModelLoadError(f"{source}: tokenizer.ggml.model {kind!r} is not supported; expected 'gpt2' or 'llama'")
        _add_special_tokens(backend, tokens, types, byte_level=kind == "gpt2")

        def token(key: str) -> str | None:
            i = _token_id(meta, f"tokenizer.ggml.{key}", source, len(tokens))
            return None if i is None else tokens[i]

        bos = token("bos_token_id")
        add_bos = _flag(meta, "tokenizer.ggml.add_bos_token", kind == "llama", source)
        add_eos = _flag(meta, "tokenizer.ggml.add_eos_token", False, source)
        eos_tokens = [t for t in (token("eos_token_id"), token("eot_token_id"), token("eom_token_id")) if t]
        eos = eos_tokens[0] if add_eos and eos_tokens else None
        _set_post_processor(backend, bos if add_bos else None, eos, source)
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ModelLoadError(f"{source}: tokenizer.chat_template must be a string, got {_kind(template)}")
        if template:
            template = ChatTemplate(template, f"{source} (GGUF metadata tokenizer.chat_template)")
        return cls(backend, bos_token=bos, eos_tokens=eos_tokens, chat_template=template,
                   pad_token=token("padding_token_id"))


def _as_id(value: Any) -> int:
    """``value`` as a token id; anything but an integer (a float, a bool, a string) is a TypeError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"decode: token ids must be integers, got {value!r} ({type(value).__name__})")
    return int(value)


# ---- typed access to GGUF metadata: a value of the wrong type is a ModelLoadError naming its key ----
def _kind(value: Any) -> str:
    """How a metadata value of the wrong type is described in messages."""
    if isinstance(value, list):
        return "an empty array" if not value else f"an array holding {value[0]!r} ({type(value[0]).__name__})"
    return f"{value!r} ({type(value).__name__})"


def _array(meta: Mapping[str, Any], key: str, source: str, what: str, ok: Callable[[Any], bool]) -> list | None:
    """``meta[key]`` as an array of ``what``, every item passing ``ok`` (a test of the item's
    type); None when absent."""
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise ModelLoadError(f"{source}: {key} must be an array of {what}; found {_kind(value)}")
    # ``ok`` looks at types only, so one item of each type tells (the vocabulary has ~50k items)
    bad_types = {t for t in set(map(type, value)) if not ok(next(v for v in value if type(v) is t))}
    if bad_types:
        raise ModelLoadError(f"{source}: {key} must be an array of {what}; found "
                             f"{_kind(next(v for v in value if type(v) in bad_types))}")
    return value


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _token_id(meta: Mapping[str, Any], key: str, source: str, n_tokens: int) -> int | None:
    """``meta[key]`` as an id among ``n_tokens`` tokens; None when absent."""
    value = meta.get(key)
    if value is None:
        return None
    if not is_int(value):
        raise ModelLoadError(f"{source}: {key} must be a token id (an integer), got {_kind(value)}")
    if not 0 <= value < n_tokens:
        raise ModelLoadError(f"{source}: {key}={value} is outside the {n_tokens} tokens")
    return value


def _flag(meta: Mapping[str, Any], key: str, default: bool, source: str) -> bool:
    """``meta[key]`` as a boolean; ``default`` when absent."""
    value = meta.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: {key} must be a boolean, got {_kind(value)}")
    return value


def _text(meta: Mapping[str, Any], key: str, default: str, source: str) -> str:
    """``meta[key]`` as a string; ``default`` when absent."""
    value = meta.get(key, default)
    if not isinstance(value, str):
        raise ModelLoadError(f"{source}: {key} must be a string, got {_kind(value)}")
    return value


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], source: str, **options: Any) -> _Backend:
    """A BPE tokenizer; merges the library refuses (a part that is not a token) are a ModelLoadError."""
    try:
        return _Backend(models.BPE(vocab, merges, **options))
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise ModelLoadError(f"{source}: tokenizer.ggml.merges does not fit tokenizer.ggml.tokens ({exc})") from exc


def _merges(meta: Mapping[str, Any], source: str) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as pairs ("a b" -> ("a", "b"))."""
    merges = [tuple(m.split(" ", 1)) for m in _array(meta, "tokenizer.ggml.merges", source, "strings", _is_str) or ()]
    if not set(map(len, merges)) <= {2}:
        raise ModelLoadError(f"{source}: tokenizer.ggml.merges holds an entry without a space between its two parts")
    return merges  # type: ignore[return-value]


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


def _byte_level_bpe(meta: Mapping[str, Any], tokens: Sequence[str], source: str) -> _Backend:
    """BPE over GPT-2 byte characters, split first as ``tokenizer.ggml.pre`` says."""
    spell = byte_alphabet()
    alphabet = set(spell.values())
    # Files spell tokens in the byte alphabet; a token using other characters is respelled from its UTF-8 bytes.
    if not _outside_byte_alphabet().search("".join(tokens)):  # the usual case, checked for all tokens at once
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
    backend = _bpe(vocab, _merges(meta, source), source, fuse_unk=False, byte_fallback=False)
    pre = _text(meta, "tokenizer.ggml.pre", "default", source)
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        log.warning("%s: unknown tokenizer.ggml.pre %r; splitting text as GPT-2 does", source, pre)
        split = _GPT2
    if split == _GPT2:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _DIGITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int], source: str) -> _Backend:
    """SentencePiece-style BPE ("▁" for spaces, byte tokens <0xNN> as fallback)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(meta, source)
    if not merges:
        scores = _array(meta, "tokenizer.ggml.scores", source, "numbers", _is_number)
        if not scores or len(scores) != len(tokens):
            raise ModelLoadError(f"{source}: a 'llama' tokenizer needs tokenizer.ggml.merges or one score per token")
        merges = _merges_from_scores(tokens, scores, types)
    unk_id = _token_id(meta, "tokenizer.ggml.unknown_token_id", source, len(tokens))
    unk = tokens[unk_id] if unk_id is not None else None
    backend = _bpe(vocab, merges, source, unk_token=unk, fuse_unk=True, byte_fallback=True)
    prepend = "first" if _flag(meta, "tokenizer.ggml.add_space_prefix", True, source) else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if prepend == "first" else []),
    ])
    return backend


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Merges a SentencePiece vocabulary implies: every split of a normal token into two
    tokens, best-scored merged token first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    # Only cuts into two lengths some token has can give two tokens; trying just those keeps a
    # corrupt megabyte-long token from costing a cut (and two copies) per character.
    lengths = sorted({len(t) for t in vocab} - {0})
    found: list[tuple[float, int, int, str, str]] = []
    for token, score, kind in zip(tokens, scores, types):
        if kind != NORMAL:
            continue
        for cut in lengths:
            if cut >= len(token):
                break
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _add_special_tokens(backend: _Backend, tokens: Sequence[str], types: Sequence[int], byte_level: bool) -> None:
    """Control tokens (``<|im_end|>``) become special added tokens, user-defined ones plain added
    tokens, so text containing them keeps them whole."""
    alphabet = set(byte_alphabet().values()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               # a control token outside the byte alphabet is a converter mislabel; it is not a real token
               if k == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if not byte_level:
        control += [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == UNKNOWN]
    if control:
        backend.add_special_tokens(control)
    if USER_DEFINED not in types:
        return
    vocab = backend.get_vocab(with_added_tokens=False)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)


def _set_post_processor(backend: _Backend, bos: str | None, eos: str | None, source: str) -> None:
    if bos is None and eos is None:
        return
    # templates as lists of pieces, so a token holding a space stays one piece
    single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
    pair = single + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else [])
    special = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    try:
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise ModelLoadError(
            f"{source}: the BOS/EOS tokens {bos!r}/{eos!r} cannot be added to encoded text ({exc})"
        ) from exc
