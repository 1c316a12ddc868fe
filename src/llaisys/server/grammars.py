"""The server's grammars (structured outputs, forced tool calls): checked, tried in a separate
process, compiled off the event loop, and kept for reuse within a memory budget.

    pending = service.grammars.prepare(spec)          # worker thread: limits, grammar text; 400 naming spec.param
    grammar = await service.grammars.compile(pending)  # event loop: cached, or tried and compiled

A grammar goes through three gates, each a 400 naming the request's field:

1. ``GrammarLimits`` (``--max-grammar-bytes``, ``--max-grammar-choices``, ``--max-grammar-depth``),
   checked in ``prepare`` with the prompt, before anything compiles it;
2. the sandbox (``engine.grammar_sandbox``): a child process compiles it as the server would,
   within ``--grammar-timeout`` seconds, and says how much memory it took. A crash, an abort
   or a timeout there kills only the child (a new one serves the next grammar); a client that
   goes away, or a shutdown, kills it too;
3. the memory it took, against ``--grammar-cache-bytes``.

Only then is it compiled here, in one of a few threads with a stack four times the child's (so
what compiled there compiles here), none of them the threads that render and tokenize prompts,
so plain requests flow meanwhile. Compiled grammars are kept by their text, least recently
used dropped first, while their measured memory fits ``--grammar-cache-bytes``; requests that
ask for a grammar being compiled wait for that one compile.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..engine.grammar import Grammar, GrammarCompiler, clean_error, grammar_digest
from ..engine.grammar_limits import GrammarLimits, GrammarTooLarge
from ..engine.grammar_sandbox import (CALLER_STACK, GrammarCancelled, GrammarCrashed, GrammarSandbox, GrammarTimeout,
                                      SandboxClosed)
from .errors import APIError, bad_request, shutting_down
from .options import ServerOptions

log = logging.getLogger(__name__)

COMPILE_THREADS = 4  # grammars tried and compiled at once (the sandbox takes one at a time)
SANDBOX_SLACK = 256 << 20  # the child's heap cap above the cache's budget: its own buffers
FLAGS = {"max_bytes": "--max-grammar-bytes", "max_choices": "--max-grammar-choices",
         "max_depth": "--max-grammar-depth"}


@dataclass(frozen=True, slots=True)
class PendingGrammar:
    """A grammar checked against the limits, not yet compiled: its kind, llguidance's text of
    it, and the request field it came from."""

    kind: str
    source: str
    param: str


class GrammarCache:
    """Compiled grammars by their text, least recently used first, holding at most
    ``max_bytes`` of measured memory. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, source: str) -> Grammar | None:
        """The grammar compiled from ``source``, if kept (it becomes the most recently used)."""
        with self._lock:
            grammar = self._items.get(source)
            if grammar is not None:
                self._items.move_to_end(source)
            return grammar

    def put(self, grammar: Grammar) -> None:
        """Keep ``grammar``, dropping the least recently used ones until all fit."""
        with self._lock:
            old = self._items.pop(grammar.source, None)
            if old is not None:
                self.nbytes -= _cost(old)
            self._items[grammar.source] = grammar
            self.nbytes += _cost(grammar)
            while self.nbytes > self.max_bytes and self._items:
                _, dropped = self._items.popitem(last=False)
                self.nbytes -= _cost(dropped)


def _cost(grammar: Grammar) -> int:
    return max(grammar.nbytes, len(grammar.source))


class CompileThreads:
    """A few daemon threads with a large stack running compile jobs (daemons: a compile going
    on does not hold up the process's exit)."""

    def __init__(self, count: int, stack_bytes: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._count, self._stack = count, stack_bytes
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` in one of the threads; its future."""
        with self._lock:
            if not self._started:
                self._start()
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _start(self) -> None:
        previous = threading.stack_size(self._stack)  # the size threads created from now on get
        try:
            for i in range(self._count):
                threading.Thread(target=self._run, name=f"llaisys-grammar-{i}", daemon=True).start()
        finally:
            threading.stack_size(previous)
        self._started = True

    def stop(self) -> None:
        """End the threads once the jobs queued before are done."""
        with self._lock:
            if self._started:
                for _ in range(self._count):
                    self._jobs.put(None)
                self._started = False

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001  (handed to the waiter)
                future.set_exception(exc)


@dataclass(slots=True)
class _Compile:
    """One grammar being compiled, and the requests waiting for it."""

    cancel: threading.Event = field(default_factory=threading.Event)
    future: asyncio.Future | None = None
    waiters: int = 0


class GrammarService:
    """The grammars of one served model (``model()`` returns it once loaded)."""

    def __init__(self, options: ServerOptions, model: Callable[[], Any]) -> None:
        self.limits = GrammarLimits(options.max_grammar_bytes, options.max_grammar_choices, options.max_grammar_depth)
        self.timeout_s = options.grammar_timeout_s
        self.cache = GrammarCache(options.grammar_cache_bytes)
        self._model = model
        self._compiler: GrammarCompiler | None = None
        self._sandbox: GrammarSandbox | None = None
        self._threads = CompileThreads(COMPILE_THREADS, CALLER_STACK)
        self._compiling: dict[str, _Compile] = {}
        self._lock = threading.Lock()
        self._closed = False

    def compiler(self, param: str) -> GrammarCompiler:
        """The model's grammar compiler (made on first use); 400 naming ``param`` for a model
        whose tokenizer llguidance cannot read."""
        with self._lock:
            if self._compiler is None:
                model = self._model()
                try:
                    self._compiler = GrammarCompiler(model.tokenizer, model.eos_token_ids,
                                                     int(model.config.vocab_size), self.limits)
                except (TypeError, ValueError) as exc:
                    raise bad_request(f"{param}: {exc}", param=param) from exc
            return self._compiler

    def sandbox(self) -> GrammarSandbox:
        """The sandbox process's handle (the process starts with the first grammar)."""
        with self._lock:
            if self._sandbox is None:
                compiler = self._compiler
                assert compiler is not None, "prepare() makes the compiler first"
                self._sandbox = GrammarSandbox(compiler.tokenizer_json, compiler.vocab_size, compiler.eos_token_ids,
                                               memory_bytes=self.cache.max_bytes + SANDBOX_SLACK)
                if self._closed:
                    self._sandbox.close()
            return self._sandbox

    @property
    def compiling(self) -> bool:
        """Whether a grammar is being compiled for a request now."""
        return bool(self._compiling)

    # ---- a request's grammar ---------------------------------------------------------------
    def prepare(self, kind: str, value: Any, param: str) -> PendingGrammar:
        """``value`` given as ``kind`` checked against the limits and turned into grammar text
        (worker thread); 400 naming ``param`` when it is too large or of the wrong shape."""
        compiler = self.compiler(param)
        try:
            source = compiler.source(kind, value)
        except GrammarTooLarge as exc:
            raise bad_request(f"{param}: {exc} ({FLAGS[exc.limit]})", param=param, code="grammar_too_large") from None
        except (TypeError, ValueError) as exc:
            raise bad_request(f"{param}: {clean_error(str(exc))}", param=param, code="invalid_grammar") from None
        return PendingGrammar(kind, source, param)

    async def compile(self, pending: PendingGrammar) -> Grammar:
        """The compiled grammar of ``pending``: kept from before, or tried in the sandbox and
        compiled in a compile thread (event loop). 400 naming ``pending.param`` when it does not
        compile, takes too long, makes the library fail or needs too much memory; 503 once the
        server is shutting down. Cancelling the wait (the client left) stops the compile when
        no other request waits for it."""
        if self._closed:
            raise shutting_down()
        grammar = self.cache.get(pending.source)
        if grammar is not None:
            return grammar
        job = self._compiling.get(pending.source)
        if job is None or job.cancel.is_set():
            job = self._compiling[pending.source] = _Compile()
            job.future = asyncio.wrap_future(self._threads.submit(self._build, pending, job.cancel))
            job.future.add_done_callback(lambda f, key=pending.source, j=job: self._finished(key, j, f))
        job.waiters += 1
        try:
            return await asyncio.shield(job.future)
        except (GrammarCancelled, SandboxClosed):
            raise shutting_down() from None
        except GrammarTimeout:
            raise bad_request(f"{pending.param}: the grammar took longer than {self.timeout_s:g} s to compile "
                              "(--grammar-timeout); simplify it", param=pending.param, code="grammar_timeout") from None
        except GrammarTooLarge as exc:
            raise bad_request(f"{pending.param}: {exc}", param=pending.param, code="grammar_too_large") from None
        except (GrammarCrashed, ValueError) as exc:
            raise bad_request(f"{pending.param}: {clean_error(str(exc))}", param=pending.param,
                              code="invalid_grammar") from None
        except RuntimeError as exc:  # the sandbox could not start
            raise APIError(503, f"grammars cannot be compiled now: {exc}", code="grammar_unavailable") from None
        finally:
            job.waiters -= 1
            if job.waiters == 0 and not job.future.done():
                job.cancel.set()  # nobody waits for it any more: the sandbox kills its child

    def _finished(self, key: str, job: _Compile, future: asyncio.Future) -> None:
        if self._compiling.get(key) is job:
            del self._compiling[key]
        if not future.cancelled():
            future.exception()  # retrieved: a compile nobody waits for is not an unhandled error

    def _build(self, pending: PendingGrammar, cancel: threading.Event) -> Grammar:
        """Try ``pending`` in the sandbox, then compile it here and keep it (compile thread)."""
        start = time.perf_counter()
        compiler = self.compiler(pending.param)
        try:
            nbytes = self.sandbox().check(pending.source, self.timeout_s, cancel)
        except (GrammarTimeout, GrammarCrashed, ValueError) as exc:
            log.warning("grammar %s (%s) refused: %s", grammar_digest(pending.source), pending.param, str(exc)[:200])
            raise
        if nbytes > self.cache.max_bytes:
            raise GrammarTooLarge(f"the grammar needs {nbytes / 2**20:.0f} MiB; compiled grammars may hold at most "
                                  f"{self.cache.max_bytes / 2**20:.0f} MiB (--grammar-cache-bytes)", "memory")
        if cancel.is_set():
            raise GrammarCancelled("the grammar check was cancelled")
        grammar = compiler.compile_source(pending.kind, pending.source, nbytes)
        self.cache.put(grammar)
        log.info("grammar %s (%s): compiled in %.2f s, %.1f MiB", grammar.digest, pending.param,
                 time.perf_counter() - start, nbytes / 2**20)
        return grammar

    def close(self) -> None:
        """Stop compiling: the sandbox's child is killed, waiting requests get 503. Any thread."""
        self._closed = True
        with self._lock:
            sandbox = self._sandbox
        if sandbox is not None:
            sandbox.close()
        self._threads.stop()

