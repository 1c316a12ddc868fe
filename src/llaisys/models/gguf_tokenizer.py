"""A ``tokenizers.Tokenizer`` built from a GGUF file's ``tokenizer.ggml.*`` metadata, as
transformers builds one from the same file (``transformers.integrations.gguf``).

Two kinds of vocabulary: ``"gpt2"`` (byte-level BPE over the file's merges, split first as
``tokenizer.ggml.pre`` says) and ``"llama"`` (SentencePiece BPE: ``▁`` for spaces, ``<0xNN>``
byte fallback, merges from the file or derived from the vocabulary). Some families store their
SentencePiece vocabulary their own way (``SENTENCEPIECE_STYLES``, keyed by
``general.architecture``).
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from .config import is_int, typed_value
from .errors import ModelLoadError

log = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TEXT = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # how a BYTE token is written: <0x0A>

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


@dataclass(frozen=True)
class SentencePieceStyle:
    """How one family writes its SentencePiece vocabulary into GGUF files."""

    blanks_as_spaces: bool = False  # a token of blanks ("▁▁") is stored as spaces ("  ")
    merges_by_position: bool = False  # derived merges rank by token order, not score; every token may be one


GEMMA = SentencePieceStyle(blanks_as_spaces=True, merges_by_position=True)
# general.architecture -> its style (others: the plain one, merges ranked by score)
SENTENCEPIECE_STYLES: dict[str, SentencePieceStyle] = {"gemma": GEMMA, "gemma2": GEMMA, "gemma3": GEMMA}


@dataclass
class GGUFTokenizer:
    """What a GGUF file's tokenizer metadata builds: the backend and the special tokens, named
    as the backend spells them."""

    backend: _Backend
    bos_token: str | None
    eos_tokens: list[str]  # eos, eot, eom: the ones the file names, in that order
    pad_token: str | None
    chat_template: str | None  # tokenizer.chat_template as written


def build(meta: Mapping[str, Any], source: str) -> GGUFTokenizer:
    """The tokenizer ``meta`` (a GGUF file's metadata) describes; ``source`` names the file in
    errors. Unsupported or malformed tokenizer metadata is a ModelLoadError naming its key."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = _array(meta, "tokenizer.ggml.tokens", source, "strings", _is_str)
    if not tokens:
        raise ModelLoadError(f"{source}: no tokenizer.ggml.tokens; the file carries no tokenizer")
    types = _array(meta, "tokenizer.ggml.token_type", source, "integers", is_int) or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    _check_byte_tokens(tokens, types, source)
    spelled = tokens  # the vocabulary as the backend spells it
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens, source)
    elif kind == "llama":
        style = SENTENCEPIECE_STYLES.get(meta.get("general.architecture"), SentencePieceStyle())
        if style.blanks_as_spaces:
            spelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        backend = _sentencepiece_bpe(meta, spelled, types, source, style)
    else:
        raise ModelLoadError(f"{source}: tokenizer.ggml.model {kind!r} is not supported; expected 'gpt2' or 'llama'")
    # the file's own spelling: a token of spaces is then no longer in the vocabulary and is not
    # added, so runs of spaces go through the merges as transformers has it
    _add_special_tokens(backend, tokens, types, byte_level=kind == "gpt2")

    def token(key: str) -> str | None:
        i = _token_id(meta, f"tokenizer.ggml.{key}", source, len(tokens))
        return None if i is None else spelled[i]

    bos = token("bos_token_id")
    add_bos = _flag(meta, "tokenizer.ggml.add_bos_token", kind == "llama", source)
    add_eos = _flag(meta, "tokenizer.ggml.add_eos_token", False, source)
    eos_tokens = [t for t in (token("eos_token_id"), token("eot_token_id"), token("eom_token_id")) if t]
    eos = eos_tokens[0] if add_eos and eos_tokens else None
    _set_post_processor(backend, bos if add_bos else None, eos, source)
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{source}: tokenizer.chat_template must be a string, got {_kind(template)}")
    return GGUFTokenizer(backend, bos, eos_tokens, token("padding_token_id"), template or None)


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


def _check_byte_tokens(tokens: Sequence[str], types: Sequence[int], source: str) -> None:
    """A BYTE token must be written ``<0xHH>``. llama.cpp reads the byte from its 4th and 5th
    characters unchecked (``<0xZZ>`` gives 0, ``<0x100>`` 0x10) while transformers takes any
    other text as an ordinary token: a file holding one is refused, naming it."""
    for i in (i for i, kind in enumerate(types) if kind == BYTE):
        if _BYTE_TEXT.fullmatch(tokens[i]) is None:
            raise ModelLoadError(f"{source}: tokenizer.ggml.tokens[{i}] is {tokens[i]!r:.40}, typed BYTE ({BYTE}) in "
                                 "tokenizer.ggml.token_type; a byte token is written <0xHH> (two hex digits, as "
                                 "<0x0A>)")


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
    return typed_value(meta, key, default, source, bool, "a boolean", _kind)


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


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int], source: str,
                       style: SentencePieceStyle) -> _Backend:
    """SentencePiece-style BPE ("▁" for spaces, byte tokens <0xNN> as fallback)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(meta, source)
    if not merges and style.merges_by_position:
        merges = _merges_by_position(tokens)
    elif not merges:
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


def _merges_by_position(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """Merges a vocabulary implies when its order is its merge order (Gemma): every split of a
    token of any type into two tokens, earlier tokens first, a longer left part first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    lengths = sorted({len(t) for t in vocab} - {0})  # the only cuts that can give two tokens
    found: list[tuple[int, int, str, str]] = []
    for token, index in vocab.items():
        for cut in lengths:
            if cut >= len(token):
                break
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((index, -cut, left, right))
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
