"""The plugin conformance check behind ``llaisys plugin check PATH``.

It loads the plugin and exercises its device API with data verified on the host: devices,
allocator sizes, allocation at odd request sizes, copies in every direction (sync and async),
memset, stream order, device synchronize, events across streams, host callbacks and memory
stats. Then it runs one decoder layer's chain of ops (embedding, rms_norm, q/k/v projections,
rope, attention, output projection, residual add, SwiGLU MLP, head, argmax) and a small
random-weight model on the plugin's device and on the CPU and compares them; ops without a
plugin kernel run through the CPU fallback. Last, it times that model's recorded decode step
on both and reports the per-token dispatch overhead (the step's time outside the kernels)
of the device next to the CPU's.

Every check asks only what the plugin contract allows: allocation sizes are rounded as the
caching allocator rounds them (request plus ``extra_padding_size``, up to a multiple of
``min_chunk_size``), and the memory a row holds at once stays within ``max_alloc_size`` and
the free memory the device reports; a row that cannot fit is scaled down or skipped with the
reason. Every call into the plugin runs on a worker thread watched by a timeout: a call that
does not return fails its row, naming the API, and the rows after it are skipped.

Each row is ``pass``, ``fallback`` (passed, through a fallback for a missing optional API),
``fail`` or ``skip``. The check fails when any row fails.
"""
from __future__ import annotations

import argparse
import json
import linecache
import logging
import os
import queue
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..kernels.registry import find_kernel
from ..plugins import PluginError
from ..runtime.allocator import CachingAllocator
from ..runtime.dtypes import DataType, MemcpyKind
from ..runtime.errors import OutOfMemoryError
from ..runtime.interface import AllocatorSizes

log = logging.getLogger(__name__)

PASS, FALLBACK, FAIL, SKIP = "pass", "fallback", "fail", "skip"
OPS = ("embedding", "rms_norm", "linear", "rope", "self_attention", "add", "swiglu", "argmax", "rearrange")
DEFAULT_TIMEOUT = 30.0  # seconds one row may take
DEADLINE_PER_TIMEOUT = 10  # the whole check's default deadline, in row timeouts
DEFAULT_DEADLINE = 300.0  # when rows have no timeout


@dataclass
class CheckRow:
    """One line of the report."""

    name: str
    status: str
    detail: str = ""


ROW_WIDTH = 24  # the check-name column


def format_row(row: CheckRow) -> str:
    """One table line; the detail on one line."""
    return f"  {row.name:<{ROW_WIDTH}}  {row.status:<8}  {' '.join(row.detail.split())}"


@dataclass
class CheckReport:
    """What ``run_check`` found for the library at ``path``. ``on_row`` sees each row as it
    is added (the command prints them as they come). ``hung`` names the plugin API that did
    not return within the row timeout, if one did not."""

    path: str
    rows: list[CheckRow] = field(default_factory=list)
    on_row: Callable[[CheckRow], None] | None = field(default=None, repr=False)
    hung: str | None = None

    def add(self, name: str, status: str, detail: str = "") -> None:
        """Append a row."""
        row = CheckRow(name, status, detail)
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)

    def fail(self, name: str, detail: str) -> None:
        """Append a failed row."""
        self.add(name, FAIL, detail)

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return all(r.status != FAIL for r in self.rows)

    def header(self) -> str:
        """The lines above the rows."""
        return f"plugin check: {self.path}\n  {'check':<{ROW_WIDTH}}  {'result':<8}  detail"

    def summary(self) -> str:
        """The line below the rows: OK or FAILED, and the count of each result."""
        counts = {s: sum(r.status == s for r in self.rows) for s in (PASS, FALLBACK, FAIL, SKIP)}
        return f"{'OK' if self.ok else 'FAILED'}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)

    def table(self) -> str:
        """Header, rows and summary as text."""
        return "\n".join([self.header(), *map(format_row, self.rows), self.summary()])


class _Skip(Exception):
    """The row cannot run on this device; the message says why."""


class _Hung(Exception):
    """A call into the plugin did not return in time; ``api`` names it."""

    def __init__(self, api: str, timeout: float):
        super().__init__(f"{api} did not return within {timeout:g} s")
        self.api = api


# ---- the watchdog --------------------------------------------------------------------------------
_TABLE_CALL = re.compile(r"\btable\.(\w+)\(")
_ENTRY_POINTS = {"llaisys.plugins.loader": "InitPlugin", "llaisys.plugins.kernels": "InitPluginKernels"}


def _plugin_api_in(frame: Any) -> str | None:
    """The plugin API that the innermost llaisys plugin frame of a stack is calling, if any."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("llaisys.backends.plugin", "llaisys.plugins")):
            api = frame.f_locals.get("api")
            if isinstance(api, str):
                return api
            called = _TABLE_CALL.search(linecache.getline(frame.f_code.co_filename, frame.f_lineno))
            return called.group(1) if called else _ENTRY_POINTS.get(module, frame.f_code.co_name)
        frame = frame.f_back
    return None


class _Worker:
    """One daemon thread that makes every call into the plugin, so that the caller can stop
    waiting for one that hangs (a thread blocked in C cannot be interrupted, only left)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="llaisys-plugin-check", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the caller
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()`` on the worker; raises _Hung, naming the plugin API it is blocked in, when
        it has not returned after ``timeout`` seconds."""
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        if not done.wait(timeout):
            frame = sys._current_frames().get(self._thread.ident)
            raise _Hung(_plugin_api_in(frame) or "a call into the plugin", timeout)
        ok, value = box[0]
        if ok:
            return value
        raise value

    def stop(self) -> None:
        """Let the thread end once it is idle."""
        self._jobs.put(None)


class _Host:
    """Host buffers kept alive for the duration of the check (async copies read them later)."""

    def __init__(self) -> None:
        self.keep: list[np.ndarray] = []

    def random(self, n: int, seed: int) -> np.ndarray:
        a = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        self.keep.append(a)
        return a

    def zeros(self, n: int) -> np.ndarray:
        a = np.zeros(n, np.uint8)
        self.keep.append(a)
        return a


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _kib(n: int) -> str:
    return f"{n / 1024:.4g} KiB" if n < (1 << 20) else f"{n / (1 << 20):.4g} MiB"


def reserved_for(sizes: AllocatorSizes, nbytes: Iterable[int]) -> int | None:
    """Device bytes the caching allocator, sized by ``sizes``, would reserve to hold
    allocations of ``nbytes`` all at once; None when its ``max_alloc_size`` forbids it."""
    taken = [0]

    def raw_alloc(n: int) -> int:
        taken[0] += n
        return taken[0]  # a distinct fake pointer

    allocator = CachingAllocator(raw_alloc, lambda ptr, n: None, sizes, name="estimate")
    try:
        for n in nbytes:
            allocator.malloc(n)
    except OutOfMemoryError:
        return None
    return allocator.stats().peak_reserved


class _Checker:
    def __init__(self, plugin: Any, index: int):
        self.plugin = plugin
        self.b = plugin.backend
        self.i = index
        self.device = f"{plugin.name}:{index}"
        self.host = _Host()
        self.fallbacks = set(self.b.fallbacks())
        self._allocs: list[tuple[int, int]] = []
        self._sizes: AllocatorSizes | None = None

    # ---- plumbing --------------------------------------------------------------------------
    def run(self, name: str, fn: Callable[[], str], uses: Sequence[str] = ()) -> list[CheckRow]:
        """Run one check; it returns a detail string or raises (_Skip: the row is skipped).
        ``uses``: optional APIs whose absence turns a pass into a fallback. Returns the row,
        after a row for each free that failed."""
        missing = [a for a in uses if a in self.fallbacks]
        try:
            detail = fn()
            status = FALLBACK if missing else PASS
            if missing:
                detail = (detail + "; " if detail else "") + "fallback for " + ", ".join(missing)
        except _Skip as exc:
            status, detail = SKIP, str(exc)
        except Exception as exc:  # any failure is a row, never a crash
            log.debug("check %s failed", name, exc_info=True)
            status, detail = FAIL, f"{type(exc).__name__}: {exc}"
        rows = self._free_all()
        rows.append(CheckRow(name, status, detail))
        return rows

    def _free_all(self) -> list[CheckRow]:
        rows = []
        while self._allocs:
            ptr, n = self._allocs.pop()
            try:
                self.b.deallocate(self.i, ptr, n)
            except PluginError as exc:
                rows.append(CheckRow("free", FAIL, str(exc)))
        return rows

    # ---- memory, as the contract allows it --------------------------------------------------
    @property
    def sizes(self) -> AllocatorSizes:
        """The allocator sizes the plugin's info APIs give (asked once)."""
        if self._sizes is None:
            self._sizes = self.b.allocator_sizes(self.i)
        return self._sizes

    def aligned(self, n: int) -> int:
        """The size the caching allocator asks the device for to serve ``n`` bytes."""
        m = self.sizes.min_chunk_size
        return ((n or 1) + self.sizes.extra_padding_size + m - 1) // m * m

    def free_memory(self) -> int | None:
        """The free device memory the plugin reports; None when it has no memory stats."""
        return self.b.memory_stats(self.i)[1] if self.b.has_api("device_memory_stats") else None

    def limit(self, share: float = 0.5) -> int:
        """Bytes a row may hold at once: ``share`` of the free memory the device reports,
        at most ``max_alloc_size`` (unbounded when the plugin reports neither)."""
        free = self.free_memory()
        cap = self.sizes.max_alloc_size or sys.maxsize
        return cap if free is None else min(int(free * share), cap)

    def fit(self, want: int, count: int = 1, least: int = 1) -> int:
        """The largest request of at most ``want`` bytes of which ``count`` fit in ``limit()``
        once aligned; raises _Skip when that is below ``least``."""
        budget = self.limit() // count
        m, pad = self.sizes.min_chunk_size, self.sizes.extra_padding_size
        n = min(want, budget // m * m - pad)
        if n < least:
            raise _Skip(f"needs {count} x {self.aligned(least)} bytes; the device offers {self._offer(budget * count)}")
        return n

    def _offer(self, limit: int) -> str:
        """``limit`` bytes, with where that limit comes from."""
        free, cap = self.free_memory(), self.sizes.max_alloc_size
        where = [f"{_kib(free)} free" if free is not None else "free memory not reported"]
        where += [f"max_alloc_size {_kib(cap)}"] if cap else []
        return f"{_kib(limit)} ({', '.join(where)})"

    def alloc(self, n: int) -> int:
        """A device pointer to at least ``n`` bytes, allocated at the aligned size."""
        size = self.aligned(n)
        ptr = self.b.allocate(self.i, size)
        self._allocs.append((ptr, size))
        return ptr

    def h2d(self, dst: int, a: np.ndarray) -> None:
        self.b.copy_h2d(self.i, dst, _ptr(a), a.nbytes)

    def d2h(self, a: np.ndarray, src: int) -> None:
        self.b.copy_d2h(self.i, _ptr(a), src, a.nbytes)

    def stream(self) -> Any:
        return self.b.create_stream(self.i)

    def close_stream(self, s: Any) -> None:
        self.b.destroy_stream(self.i, s)

    # ---- device API checks ---------------------------------------------------------------------
    def devices(self) -> str:
        n = self.b.device_count()
        if n < 1:
            raise AssertionError("get_device_count reports no devices")
        if self.i >= n:
            raise AssertionError(f"device {self.i} asked for, but the plugin has {n}")
        ids = []
        for k in range(n):
            self.b.set_device(k)
            ids.append(self.b.current_device_id())
        expected = [self.b.device_handle(k).contents.id for k in range(n)]
        if ids != expected:
            raise AssertionError(f"get_device after set_device gave ids {ids}, expected {expected}")
        self.b.set_device(self.i)
        return f"{n} device(s), ids {expected}; set_device/get_device agree"

    def allocator(self) -> str:
        s = self.sizes
        if s.max_chunk_size < s.min_chunk_size:
            raise AssertionError(f"max chunk {s.max_chunk_size} is below min chunk {s.min_chunk_size}")
        return (f"min chunk {s.min_chunk_size}, max chunk {s.max_chunk_size}, max alloc {s.max_alloc_size}, "
                f"padding {s.extra_padding_size}, init {s.init_alloc_size}, realloc {s.realloc_size}")

    def odd_allocations(self) -> str:
        wanted = (1, 3, 17, 4097, (1 << 20) + 13)
        budget = self.limit()
        offer = self._offer(budget)
        sizes, left_out, held = [], [], 0
        for n in wanted:
            if held + self.aligned(n) <= budget:
                sizes.append(n)
                held += self.aligned(n)
            else:
                left_out.append(n)
        if not sizes:
            raise _Skip(f"not even {self.aligned(1)} bytes fit in the {offer} the device offers")
        ptrs = [self.alloc(n) for n in sizes]
        if len(set(ptrs)) != len(ptrs):
            raise AssertionError("device_memory_allocate returned the same pointer twice")
        for n, p in zip(sizes, ptrs):
            src, back = self.host.random(n, n), self.host.zeros(n)
            self.h2d(p, src)
            self.d2h(back, p)
            if not np.array_equal(src, back):
                raise AssertionError(f"{n} bytes did not survive H2D then D2H")
        detail = (f"requests of {', '.join(map(str, sizes))} bytes (allocated as "
                  f"{', '.join(str(self.aligned(n)) for n in sizes)}) written, read back, freed")
        if left_out:
            detail += f"; {', '.join(map(str, left_out))} left out: above the {offer} the device offers"
        return detail

    def sync_copies(self) -> str:
        n = self.fit(3 * 4096 + 5, count=2, least=1101)
        a, back = self.host.random(n, 1), self.host.zeros(n)
        x, y = self.alloc(n), self.alloc(n)
        self.h2d(x, a)
        self.b.copy_d2d(self.i, y, x, n)
        self.d2h(back, y)
        if not np.array_equal(a, back):
            raise AssertionError("H2D -> D2D -> D2H changed the data")
        part = self.host.zeros(100)
        self.b.copy_d2h(self.i, _ptr(part), x + 1001, 100)  # a pointer inside an allocation
        if not np.array_equal(part, a[1001:1101]):
            raise AssertionError("D2H from an offset pointer read the wrong bytes")
        return f"H2D, D2D, D2H of {n} bytes and D2H at an offset verified"

    def async_copies(self) -> str:
        n = self.fit((2 << 20) + 7, count=2, least=4096)
        a, back = self.host.random(n, 2), self.host.zeros(n)
        x, y = self.alloc(n), self.alloc(n)
        s = self.stream()
        try:
            self.b.copy_async(self.i, x, _ptr(a), n, MemcpyKind.H2D, s)
            self.b.copy_async(self.i, y, x, n, MemcpyKind.D2D, s)
            self.b.copy_async(self.i, _ptr(back), y, n, MemcpyKind.D2H, s)
            self.b.synchronize_stream(self.i, s)
        finally:
            self.close_stream(s)
        if not np.array_equal(a, back):
            raise AssertionError("async H2D -> D2D -> D2H on one stream changed the data")
        return f"{n} bytes through async H2D, D2D, D2H on one stream"

    def memset(self) -> str:
        n = self.fit(1001, least=1001)
        x = self.alloc(n)
        self.b.memset(self.i, x, 0x5A, n)
        self.b.memset(self.i, x + 13, 0x11, 100)
        back = self.host.zeros(n)
        self.d2h(back, x)
        want = np.full(n, 0x5A, np.uint8)
        want[13:113] = 0x11
        if not np.array_equal(back, want):
            raise AssertionError("device_memory_set wrote the wrong bytes")
        return "whole and partial (offset) fills verified"

    def stream_order(self) -> str:
        n = self.fit(4 << 20, count=2, least=4096)
        a, c = self.host.random(n, 3), self.host.random(n, 4)
        b1, b2 = self.host.zeros(n), self.host.zeros(n)
        x, y = self.alloc(n), self.alloc(n)
        s = self.stream()
        try:
            # Each copy overwrites a buffer the one before reads: only in-order execution gives a, c.
            for src, dst in ((a, b1), (c, b2)):
                self.b.copy_async(self.i, x, _ptr(src), n, MemcpyKind.H2D, s)
                self.b.copy_async(self.i, y, x, n, MemcpyKind.D2D, s)
                self.b.copy_async(self.i, _ptr(dst), y, n, MemcpyKind.D2H, s)
            self.b.synchronize_stream(self.i, s)
            done = self.b.query_stream(self.i, s)
        finally:
            self.close_stream(s)
        if not (np.array_equal(b1, a) and np.array_equal(b2, c)):
            raise AssertionError("work on one stream ran out of order")
        if not done:
            raise AssertionError("query_stream reports pending work after synchronize_stream")
        return f"6 dependent copies of {n} bytes ran in order; query_stream done after synchronize"

    def synchronize(self) -> str:
        n = self.fit(4 << 20, least=4096)
        a, back = self.host.random(n, 7), self.host.zeros(n)
        x = self.alloc(n)
        s = self.stream()
        try:
            self.b.copy_async(self.i, x, _ptr(a), n, MemcpyKind.H2D, s)
            self.b.copy_async(self.i, _ptr(back), x, n, MemcpyKind.D2H, s)
            self.b.synchronize_device(self.i)
            seen = back.copy()
        finally:
            self.close_stream(s)
        if not np.array_equal(seen, a):
            raise AssertionError("synchronize_device returned before the work queued on a stream was done")
        return "returned after the work queued on a stream"

    def events(self) -> str:
        n = self.fit(8 << 20, count=2, least=4096)
        a, back = self.host.random(n, 5), self.host.zeros(n)
        x, y = self.alloc(n), self.alloc(n)
        s1, s2 = self.stream(), self.stream()
        ev = self.b.create_event(self.i)
        try:
            self.b.copy_async(self.i, x, _ptr(a), n, MemcpyKind.H2D, s1)
            self.b.record_event(self.i, s1, ev)
            self.b.stream_wait_event(self.i, s2, ev)
            self.b.copy_async(self.i, y, x, n, MemcpyKind.D2D, s2)
            self.b.copy_async(self.i, _ptr(back), y, n, MemcpyKind.D2H, s2)
            self.b.synchronize_stream(self.i, s2)
            self.b.synchronize_event(self.i, ev)
            done = self.b.query_event(self.i, ev)
        finally:
            self.b.destroy_event(self.i, ev)
            self.close_stream(s1)
            self.close_stream(s2)
        if not np.array_equal(a, back):
            raise AssertionError("a stream waiting on an event ran before the event's work")
        if not done:
            raise AssertionError("query_event reports pending after synchronize_event")
        return "stream 2 waited for an event recorded on stream 1; query after synchronize done"

    def callbacks(self) -> str:
        n = self.fit(4 << 20, least=4096)
        a, back = self.host.random(n, 6), self.host.zeros(n)
        x = self.alloc(n)
        seen: list[bool] = []
        s = self.stream()
        try:
            self.b.copy_async(self.i, x, _ptr(a), n, MemcpyKind.H2D, s)
            self.b.copy_async(self.i, _ptr(back), x, n, MemcpyKind.D2H, s)
            self.b.stream_add_callback(self.i, s, lambda: seen.append(bool(np.array_equal(back, a))))
            self.b.synchronize_stream(self.i, s)
        finally:
            self.close_stream(s)
        if seen != [True]:
            raise AssertionError(f"the callback ran {len(seen)} time(s); it saw the copies done: {seen}")
        return "ran once, after the copies queued before it"

    def memory_stats(self) -> str:
        if not self.b.has_api("device_memory_stats"):
            return "not provided: total and free memory unknown; rows are sized by max_alloc_size alone"
        total, free = self.b.memory_stats(self.i)
        if total == 0 or free > total:
            raise AssertionError(f"device_memory_stats gave total {total}, free {free}")
        n = self.fit(16 << 20, least=self.sizes.min_chunk_size)
        self.alloc(n)
        n = self.aligned(n)
        _, free_after = self.b.memory_stats(self.i)
        drop = free - free_after
        note = "tracks allocations" if drop >= n else f"free memory dropped by {drop} bytes after a {n}-byte allocation"
        return f"total {_kib(total)}, free {_kib(free)}; {note}"

    # ---- ops on the device ----------------------------------------------------------------------
    def kernels(self, missing: Sequence[str]) -> str:
        have = [op for op in OPS if op not in missing]
        text = f"F32 kernels: {', '.join(have) or 'none'}"
        return text + (f"; CPU fallback for {', '.join(missing)}" if missing else "")

    def _room(self, what: str, nbytes: Iterable[int]) -> None:
        """Raise _Skip unless the caching allocator could hold ``nbytes`` at once in the
        device's free memory."""
        need = reserved_for(self.sizes, nbytes)
        room = self.limit(share=1.0)
        if need is None or need > room:
            amount = f"more than {_kib(self.sizes.max_alloc_size)}" if need is None else f"about {_kib(need)}"
            raise _Skip(f"{what} needs {amount} of device memory; the device offers {self._offer(room)}")

    def _on_device(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, with the device's caching allocator emptied after; running out of device
        memory skips the row (the device is too small, not wrong)."""
        from ..runtime.runtime import get_runtime

        try:
            return fn()
        except OutOfMemoryError as exc:
            raise _Skip(f"{what} ran out of device memory: {exc}") from exc
        finally:
            get_runtime(self.device).empty_cache()

    def decoder_layer(self) -> str:
        self._room("the decoder layer", decoder_layer_bytes())
        want = decoder_layer_chain("cpu")
        got = self._on_device("the decoder layer", lambda: decoder_layer_chain(self.device))
        for key in ("hidden", "transposed"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-4, err_msg=f"{key} differs from the CPU")
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-4, err_msg="logits differ")
        ties = np.abs(want["logits"].max(-1) - want["logits"][np.arange(len(got["argmax"])), got["argmax"]]) > 1e-4
        if ties.any():
            raise AssertionError(f"argmax on the device {got['argmax'].tolist()} != CPU {want['argmax'].tolist()}")
        err = float(np.abs(got["logits"] - want["logits"]).max())
        return f"logits {got['logits'].shape} match the CPU (max abs diff {err:.1e}); argmax {got['argmax'].tolist()}"

    def model(self) -> str:
        shape = self._model_shape()
        want, want_tokens = random_model_run("cpu", shape=shape)
        got, got_tokens = self._on_device("the model", lambda: random_model_run(self.device, shape=shape))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg="model logits differ from the CPU")
        if got_tokens != want_tokens:
            raise AssertionError(f"greedy tokens on the device {got_tokens} != CPU {want_tokens}")
        err = float(np.abs(got - want).max())
        return (f"{shape['layers']}-layer Qwen2 logits {got.shape} match the CPU (max abs diff {err:.1e}); "
                f"{len(got_tokens)} greedy tokens equal")

    def dispatch(self) -> str:
        shape = self._model_shape()
        cpu, cpu_stats = dispatch_run("cpu", shape=shape)
        dev, stats = self._on_device("the model", lambda: dispatch_run(self.device, shape=shape))
        return (f"{dev.dispatch * 1e3:.3f} ms per token on {self.device} ({stats.native}/{stats.calls} calls of the "
                f"{shape['layers']}-layer decode step in {stats.stretches} native stretch(es), {stats.python} from "
                f"Python; step {dev.total * 1e3:.3f} ms), cpu {cpu.dispatch * 1e3:.3f} ms ({cpu_stats.native}/"
                f"{cpu_stats.calls} native; step {cpu.total * 1e3:.3f} ms)")

    def _model_shape(self) -> dict[str, int]:
        """The largest of MODEL_SHAPES that the device's free memory holds."""
        for shape in MODEL_SHAPES[:-1]:
            try:
                self._room("the model", model_bytes(shape))
                return shape
            except _Skip:
                continue
        self._room(f"the smallest random model ({MODEL_SHAPES[-1]['layers']} layer)", model_bytes(MODEL_SHAPES[-1]))
        return MODEL_SHAPES[-1]


# ---- the workloads ----------------------------------------------------------------------------------
CHAIN = {"tokens": 5, "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "intermediate": 48, "vocab": 64}


def decoder_layer_chain(device: str, seed: int = 0) -> dict[str, np.ndarray]:
    """One Qwen2-style decoder layer plus the head, in F32 on ``device``, from fixed random weights.

    Returns host arrays: ``hidden`` (S, D) after the layer, ``transposed`` (D, S) made by
    rearrange of a permuted view, ``logits`` (S, V) and ``argmax`` (S,). Shapes: ``CHAIN``.
    """
    from .. import ops
    from ..tensor import Tensor

    f = ops.functional
    rng = np.random.default_rng(seed)
    s, d, heads, kv_heads, dh, inter, vocab = CHAIN.values()
    w = lambda *shape, scale=0.2: Tensor.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32), device)  # noqa: E731
    embed = w(vocab, d, scale=1.0)  # (V, D)
    norm1, norm2, norm_out = (Tensor.from_numpy((1 + 0.1 * rng.standard_normal(d)).astype(np.float32), device) for _ in range(3))
    wq, bq = w(heads * dh, d), w(heads * dh)
    wk, bk = w(kv_heads * dh, d), w(kv_heads * dh)
    wv, bv = w(kv_heads * dh, d), w(kv_heads * dh)
    wo = w(d, heads * dh)
    w_gate, w_up, w_down = w(inter, d), w(inter, d), w(d, inter)
    ids = Tensor.from_numpy(rng.integers(0, vocab, s).astype(np.int64), device)  # (S,)
    pos = Tensor.from_numpy(np.arange(3, 3 + s, dtype=np.int64), device)  # (S,)

    x = f.embedding(ids, embed)  # (S, D)
    h = f.rms_norm(x, norm1, 1e-6)  # (S, D)
    q = f.rope(f.linear(h, wq, bq).view(s, heads, dh), pos, 10000.0)  # (S, H, Dh)
    k = f.rope(f.linear(h, wk, bk).view(s, kv_heads, dh), pos, 10000.0)  # (S, KH, Dh)
    v = f.linear(h, wv, bv).view(s, kv_heads, dh)  # (S, KH, Dh)
    attn = f.self_attention(q, k, v, 1.0 / np.sqrt(dh)).view(s, heads * dh)  # (S, H*Dh)
    x = f.add(x, f.linear(attn, wo))  # (S, D)
    h = f.rms_norm(x, norm2, 1e-6)  # (S, D)
    x = f.add(x, f.linear(f.swiglu(f.linear(h, w_gate), f.linear(h, w_up)), w_down))  # (S, D)
    transposed = f.rearrange(x.permute(1, 0))  # (D, S)
    logits = f.linear(f.rms_norm(x, norm_out, 1e-6), embed)  # (S, V), tied head
    idx, _ = f.argmax(logits)  # (S,)
    return {"hidden": x.numpy(), "transposed": transposed.numpy(), "logits": logits.numpy(), "argmax": idx.numpy()}


def decoder_layer_bytes() -> list[int]:
    """Bytes of each device tensor ``decoder_layer_chain`` makes (an upper bound: all at once)."""
    s, d, heads, kv_heads, dh, inter, vocab = CHAIN.values()
    q, kv = heads * dh, kv_heads * dh
    weights = [vocab * d, d, d, d, q * d, q, kv * d, kv, kv * d, kv, d * q, inter * d, inter * d, d * inter]
    activations = [s * d] * 8 + [s * q] * 3 + [s * kv] * 3 + [s * inter] * 3 + [s * vocab, s]
    return [4 * n for n in weights + activations] + [8 * s] * 3  # the I64 ids, positions, argmax


# Random Qwen2 models for the model row, largest first; the row takes the first the device holds.
MODEL_SHAPES: tuple[dict[str, int], ...] = (
    {"vocab": 96, "hidden": 32, "intermediate": 48, "layers": 2, "heads": 4, "kv_heads": 2},
    {"vocab": 32, "hidden": 16, "intermediate": 24, "layers": 1, "heads": 2, "kv_heads": 1},
)
PROMPT = (3, 17, 42, 5, 77, 8)  # token ids, taken modulo the vocabulary
NEW_TOKENS = 8


def write_random_qwen2(folder: "str | os.PathLike[str]", seed: int = 0, shape: Mapping[str, int] | None = None) -> None:
    """A small Qwen2 model with random F32 weights, as a Hugging Face folder (config.json and
    model.safetensors, no tokenizer). ``shape``: one of ``MODEL_SHAPES`` (default the first:
    V=96, D=32, 2 layers, 4 query and 2 key/value heads)."""
    from safetensors.numpy import save_file

    shape = MODEL_SHAPES[0] if shape is None else shape
    rng = np.random.default_rng(seed)
    v, d, inter, layers, heads, kv_heads = (shape[k] for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads"))
    dh = d // heads
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": v, "hidden_size": d,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "max_position_embeddings": 64, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32"}
    w = lambda *dims, scale=0.15: (rng.standard_normal(dims) * scale).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(v, d, scale=1.0), "model.norm.weight": norm()}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": w(heads * dh, d), p + "self_attn.q_proj.bias": w(heads * dh),
            p + "self_attn.k_proj.weight": w(kv_heads * dh, d), p + "self_attn.k_proj.bias": w(kv_heads * dh),
            p + "self_attn.v_proj.weight": w(kv_heads * dh, d), p + "self_attn.v_proj.bias": w(kv_heads * dh),
            p + "self_attn.o_proj.weight": w(d, heads * dh),
            p + "mlp.gate_proj.weight": w(inter, d), p + "mlp.up_proj.weight": w(inter, d),
            p + "mlp.down_proj.weight": w(d, inter),
        })
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"))


def model_bytes(shape: Mapping[str, int]) -> list[int]:
    """Bytes of each device tensor ``random_model_run`` needs for a model of ``shape``:
    weights, KV cache, the work buffers of the prompt and decode passes, the prompt's logits."""
    v, d, inter, layers, h, kh = (shape[k] for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads"))
    dh = d // h
    dq, dkv = h * dh, kh * dh
    layer = [d, (dq + 2 * dkv) * d, dq + 2 * dkv, d * dq, d, 2 * inter * d, d * inter]
    cache = [layers * (len(PROMPT) + NEW_TOKENS) * dkv] * 2

    def work(s: int) -> list[int]:
        return [s * d] * 3 + [s * (dq + 2 * dkv), s * (dq + dkv), s * dq, s * 2 * inter, s * inter, d, v]

    f32 = [v * d, d, *layer * layers, *cache, *work(len(PROMPT)), *work(1), len(PROMPT) * v]
    return [4 * n for n in f32] + [8 * len(PROMPT)] * 2 + [8] * 2  # I64 ids and positions


def load_random_qwen2(device: str, seed: int, shape: Mapping[str, int]) -> Any:
    """``write_random_qwen2``'s model of ``shape``, loaded on ``device`` from a temporary folder."""
    import tempfile

    from ..models import load_model

    with tempfile.TemporaryDirectory() as folder:
        write_random_qwen2(folder, seed, shape)
        models_log = logging.getLogger("llaisys.models")
        level = models_log.level
        models_log.setLevel(logging.ERROR)  # the folder has no tokenizer, on purpose
        try:
            return load_model(folder, device=device)
        finally:
            models_log.setLevel(level)


def random_model_run(device: str, seed: int = 0, shape: Mapping[str, int] | None = None) -> tuple[np.ndarray, list[int]]:
    """Load ``write_random_qwen2``'s model of ``shape`` on ``device``; return the logits (S, V)
    of the 6-token ``PROMPT`` and 8 greedy tokens decoded after it with the KV cache."""
    shape = MODEL_SHAPES[0] if shape is None else shape
    model = load_random_qwen2(device, seed, shape)
    prompt = [t % shape["vocab"] for t in PROMPT]
    cache = model.new_cache(len(prompt) + NEW_TOKENS)
    logits = model.forward(prompt, cache, all_logits=True)  # (S, V)
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < NEW_TOKENS:
        tokens.append(int(np.argmax(model.forward([tokens[-1]], cache))))
    return logits, tokens


DISPATCH_RUNS = 20  # replays of the decode step timed by the dispatch row (the median is reported)


def dispatch_run(device: str, seed: int = 0, shape: Mapping[str, int] | None = None) -> tuple[Any, Any]:
    """(``ops.ReplayProfile``, ``ops.ReplayStats``) of the decode step (S = 1) of
    ``write_random_qwen2``'s model on ``device``, after the ``PROMPT``: the step's time per
    token and the part of it outside the kernels (dispatch: Python, crossings into C, the
    fallback's copies, calls made from Python), median of ``DISPATCH_RUNS`` replays."""
    shape = MODEL_SHAPES[0] if shape is None else shape
    model = load_random_qwen2(device, seed, shape)
    prompt = [t % shape["vocab"] for t in PROMPT]
    cache = model.new_cache(len(prompt) + 2)
    model.forward(prompt, cache)
    model.forward([prompt[0]], cache)  # records the decode step
    plan = model.runner.decoding_pass(cache).plan
    return plan.profile(DISPATCH_RUNS), plan.stats()


# ---- running the rows -------------------------------------------------------------------------------
Step = tuple[str, Callable[[], str], Sequence[str]]


def _steps(c: _Checker, ops: bool) -> list[Step]:
    """The rows after ``load``, in order: (name, check, optional APIs it may fall back for)."""
    steps: list[Step] = [
        ("devices", c.devices, ()),
        ("allocator sizes", c.allocator, ("device_min_chunk_size", "device_max_chunk_size", "device_max_alloc_size",
                                          "device_extra_padding_size", "device_init_alloc_size", "device_realloc_size")),
        ("allocate/free odd sizes", c.odd_allocations, ()),
        ("copies (sync)", c.sync_copies, ("memory_copy_h2d", "memory_copy_d2h", "memory_copy_d2d")),
        ("copies (async)", c.async_copies, ("create_stream", "async_memory_copy_h2d", "async_memory_copy_d2d",
                                            "async_memory_copy_d2h")),
        ("memset", c.memset, ("device_memory_set",)),
        ("stream order", c.stream_order, ("create_stream", "query_stream")),
        ("synchronize device", c.synchronize, ("create_stream", "synchronize_device")),
        ("events across streams", c.events, ("create_event", "stream_wait_event", "query_event")),
        ("host callbacks", c.callbacks, ("create_stream", "stream_add_callback")),
        ("memory stats", c.memory_stats, ("device_memory_stats",)),
    ]
    if not ops:
        return steps
    missing = [op for op in OPS if find_kernel(op, c.plugin.name, DataType.F32) is None]
    c.fallbacks |= {f"kernel {op}" for op in missing}
    uses = [f"kernel {op}" for op in missing]
    return steps + [("kernels", lambda: c.kernels(missing), ()), ("decoder layer vs CPU", c.decoder_layer, uses),
                    ("model vs CPU", c.model, uses), ("dispatch per token", c.dispatch, uses)]


def run_check(path: "str | os.PathLike[str]", device_index: int = 0, ops: bool = True,
              on_row: Callable[[CheckRow], None] | None = None, timeout: float | None = DEFAULT_TIMEOUT,
              on_start: Callable[[str], None] | None = None) -> CheckReport:
    """Load the plugin at ``path`` and run every check on device ``device_index``; ``ops``
    also runs the decoder layer and the model against the CPU. ``on_row`` sees each row,
    ``on_start`` each row's name as it starts.

    With a ``timeout`` (seconds per row; None or 0 for none), calls into the plugin run on a
    worker thread: a row that has not finished in time fails, naming the plugin API it is
    blocked in (``report.hung``), and the rows after it are skipped. The blocked thread cannot
    be stopped and stays behind, with the plugin loaded: run the check in a child process
    (the command does) when a plugin may hang.
    """
    report = CheckReport(os.fspath(path), on_row=on_row)
    worker = _Worker() if timeout else None
    try:
        _run_rows(report, path, device_index, ops, worker, timeout or 0.0, on_start or (lambda name: None))
    finally:
        if worker is not None and report.hung is None:
            worker.stop()
    return report


def _run_rows(report: CheckReport, path: "str | os.PathLike[str]", device_index: int, ops: bool,
              worker: _Worker | None, timeout: float, on_start: Callable[[str], None]) -> None:
    from ..plugins import load_plugin

    def call(fn: Callable[[], Any]) -> Any:
        return fn() if worker is None else worker.call(fn, timeout)

    on_start("load")
    try:
        plugin = call(lambda: load_plugin(path))
    except _Hung as exc:
        report.hung = exc.api
        report.add("load", FAIL, f"{exc} (the row timeout): the plugin hangs")
        return
    except (PluginError, OSError, ValueError) as exc:
        report.add("load", FAIL, str(exc))
        return
    version = ".".join(map(str, plugin.version))
    report.add("load", PASS, f"device type {plugin.name} ({plugin.sub_device_type or 'no sub type'}), "
                             f"ABI {version}; required APIs present")
    c = _Checker(plugin, device_index)
    steps = _steps(c, ops)
    for k, (name, fn, uses) in enumerate(steps):
        on_start(name)
        try:
            rows = call(lambda name=name, fn=fn, uses=uses: c.run(name, fn, uses))
        except _Hung as exc:
            report.hung = exc.api
            report.add(name, FAIL, f"{exc} (the row timeout): the plugin hangs")
            for later, _, _ in steps[k + 1:]:
                report.add(later, SKIP, f"not run: the plugin hung in {exc.api}")
            return
        for row in rows:
            report.add(row.name, row.status, row.detail)
        if name == "devices" and rows[-1].status == FAIL:
            return
    if not ops:
        report.add("decoder layer vs CPU", SKIP, "not asked for (--no-ops)")
        report.add("model vs CPU", SKIP, "not asked for (--no-ops)")
        report.add("dispatch per token", SKIP, "not asked for (--no-ops)")


# ---- the command ------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The check's command-line arguments."""
    parser.add_argument("path", help="the plugin library (lib*.so)")
    parser.add_argument("--device", type=int, default=0, metavar="INDEX", help="device index to check (default 0)")
    parser.add_argument("--no-ops", action="store_true", help="skip running ops and a model on the device")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help=f"fail a row that takes longer, naming the plugin API it is blocked in, and skip the "
                             f"rows after it (default {DEFAULT_TIMEOUT:g}; 0: no limit)")
    parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                        help=f"stop the checking process after this long in all, failing the row it was in "
                             f"(default {DEADLINE_PER_TIMEOUT} x --timeout, or {DEFAULT_DEADLINE:g} without one; 0: none)")
    parser.add_argument("--in-process", action="store_true",
                        help="run in this process (by default a child process runs the check, so that a "
                             "plugin that crashes or hangs is reported rather than taking the command down)")
    parser.add_argument("--report-fd", type=int, default=None, help=argparse.SUPPRESS)  # the child's rows, as JSON lines
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (repeat for debug)")


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming an option with a value out of range."""
    if args.device < 0:
        raise ValueError(f"--device must be >= 0, got {args.device}")
    if args.timeout < 0:
        raise ValueError(f"--timeout must be >= 0 seconds, got {args.timeout:g}")
    if args.deadline is not None and args.deadline < 0:
        raise ValueError(f"--deadline must be >= 0 seconds, got {args.deadline:g}")


def deadline(args: argparse.Namespace) -> float:
    """Seconds the whole check may take (0: no deadline), from ``--deadline`` or ``--timeout``."""
    if args.deadline is not None:
        return args.deadline
    return DEADLINE_PER_TIMEOUT * args.timeout if args.timeout else DEFAULT_DEADLINE


def child_command(args: argparse.Namespace, report_fd: int) -> list[str]:
    """The command that runs the check for ``args`` in a child process, writing its rows as
    JSON lines to ``report_fd`` (``{"start": name}``, ``{"row": [name, status, detail]}``,
    then ``{"end": ok}``)."""
    return [sys.executable, "-m", "llaisys.tools.plugin_check", "--report-fd", str(report_fd), os.fspath(args.path),
            "--device", str(args.device), "--timeout", repr(args.timeout), *(["--no-ops"] if args.no_ops else []),
            *(["-v"] * args.verbose)]


def run_cli(args: argparse.Namespace) -> int:
    """Run the check for parsed ``args`` in this process, printing the table as it goes (or,
    with ``--report-fd``, writing rows for a parent); returns the exit status: 0 when
    nothing failed, 1 otherwise. ``llaisys plugin check`` runs this in a child process."""
    check_args(args)
    if args.report_fd is not None:
        return _run_as_child(args)
    print(CheckReport(os.fspath(args.path)).header(), flush=True)
    report = run_check(args.path, args.device, ops=not args.no_ops, timeout=args.timeout,
                       on_row=lambda row: print(format_row(row), flush=True))
    print(report.summary(), flush=True)
    return 0 if report.ok else 1


def _run_as_child(args: argparse.Namespace) -> int:
    """The child's side: rows as JSON lines on ``--report-fd`` for the parent to print."""
    with os.fdopen(args.report_fd, "w", encoding="utf-8", buffering=1) as out:
        emit = lambda event: out.write(json.dumps(event) + "\n")  # noqa: E731
        report = run_check(args.path, args.device, ops=not args.no_ops, timeout=args.timeout,
                           on_row=lambda row: emit({"row": [row.name, row.status, row.detail]}),
                           on_start=lambda name: emit({"start": name}))
        emit({"end": report.ok})
    if report.hung is not None:
        # A thread is blocked in the plugin for good: leave without the plugins' exit-time work.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m llaisys.tools.plugin_check PATH``: run the check in this process and print
    the report; 1 when a check failed (``llaisys plugin check`` adds the child process)."""
    parser = argparse.ArgumentParser(prog="python -m llaisys.tools.plugin_check", description="Check a device plugin library.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose <= 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return run_cli(args)
    except ValueError as exc:
        print(f"llaisys plugin check: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
