"""Trying a grammar where a crash cannot take the caller with it: a child process.

    sandbox = GrammarSandbox(compiler.tokenizer_json, compiler.vocab_size, compiler.eos_token_ids,
                             memory_bytes=512 << 20)
    nbytes = sandbox.check(source, timeout=10.0, cancel=event)   # GrammarTimeout, GrammarCrashed...
    grammar = compiler.compile_source(kind, source, nbytes)      # safe now: it compiled there

The grammar library can take minutes of CPU on a small grammar, abort on an allocation it
cannot make, and overflow its thread's stack on a deep one (SIGSEGV). A long-lived child
process (``python -m llaisys.engine.grammar_sandbox``, its own llguidance tokenizer built once
from the tokenizer's JSON) does what compiling does, ``grammar.build_matcher`` and the first
mask through an executor as the engine fills it, under a wall-clock budget, in a thread whose
stack is a quarter of the caller's compile thread's (``CALLER_STACK``), with its heap capped
(RLIMIT_DATA) at ``memory_bytes`` above what it holds idle. It answers with the memory the
grammar took (glibc's count of bytes in use, before and after). The caller kills it when the
budget runs out, when ``cancel`` is set (the client left) and on ``close`` (shutdown), and
starts a new one for the next grammar. The messages are length-prefixed JSON over its stdin
and stdout; anything the library prints goes to stderr.
"""
from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SANDBOX_STACK = 64 << 20  # bytes of stack of the child's compile thread
CALLER_STACK = 4 * SANDBOX_STACK  # what the caller's compile thread should have: what passed here fits there
START_TIMEOUT_S = 120.0  # for the child to start and build its tokenizer
POLL_S = 0.05  # how often a wait looks at its cancel event
_HEADER = struct.Struct(">I")


class GrammarTimeout(ValueError):
    """The grammar took longer than its budget to compile (the child was killed)."""


class GrammarCrashed(ValueError):
    """The grammar library failed on the grammar: the child died (a crash, an abort, out of its
    memory cap)."""


class GrammarCancelled(Exception):
    """The check was cancelled before it finished (the child was killed)."""


class SandboxClosed(RuntimeError):
    """The sandbox was closed (shutdown); no more grammars are checked."""


# ---- the caller's side -------------------------------------------------------------------------
class GrammarSandbox:
    """Checks grammars in a child process, one at a time (callers wait their turn). Thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 memory_bytes: int = 1 << 30) -> None:
        self._config = {"tokenizer": tokenizer_json, "vocab_size": int(vocab_size),
                        "eos": [int(t) for t in eos_token_ids], "memory_bytes": int(memory_bytes)}
        self._lock = threading.Lock()  # one check at a time
        self._proc: subprocess.Popen | None = None
        self._closed = False
        self.started = 0  # children started (a new one after each kill)

    def check(self, source: str, timeout: float, cancel: threading.Event | None = None) -> int:
        """Try grammar ``source`` (llguidance's text) in the child within ``timeout`` seconds of
        its time (waiting for an earlier check does not count); the bytes it took. Raises
        ValueError with the library's message when it does not compile or allows no output,
        GrammarTimeout, GrammarCrashed, GrammarCancelled when ``cancel`` is set meanwhile, and
        SandboxClosed after ``close``."""
        while not self._lock.acquire(timeout=POLL_S):
            self._stop_if(cancel)
        try:
            self._stop_if(cancel)
            proc = self._child()
            _write(proc, {"source": source})
            reply = self._read(proc, time.monotonic() + timeout, cancel,
                               f"the grammar took longer than {timeout:g} s to compile")
        finally:
            self._lock.release()
        if "error" in reply:
            raise ValueError(reply["error"])
        return int(reply["nbytes"])

    @property
    def running(self) -> bool:
        """Whether a child process is alive now (one is started for the next check after a kill)."""
        proc = self._proc
        return proc is not None and proc.poll() is None

    def close(self) -> None:
        """Kill the child; every check waiting or running raises SandboxClosed. Any thread."""
        self._closed = True
        proc = self._proc
        if proc is None:
            return
        if self._lock.acquire(blocking=False):  # idle: reap it here
            try:
                self._kill(proc)
            finally:
                self._lock.release()
        elif proc.poll() is None:
            proc.kill()  # the check running sees it die, and reaps it

    def _stop_if(self, cancel: threading.Event | None) -> None:
        if self._closed:
            raise SandboxClosed("the grammar sandbox is closed")
        if cancel is not None and cancel.is_set():
            raise GrammarCancelled("the grammar check was cancelled")

    def _child(self) -> subprocess.Popen:
        """The running child, started (and its tokenizer built) if there is none."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root,
                                                                          os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen([sys.executable, "-m", "llaisys.engine.grammar_sandbox"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, start_new_session=True)  # not in Ctrl-C's group
        self._proc = proc
        self.started += 1
        if self._closed:  # closed while it started
            self._kill(proc)
            raise SandboxClosed("the grammar sandbox is closed")
        _write(proc, self._config)
        try:
            reply = self._read(proc, time.monotonic() + START_TIMEOUT_S, None, f"no answer in {START_TIMEOUT_S:g} s")
        except GrammarTimeout as exc:
            raise RuntimeError(f"the grammar sandbox did not start: {exc}") from None
        except GrammarCrashed:
            raise RuntimeError(f"the grammar sandbox did not start (status {proc.returncode})") from None
        if "error" in reply:
            self._kill(proc)
            raise RuntimeError(f"the grammar sandbox did not start: {reply['error']}")
        return proc

    def _read(self, proc: subprocess.Popen, deadline: float, cancel: threading.Event | None,
              late: str) -> dict[str, Any]:
        """The child's next message; kills it when ``deadline`` passes (GrammarTimeout(``late``)),
        ``cancel`` is set, the sandbox closes or it dies (then raises)."""
        buf = b""
        fd = proc.stdout.fileno()
        while True:
            need = _HEADER.size if len(buf) < _HEADER.size else _HEADER.size + _HEADER.unpack_from(buf)[0]
            if len(buf) >= need > _HEADER.size:
                return json.loads(buf[_HEADER.size:need])
            try:
                self._stop_if(cancel)
            except BaseException:
                self._kill(proc)
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill(proc)
                raise GrammarTimeout(late)
            ready, _, _ = select.select([fd], [], [], min(POLL_S, left))
            if ready:
                chunk = os.read(fd, max(need - len(buf), 1 << 16))
                if not chunk:
                    raise self._died(proc)
                buf += chunk

    def _died(self, proc: subprocess.Popen) -> BaseException:
        self._kill(proc)
        code = proc.returncode
        if self._closed:
            return SandboxClosed("the grammar sandbox is closed")
        killed = code < 0 and -code in signal.valid_signals()
        how = f"signal {signal.Signals(-code).name}" if killed else f"status {code}"
        return GrammarCrashed(f"the grammar library failed on this grammar (its process ended with {how})")

    def _kill(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def _write(proc: subprocess.Popen, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode("utf-8", "surrogatepass")
    try:
        proc.stdin.write(_HEADER.pack(len(data)) + data)
        proc.stdin.flush()
    except (BrokenPipeError, ValueError):
        pass  # it died: reading its answer says how


# ---- the child's side --------------------------------------------------------------------------
def _libc() -> Any:
    """glibc with ``mallinfo2`` (``llaisys._native.libc``), or None: not glibc 2.33+, so
    resident memory is counted instead."""
    from .. import _native

    return _native.libc()


def _bytes_in_use(libc: Any) -> int:
    """Heap bytes allocated now (glibc's count, which freed memory kept for reuse does not
    inflate), else the resident set."""
    if libc is not None:
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _data_bytes() -> int:
    """The process's data segment now (what RLIMIT_DATA counts)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _receive(stream: Any) -> dict[str, Any] | None:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None  # the caller closed the pipe (or died): nothing more to do
    return json.loads(stream.read(_HEADER.unpack(head)[0]))


def _send(stream: Any, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _try(tokenizer: Any, executor: Any, libc: Any, source: str) -> dict[str, Any]:
    """Compile ``source`` as the caller will, and fill its first mask as the engine will."""
    import numpy as np
    from llguidance.numpy import fill_next_token_bitmask_par

    from .grammar import build_matcher, first_line

    before = _bytes_in_use(libc)
    try:
        prototype = build_matcher(tokenizer, source)
    except ValueError as exc:
        return {"error": str(exc)}
    matcher = prototype.deep_copy()
    masks = np.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32)
    fill_next_token_bitmask_par(executor, [(matcher, 0)], masks)
    if matcher.is_error():
        return {"error": f"the grammar allows no output ({first_line(matcher.get_error())})"}
    return {"nbytes": max(_bytes_in_use(libc) - before, 0) + len(source)}


def _serve(stdin: Any, stdout: Any) -> None:
    """Answer the caller's messages until it closes the pipe: the config first, then grammars."""
    import llguidance

    from .grammar import new_lltokenizer

    config = _receive(stdin)
    if config is None:
        return
    libc = _libc()
    try:
        tokenizer = new_lltokenizer(config["tokenizer"], config["vocab_size"], config["eos"])
    except ValueError as exc:
        _send(stdout, {"error": str(exc)})
        return
    executor = llguidance.LLExecutor(1)  # one core: the server's engine keeps the others
    _try(tokenizer, executor, libc, llguidance.LLMatcher.grammar_from_regex("[a-z]+"))  # loads everything once
    if libc is not None:
        libc.malloc_trim(0)
    try:
        import resource

        cap = _data_bytes() + config["memory_bytes"]
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    except (ImportError, ValueError, OSError):
        pass
    _send(stdout, {"ready": True})
    while (message := _receive(stdin)) is not None:
        try:
            reply = _try(tokenizer, executor, libc, message["source"])
        except MemoryError:
            reply = {"error": "the grammar needs more memory than a grammar may use"}
        if libc is not None:
            libc.malloc_trim(0)  # give the grammar's memory back before the next one
        _send(stdout, reply)


def _watch_parent(parent: int) -> None:
    """End the process once the caller is gone (even in the middle of a grammar)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main() -> None:
    """The child: keep stdout for the messages (anything printed goes to stderr), serve in a
    thread with a known stack, and end with the caller."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    threading.stack_size(SANDBOX_STACK)
    worker = threading.Thread(target=_serve, args=(sys.stdin.buffer, out), name="llaisys-grammar-sandbox")
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
