"""Constrained decoding: a grammar per request, enforced token by token with llguidance.

    compiler = GrammarCompiler(model.tokenizer, model.eos_token_ids, model.config.vocab_size)
    grammar = compiler.compile("json_schema", {"type": "object", ...})  # ValueError if bad
    config = GuidedConfig(max_new_tokens=64, grammar=grammar)
    engine.add_request(None, prompt, config)

A ``Grammar`` is compiled once (a large schema can take a while: a server compiles in a thread
of its own, after the grammar was tried in a separate process, ``grammar_sandbox``) and shared
by the requests that use it (``n`` choices); each engine request gets its own
``GrammarMatcher``, a copy of the compiled prototype. Each step the engine fills the token
masks of the constrained rows of the batch in one parallel llguidance call
(``MaskBatch.fill``), each request samples from its logits with the disallowed tokens at
``-inf`` and feeds the token it picked to its matcher. The matcher follows exactly the tokens
appended to the sequence, so preemption (recomputing the same tokens), the prefix cache and
stop strings need nothing more; a request ends when its grammar can take no more tokens. When
the library gives up on a grammar midway (a limit of its parser hit, no token allowed while the
output is incomplete) the matcher reports a ``failure`` and the request ends with an error,
never with text that breaks the grammar.

Before compiling, ``GrammarLimits`` (``grammar_limits``) bounds the sizes and the depth a grammar
may reach; the parser's own limits (``parser_limits``) bound the work of each step.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..generation import GenerationConfig
from .grammar_limits import GrammarLimits

log = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "lark")
# Compact JSON with the separators models write: flexible whitespace lets a small model loop
# on newlines forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MASK_THREADS = max(1, min(4, os.cpu_count() or 1))
MAX_VOCAB = 1 << 22  # tokens a mask may cover (the largest vocabularies have about 260k)
MESSAGE_CHARS = 1000  # of a library error shown to a client
_LONE_BACKSLASH = re.compile(r"(?<!\\)(?:\\\\)*\\$")
_PANIC = re.compile(r"panicked at|\bpanic:|stack backtrace|RUST_BACKTRACE", re.IGNORECASE)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a base dependency; only a broken install lacks it
        raise ValueError("constrained decoding needs the llguidance package (pip install llguidance)") from exc
    return llguidance


def parser_limits() -> Any:
    """llguidance's parser limits for every matcher: its defaults (the work of one step, the
    lexer states, the grammar's size), with errors that do not dump the grammar and the
    parser's state (which can be megabytes)."""
    return _llguidance().LLParserLimits(verbose_errors=False)


def clean_error(message: str, limit: int = MESSAGE_CHARS) -> str:
    """A library error fit to show a client: a panic of the Rust code (with its backtrace)
    becomes a plain sentence; anything else is cut to ``limit`` characters."""
    message = message.strip()
    if _PANIC.search(message):
        return "the grammar library failed on this grammar (an internal error)"
    return message if len(message) <= limit else message[:limit] + " ..."


def first_line(message: str) -> str:
    """The first line of a library error, cleaned and short (for a client, or the log)."""
    return clean_error(message.strip().split("\n", 1)[0], 200)


def grammar_digest(source: str) -> str:
    """A short name of a grammar for the log (the grammar itself can be megabytes)."""
    return hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def _choice_grammar(value: Any) -> str:
    if (not isinstance(value, list) or not value
            or not all(isinstance(s, str) and s for s in value)):
        raise ValueError("a choice must be a non-empty list of non-empty strings")
    # one terminal, so the lexer matches the strings: as alternatives of a rule, more than the
    # parser's row limit (2000) would make it give up after the first token
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(s) for s in value)


def grammar_source(kind: str, value: Any) -> str:
    """The llguidance grammar text of ``value`` given as ``kind``: "json_schema" (a schema as
    a dict or JSON text), "json_object" (any JSON object; ``value`` ignored), "regex" (a
    pattern the whole output must match), "choice" (a list of strings, one of which is the
    output), "grammar" (Lark, or llama.cpp's GBNF) or "lark" (Lark only). Raises ValueError for a
    value of the wrong type (sizes are ``GrammarLimits``' to check, before)."""
    llg = _llguidance()
    m = llg.LLMatcher
    if kind == "json_object":
        value = {"type": "object"}
        kind = "json_schema"
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except RecursionError:
                raise ValueError("the JSON schema is nested too deeply") from None
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(value).__name__}")
        try:
            return m.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the JSON schema cannot be read: {clean_error(str(exc))}") from None
    if kind == "regex":
        if not isinstance(value, str):
            raise ValueError(f"a regular expression must be a string, got {type(value).__name__}")
        if _LONE_BACKSLASH.search(value):
            raise ValueError("the regular expression ends with a lone backslash (write \\\\ for a backslash)")
        return m.grammar_from_regex(value)
    if kind == "choice":
        return m.grammar_from_lark(_choice_grammar(value))
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise ValueError("a grammar must be a non-empty string (Lark or GBNF)")
        try:
            return llg.grammar_from("grammar", value)
        except RecursionError:
            raise ValueError("the grammar nests too deeply to read") from None
    if kind == "lark":
        if not isinstance(value, str) or not value.strip():
            raise ValueError("a Lark grammar must be a non-empty string")
        return m.grammar_from_lark(value)
    raise ValueError(f"unknown grammar kind {kind!r}; expected one of {KINDS}")


def build_matcher(tokenizer: Any, source: str) -> Any:
    """llguidance's matcher of grammar ``source`` in its start state, its first mask computed
    (which builds the lexer states every copy shares, so no engine step pays for it). Raises
    ValueError with the library's message when the grammar does not compile, and when it
    allows no output at all (a regular expression that matches nothing, a schema that is a
    ``$ref`` to itself)."""
    llg = _llguidance()
    error = llg.LLMatcher.validate_grammar(source, tokenizer, limits=parser_limits())
    if error:
        raise ValueError(clean_error(error))
    matcher = llg.LLMatcher(tokenizer, source, log_level=0, limits=parser_limits())
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise ValueError(f"the grammar allows no output ({first_line(matcher.get_error())})")
    return matcher


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled grammar for one tokenizer: what it was made from, and the prototype
    matcher each request copies."""

    kind: str
    source: str  # llguidance's grammar text
    prototype: Any  # llguidance.LLMatcher in its start state, never advanced
    vocab_size: int  # tokens the masks cover
    digest: str = ""  # grammar_digest(source): how the log names it
    nbytes: int = 0  # memory it holds, as measured when it was tried (0: not measured)

    def matcher(self) -> "GrammarMatcher":
        """A fresh matcher of this grammar for one request."""
        return GrammarMatcher(self.prototype.deep_copy(), self.vocab_size, self.digest)


class GrammarMatcher:
    """One request's position in its grammar: the tokens it consumed so far."""

    __slots__ = ("matcher", "vocab_size", "consumed", "digest")

    def __init__(self, matcher: Any, vocab_size: int, digest: str = "") -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.consumed = 0
        self.digest = digest

    def consume(self, token_id: int) -> bool:
        """Advance by ``token_id``; False when the grammar does not allow it (the matcher is
        then in an error state)."""
        ok = bool(self.matcher.consume_token(int(token_id)))
        self.consumed += 1
        if not ok:
            log.warning("grammar %s refused token %d: %s", self.digest, token_id, self.failure)
        return ok

    @property
    def accepting(self) -> bool:
        """Whether the output so far is complete under the grammar (the request may end)."""
        return bool(self.matcher.is_accepting())

    @property
    def done(self) -> bool:
        """Whether the grammar takes no more tokens (complete, or in an error state)."""
        return bool(self.matcher.is_stopped())

    @property
    def failure(self) -> str | None:
        """Why the library gave up on this grammar (a limit of its parser, a token it refused),
        in one short line; None while it has not."""
        if not self.matcher.is_error():
            return None
        return first_line(self.matcher.get_error()) or "the grammar library gave up"


class GrammarCompiler:
    """Compiles grammars for one tokenizer. The llguidance view of the tokenizer is built on
    first use (about half a second for a 50k vocabulary) and kept. Thread-safe.

    ``vocab_size``: the tokens the masks cover (the model's embedding rows; default the
    tokenizer's vocabulary), from the tokenizer's own count up to MAX_VOCAB; ``eos_token_ids``
    ids below it (default the tokenizer's); ``limits`` bounds what ``compile`` takes.
    Raises ValueError (TypeError for a value of the wrong type) naming the bad argument."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int] = (), vocab_size: int | None = None,
                 limits: GrammarLimits | None = None) -> None:
        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise ValueError("constrained decoding needs the model's tokenizer (a Hugging Face tokenizers one)")
        self._backend = backend
        known = int(backend.get_vocab_size(with_added_tokens=True))
        vocab = tokenizer.vocab_size if vocab_size is None else vocab_size
        if not isinstance(vocab, int) or isinstance(vocab, bool):
            raise TypeError(f"GrammarCompiler: vocab_size must be an int, got {type(vocab).__name__} {vocab!r}")
        if not known <= vocab <= MAX_VOCAB:
            raise ValueError(f"GrammarCompiler: vocab_size must be in [{known}, {MAX_VOCAB}] (the tokenizer has "
                             f"{known} tokens), got {vocab}")
        eos = list(eos_token_ids) or list(getattr(tokenizer, "eos_token_ids", []))
        for t in eos:
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
                raise TypeError(f"GrammarCompiler: eos_token_ids must be ints, got {type(t).__name__} {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"GrammarCompiler: eos token id {t} is outside the vocabulary [0, {vocab})")
        if limits is not None and not isinstance(limits, GrammarLimits):
            raise TypeError(f"GrammarCompiler: limits must be a GrammarLimits, got {type(limits).__name__}")
        self.eos_token_ids = [int(t) for t in eos]
        self.vocab_size = vocab
        self.limits = limits or GrammarLimits()
        self._lltokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def tokenizer_json(self) -> str:
        """The tokenizer as Hugging Face's JSON (no padding or truncation): what llguidance reads."""
        backend = copy.copy(self._backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    @property
    def lltokenizer(self) -> Any:
        """llguidance's LLTokenizer over the model's tokenizer."""
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = new_lltokenizer(self.tokenizer_json, self.vocab_size, self.eos_token_ids)
            return self._lltokenizer

    def source(self, kind: str, value: Any) -> str:
        """The grammar text of ``value`` given as ``kind``, checked against ``limits`` first.
        Raises ValueError (``grammar_limits.GrammarTooLarge`` beyond a limit)."""
        self.limits.check(kind, value)
        return grammar_source(kind, value)

    def compile(self, kind: str, value: Any) -> Grammar:
        """A Grammar from ``value`` given as ``kind`` (see ``grammar_source``). Raises
        ValueError, with llguidance's message, for a value it cannot compile (a bad schema,
        regular expression or grammar), and GrammarTooLarge beyond ``limits``."""
        return self.compile_source(kind, self.source(kind, value))

    def compile_source(self, kind: str, source: str, nbytes: int = 0) -> Grammar:
        """A Grammar from llguidance grammar text (``source``); ``nbytes`` what it was measured
        to hold. Raises ValueError when it does not compile or allows no output."""
        tok = self.lltokenizer
        prototype = build_matcher(tok, source)
        return Grammar(kind, source, prototype, tok.vocab_size, grammar_digest(source), nbytes)


def new_lltokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's LLTokenizer of a Hugging Face tokenizer's JSON, its masks ``vocab_size``
    tokens wide. Raises ValueError with llguidance's message."""
    llg = _llguidance()
    try:
        return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"llguidance cannot use this tokenizer: {exc}") from None


@dataclass(slots=True)
class GuidedConfig(GenerationConfig):
    """A GenerationConfig whose output must follow ``grammar`` (None: unconstrained)."""

    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        GenerationConfig.__post_init__(self)  # slotted dataclasses cannot use super() without arguments
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise TypeError("GuidedConfig.grammar must be a Grammar (from GrammarCompiler.compile) or None, got "
                            f"{type(self.grammar).__name__}")

    @classmethod
    def of(cls, config: GenerationConfig, grammar: Grammar | None) -> GenerationConfig:
        """``config`` with ``grammar`` (``config`` itself when None)."""
        if grammar is None:
            return config
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(GenerationConfig)}
        return cls(**values, grammar=grammar)


def grammar_of(config: GenerationConfig) -> Grammar | None:
    """The grammar a config carries, if any."""
    return getattr(config, "grammar", None)


class MaskBatch:
    """Fills the token masks of a step's constrained requests together (llguidance's thread
    pool, the GIL released) and turns each into a boolean row over the logits."""

    def __init__(self, threads: int = MASK_THREADS) -> None:
        self.threads = threads
        self._executor: Any = None
        self._buffer = np.zeros((0, 0), dtype=np.int32)

    def fill(self, matchers: Sequence[GrammarMatcher]) -> np.ndarray:
        """The bitmasks (C, ceil(V / 32)) int32 of ``matchers``: bit t of row i set when
        matcher i allows token t next. The rows are a view of a buffer reused by the next call."""
        llg = _llguidance()
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = llg.LLExecutor(self.threads)
        words = (max(m.vocab_size for m in matchers) + 31) // 32
        if self._buffer.shape[0] < len(matchers) or self._buffer.shape[1] != words:
            self._buffer = np.zeros((max(len(matchers), 2 * self._buffer.shape[0]), words), dtype=np.int32)
        masks = self._buffer[:len(matchers)]  # (C, W) contiguous rows
        fill_next_token_bitmask_par(self._executor, [(m.matcher, i) for i, m in enumerate(matchers)], masks)
        return masks

    @staticmethod
    def allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
        """The boolean row (vocab,) of one bitmask (W,) int32; logits past the mask's tokens
        (padding rows of a larger embedding) are not allowed."""
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")  # (32 W,)
        if bits.shape[0] < vocab:
            bits = np.concatenate([bits, np.zeros(vocab - bits.shape[0], dtype=np.uint8)])
        return bits[:vocab].view(bool)
