"""Constrained decoding: a grammar per request, enforced token by token with llguidance.

    compiler = GrammarCompiler(model.tokenizer, model.eos_token_ids)
    grammar = compiler.compile("json_schema", {"type": "object", ...})  # ValueError if bad
    config = GuidedConfig(max_new_tokens=64, grammar=grammar)
    engine.add_request(None, prompt, config)

A ``Grammar`` is compiled once (in the caller's thread: a large schema can take a while) and
shared by the requests that use it (``n`` choices); each engine request gets its own
``GrammarMatcher``, a copy of the compiled prototype. Each step the engine fills the token
masks of the constrained rows of the batch in one parallel llguidance call
(``MaskBatch.fill``), each request samples from its logits with the disallowed tokens at
``-inf`` and feeds the token it picked to its matcher. The matcher follows exactly the tokens
appended to the sequence, so preemption (recomputing the same tokens), the prefix cache and
stop strings need nothing more; a request ends when its grammar can take no more tokens.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..generation import GenerationConfig

log = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "lark")
# Compact JSON with the separators models write: flexible whitespace lets a small model loop
# on newlines forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MASK_THREADS = max(1, min(4, os.cpu_count() or 1))


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a base dependency; only a broken install lacks it
        raise ValueError("constrained decoding needs the llguidance package (pip install llguidance)") from exc
    return llguidance


def grammar_source(kind: str, value: Any) -> str:
    """The llguidance grammar text of ``value`` given as ``kind``: "json_schema" (a schema as
    a dict or JSON text), "json_object" (any JSON object; ``value`` ignored), "regex" (a
    pattern the whole output must match), "choice" (a list of strings, one of which is the
    output), "grammar" (Lark, or llama.cpp's GBNF) or "lark" (Lark only). Raises ValueError for a value of the
    wrong type."""
    llg = _llguidance()
    m = llg.LLMatcher
    if kind == "json_object":
        value = {"type": "object"}
        kind = "json_schema"
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(value).__name__}")
        return m.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "regex":
        if not isinstance(value, str):
            raise ValueError(f"a regular expression must be a string, got {type(value).__name__}")
        return m.grammar_from_regex(value)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(s, str) and s for s in value)):
            raise ValueError("a choice must be a non-empty list of non-empty strings")
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in value))
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise ValueError("a grammar must be a non-empty string (Lark or GBNF)")
        return llg.grammar_from("grammar", value)
    if kind == "lark":
        if not isinstance(value, str) or not value.strip():
            raise ValueError("a Lark grammar must be a non-empty string")
        return m.grammar_from_lark(value)
    raise ValueError(f"unknown grammar kind {kind!r}; expected one of {KINDS}")


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled grammar for one tokenizer: what it was made from, and the prototype
    matcher each request copies."""

    kind: str
    source: str  # llguidance's grammar text
    prototype: Any  # llguidance.LLMatcher in its start state, never advanced
    vocab_size: int  # tokens the masks cover

    def matcher(self) -> "GrammarMatcher":
        """A fresh matcher of this grammar for one request."""
        return GrammarMatcher(self.prototype.deep_copy(), self.vocab_size)


class GrammarMatcher:
    """One request's position in its grammar: the tokens it consumed so far."""

    __slots__ = ("matcher", "vocab_size", "consumed")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.consumed = 0

    def consume(self, token_id: int) -> bool:
        """Advance by ``token_id``; False when the grammar does not allow it (the matcher is
        then in an error state)."""
        ok = bool(self.matcher.consume_token(int(token_id)))
        self.consumed += 1
        if not ok:
            log.warning("the grammar refused token %d: %s", token_id, self.matcher.get_error())
        return ok

    @property
    def accepting(self) -> bool:
        """Whether the output so far is complete under the grammar (the request may end)."""
        return bool(self.matcher.is_accepting())

    @property
    def done(self) -> bool:
        """Whether the grammar takes no more tokens (complete, or in an error state)."""
        return bool(self.matcher.is_stopped())


class GrammarCompiler:
    """Compiles grammars for one tokenizer. The llguidance view of the tokenizer is built on
    first use (about half a second for a 50k vocabulary) and kept. Thread-safe."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int] = (), vocab_size: int | None = None) -> None:
        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise ValueError("constrained decoding needs the model's tokenizer (a Hugging Face tokenizers one)")
        self._backend = backend
        self.eos_token_ids = [int(t) for t in eos_token_ids] or list(getattr(tokenizer, "eos_token_ids", []))
        self.vocab_size = int(vocab_size or tokenizer.vocab_size)
        self._lltokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def lltokenizer(self) -> Any:
        """llguidance's LLTokenizer over the model's tokenizer."""
        with self._lock:
            if self._lltokenizer is None:
                llg = _llguidance()
                backend = copy.copy(self._backend)
                backend.no_padding()
                backend.no_truncation()
                self._lltokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                    eos_token=self.eos_token_ids or None)
            return self._lltokenizer

    def compile(self, kind: str, value: Any) -> Grammar:
        """A Grammar from ``value`` given as ``kind`` (see ``grammar_source``). Raises
        ValueError, with llguidance's message, for a value it cannot compile (a bad schema,
        regular expression or grammar)."""
        llg = _llguidance()
        source = grammar_source(kind, value)
        tok = self.lltokenizer
        error = llg.LLMatcher.validate_grammar(source, tok)
        if error:
            raise ValueError(error.strip())
        prototype = llg.LLMatcher(tok, source, log_level=0)
        if prototype.is_error():
            raise ValueError(prototype.get_error().strip())
        return Grammar(kind, source, prototype, tok.vocab_size)


@dataclass(slots=True)
class GuidedConfig(GenerationConfig):
    """A GenerationConfig whose output must follow ``grammar`` (None: unconstrained)."""

    grammar: Grammar | None = None


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
