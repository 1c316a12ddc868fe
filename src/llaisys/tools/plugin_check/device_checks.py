"""The rows themselves: each exercises one part of the device API (or runs the workloads) with
data verified on the host, asking only what the plugin contract allows."""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ...plugins import PluginError
from ...runtime.allocator import CachingAllocator
from ...runtime.dtypes import MemcpyKind
from ...runtime.errors import OutOfMemoryError
from ...runtime.interface import AllocatorSizes
from .report import FAIL, FALLBACK, PASS, SKIP, CheckRow, Skip
from .workloads import MODEL_SHAPES, decoder_layer_bytes, decoder_layer_chain, dispatch_run, model_bytes, random_model_run

log = logging.getLogger(__name__)

OPS = ("embedding", "rms_norm", "linear", "rope", "self_attention", "add", "swiglu", "argmax", "rearrange")


class HostBuffers:
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


class Checker:
    def __init__(self, plugin: Any, index: int):
        self.plugin = plugin
        self.b = plugin.backend
        self.i = index
        self.device = f"{plugin.name}:{index}"
        self.host = HostBuffers()
        self.fallbacks = set(self.b.fallbacks())
        self._allocs: list[tuple[int, int]] = []
        self._sizes: AllocatorSizes | None = None

    # ---- plumbing --------------------------------------------------------------------------
    def run(self, name: str, fn: Callable[[], str], uses: Sequence[str] = ()) -> list[CheckRow]:
        """Run one check; it returns a detail string or raises (Skip: the row is skipped).
        ``uses``: optional APIs whose absence turns a pass into a fallback. Returns the row,
        after a row for each free that failed."""
        missing = [a for a in uses if a in self.fallbacks]
        try:
            detail = fn()
            status = FALLBACK if missing else PASS
            if missing:
                detail = (detail + "; " if detail else "") + "fallback for " + ", ".join(missing)
        except Skip as exc:
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
        once aligned; raises Skip when that is below ``least``."""
        budget = self.limit() // count
        m, pad = self.sizes.min_chunk_size, self.sizes.extra_padding_size
        n = min(want, budget // m * m - pad)
        if n < least:
            raise Skip(f"needs {count} x {self.aligned(least)} bytes; the device offers {self._offer(budget * count)}")
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
            raise Skip(f"not even {self.aligned(1)} bytes fit in the {offer} the device offers")
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
        """Raise Skip unless the caching allocator could hold ``nbytes`` at once in the
        device's free memory."""
        need = reserved_for(self.sizes, nbytes)
        room = self.limit(share=1.0)
        if need is None or need > room:
            amount = f"more than {_kib(self.sizes.max_alloc_size)}" if need is None else f"about {_kib(need)}"
            raise Skip(f"{what} needs {amount} of device memory; the device offers {self._offer(room)}")

    def _on_device(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, with the device's caching allocator emptied after; running out of device
        memory skips the row (the device is too small, not wrong)."""
        from ...runtime.runtime import get_runtime

        try:
            return fn()
        except OutOfMemoryError as exc:
            raise Skip(f"{what} ran out of device memory: {exc}") from exc
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
            except Skip:
                continue
        self._room(f"the smallest random model ({MODEL_SHAPES[-1]['layers']} layer)", model_bytes(MODEL_SHAPES[-1]))
        return MODEL_SHAPES[-1]
