"""The built-in CPU backend: host memory, and streams run by worker threads.

A stream is an ordered queue served by one worker thread, so async copies and callbacks run
in the order they were queued; an event is complete when its stream reaches it.
"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
import weakref
from typing import Any, Callable

import numpy as np

from ..runtime.device import DeviceType
from ..runtime.dtypes import MemcpyKind
from ..runtime.errors import OutOfMemoryError
from ..runtime.interface import MiB, AllocatorSizes, DeviceBackend

_ALIGN = 64


class CpuStream:
    """An ordered work queue with its own worker thread."""

    def __init__(self) -> None:
        self._tasks: "queue.Queue[Callable[[], None] | None]" = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="llaisys-cpu-stream", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        """Queue ``task`` after everything queued before it."""
        with self._idle:
            self._pending += 1
        self._tasks.put(task)

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            try:
                task()
            except BaseException as exc:  # kept and re-raised on the next synchronize
                self.error = exc
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def synchronize(self) -> None:
        """Block until the queue is empty; re-raise the first error a task raised since."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def done(self) -> bool:
        """True when every queued task has run."""
        with self._idle:
            return self._pending == 0

    def close(self) -> None:
        """Finish the queued work and stop the worker thread."""
        try:
            self.synchronize()
        finally:
            self._tasks.put(None)
            self._thread.join()


class CpuEvent:
    """Complete when the stream it was recorded on has run everything queued before it.

    Each record starts a new flag, so a wait queued earlier waits for the record it saw
    (as with CUDA events), not for a later one.
    """

    def __init__(self) -> None:
        self.done = threading.Event()
        self.done.set()  # a never-recorded event counts as complete, as in CUDA

    def record(self, stream: CpuStream | None) -> None:
        """Complete once ``stream`` (None: the host, at once) has run the work queued so far."""
        done = threading.Event()
        if stream is None:
            done.set()
        else:
            stream.submit(done.set)
        self.done = done


class CpuBackend(DeviceBackend):
    """Host memory as a device. One device (``cpu:0``)."""

    device_type = DeviceType.CPU

    def __init__(self) -> None:
        self._buffers: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self._streams: "weakref.WeakSet[CpuStream]" = weakref.WeakSet()

    def device_count(self) -> int:
        return 1

    def synchronize_device(self, index: int) -> None:
        # Kernels run synchronously on the calling thread; only stream work can be pending.
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.synchronize()

    # ---- streams and events ------------------------------------------------------------
    def create_stream(self, index: int) -> CpuStream:
        stream = CpuStream()
        with self._lock:
            self._streams.add(stream)
        return stream

    def destroy_stream(self, index: int, stream: CpuStream | None) -> None:
        if stream is not None:
            stream.close()

    def synchronize_stream(self, index: int, stream: CpuStream | None) -> None:
        if stream is not None:
            stream.synchronize()

    def query_stream(self, index: int, stream: CpuStream | None) -> bool:
        return stream is None or stream.done()

    def stream_add_callback(self, index: int, stream: CpuStream | None, callback: Callable[[], None]) -> None:
        if stream is None:
            callback()
        else:
            stream.submit(callback)

    def create_event(self, index: int) -> CpuEvent:
        return CpuEvent()

    def record_event(self, index: int, stream: CpuStream | None, event: CpuEvent) -> None:
        event.record(stream)

    def query_event(self, index: int, event: CpuEvent) -> bool:
        return event.done.is_set()

    def synchronize_event(self, index: int, event: CpuEvent) -> None:
        event.done.wait()

    def stream_wait_event(self, index: int, stream: CpuStream | None, event: CpuEvent) -> None:
        if stream is None:
            event.done.wait()
        else:
            stream.submit(event.done.wait)

    # ---- memory ------------------------------------------------------------------------
    def allocate(self, index: int, nbytes: int) -> int:
        try:
            buf = np.empty(nbytes + _ALIGN, dtype=np.uint8)
        except MemoryError:
            raise OutOfMemoryError("cpu:0", "allocate", f"no host memory for {nbytes} bytes") from None
        ptr = (buf.ctypes.data + _ALIGN - 1) & ~(_ALIGN - 1)
        with self._lock:
            self._buffers[ptr] = buf
        return ptr

    def deallocate(self, index: int, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._buffers.pop(ptr)

    host_allocate = allocate
    host_deallocate = deallocate

    def copy_h2d(self, index: int, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    copy_d2h = copy_h2d
    copy_d2d = copy_h2d

    def copy_async(self, index: int, dst: int, src: int, nbytes: int, kind: MemcpyKind, stream: Any) -> None:
        if stream is None:
            ctypes.memmove(dst, src, nbytes)
        else:
            stream.submit(lambda: ctypes.memmove(dst, src, nbytes))

    def memset(self, index: int, ptr: int, value: int, nbytes: int) -> None:
        ctypes.memset(ptr, value, nbytes)

    def memory_stats(self, index: int) -> tuple[int, int]:
        try:
            pages, avail = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
            size = os.sysconf("SC_PAGE_SIZE")
            return pages * size, avail * size
        except (ValueError, OSError, AttributeError):
            return 0, 0

    def allocator_sizes(self, index: int) -> AllocatorSizes:
        # Large tensors (weights) go straight to NumPy; small ones share 16 MiB chunks.
        return AllocatorSizes(
            min_chunk_size=_ALIGN, max_chunk_size=4 * MiB, max_alloc_size=0,
            extra_padding_size=0, init_alloc_size=16 * MiB, realloc_size=16 * MiB,
        )

    def host_view(self, ptr: int, nbytes: int) -> np.ndarray:
        return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=np.uint8)


def create_backend() -> CpuBackend:
    """Entry point used by the backend registry."""
    return CpuBackend()
