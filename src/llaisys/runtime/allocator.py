"""A caching allocator: carves blocks out of large device chunks and keeps freed blocks for reuse.

Requests are padded by ``extra_padding_size`` and rounded up to ``min_chunk_size``. Requests
larger than ``max_chunk_size`` go straight to the device. Others are served best-fit from free
blocks; when none fits, a new chunk is taken from the device (``init_alloc_size`` the first
time, ``realloc_size`` after, or the request if larger). A freed block merges with free
neighbours in its chunk. On out-of-memory the cache is emptied and the request tried once more.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Callable

from .errors import OutOfMemoryError
from .interface import AllocatorSizes


@dataclass(eq=False)
class _Block:
    chunk: "_Chunk"
    offset: int
    size: int
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None

    @property
    def ptr(self) -> int:
        return self.chunk.ptr + self.offset


@dataclass(eq=False)
class _Chunk:
    ptr: int
    size: int
    free_bytes: int = 0
    head: "_Block | None" = field(default=None, repr=False)


@dataclass
class AllocatorStats:
    """Byte counts of one allocator. ``allocated``: in live blocks (after rounding);
    ``reserved``: held from the device (chunks plus direct allocations); ``peak_allocated``:
    the highest ``allocated`` seen; ``requested``: sum of live request sizes before rounding."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    requested: int = 0
    num_allocs: int = 0
    num_device_allocs: int = 0
    num_chunks: int = 0


class CachingAllocator:
    """Caching allocator over a device's raw ``allocate``/``deallocate`` functions."""

    def __init__(
        self,
        raw_alloc: Callable[[int], int],
        raw_free: Callable[[int, int], None],
        sizes: AllocatorSizes,
        name: str = "device",
    ):
        if sizes.min_chunk_size <= 0:
            raise ValueError(f"{name}: min_chunk_size must be positive, got {sizes.min_chunk_size}")
        self._raw_alloc = raw_alloc
        self._raw_free = raw_free
        self.sizes = sizes
        self.name = name
        self._lock = threading.Lock()
        self._chunks: list[_Chunk] = []
        self._free: list[tuple[int, int, _Block]] = []  # sorted (size, seq, block)
        self._seq = 0
        self._live: dict[int, tuple[_Block | None, int, int]] = {}  # ptr -> (block, size, requested)
        self._stats = AllocatorStats()

    # ---- public ----------------------------------------------------------------------
    def round_size(self, nbytes: int) -> int:
        """The size a request of ``nbytes`` really takes."""
        m = self.sizes.min_chunk_size
        n = max(nbytes, 1) + self.sizes.extra_padding_size
        return (n + m - 1) // m * m

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns a device pointer."""
        if nbytes < 0:
            raise ValueError(f"{self.name}: cannot allocate a negative size ({nbytes})")
        size = self.round_size(nbytes)
        with self._lock:
            if size > self.sizes.max_chunk_size:
                ptr = self._device_alloc(size)
                self._live[ptr] = (None, size, nbytes)
                self._stats.reserved += size
            else:
                block = self._take_block(size)
                ptr = block.ptr
                self._live[ptr] = (block, size, nbytes)
            st = self._stats
            st.allocated += size
            st.requested += nbytes
            st.num_allocs += 1
            st.peak_allocated = max(st.peak_allocated, st.allocated)
            st.peak_reserved = max(st.peak_reserved, st.reserved)
            return ptr

    def free(self, ptr: int) -> None:
        """Return memory from ``malloc`` to the cache (direct allocations go back to the device)."""
        with self._lock:
            try:
                block, size, requested = self._live.pop(ptr)
            except KeyError:
                raise ValueError(f"{self.name}: pointer {ptr:#x} was not allocated here or is freed") from None
            self._stats.allocated -= size
            self._stats.requested -= requested
            if block is None:
                self._raw_free(ptr, size)
                self._stats.reserved -= size
                return
            block.free = True
            block.chunk.free_bytes += block.size
            block = self._merge(block)
            self._push_free(block)

    def empty_cache(self) -> int:
        """Give every wholly free chunk back to the device; returns the bytes released."""
        with self._lock:
            return self._release_free_chunks()

    def stats(self) -> AllocatorStats:
        """A snapshot of the byte counts."""
        with self._lock:
            return AllocatorStats(**vars(self._stats))

    def reset_peak(self) -> None:
        """Start peak tracking again from the current values."""
        with self._lock:
            self._stats.peak_allocated = self._stats.allocated
            self._stats.peak_reserved = self._stats.reserved

    # ---- internals -------------------------------------------------------------------
    def _device_alloc(self, size: int) -> int:
        cap = self.sizes.max_alloc_size
        for attempt in (0, 1):
            if cap and self._stats.reserved + size > cap and attempt == 0:
                self._release_free_chunks()
                continue
            if cap and self._stats.reserved + size > cap:
                raise OutOfMemoryError(
                    self.name, "allocate",
                    f"{size} bytes would exceed the device's max_alloc_size of {cap} "
                    f"({self._stats.reserved} reserved)",
                )
            try:
                ptr = self._raw_alloc(size)
                self._stats.num_device_allocs += 1
                return ptr
            except OutOfMemoryError:
                if attempt == 1 or not self._release_free_chunks():
                    raise
        raise AssertionError("unreachable")

    def _take_block(self, size: int) -> _Block:
        i = bisect.bisect_left(self._free, (size, -1))
        if i < len(self._free):
            block = self._free.pop(i)[2]
        else:
            first = not self._chunks and self._stats.num_chunks == 0
            grow = self.sizes.init_alloc_size if first else self.sizes.realloc_size
            chunk_size = max(size, min(grow, self.sizes.max_chunk_size) if grow else size)
            ptr = self._device_alloc(chunk_size)
            chunk = _Chunk(ptr, chunk_size, free_bytes=chunk_size)
            block = _Block(chunk, 0, chunk_size)
            chunk.head = block
            self._chunks.append(chunk)
            self._stats.reserved += chunk_size
            self._stats.num_chunks += 1
        if block.size > size:  # split; the rest stays free
            rest = _Block(block.chunk, block.offset + size, block.size - size, True, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._push_free(rest)
        block.free = False
        block.chunk.free_bytes -= block.size
        return block

    def _push_free(self, block: _Block) -> None:
        self._seq += 1
        bisect.insort(self._free, (block.size, self._seq, block))

    def _remove_free(self, block: _Block) -> None:
        for i in range(bisect.bisect_left(self._free, (block.size, -1)), len(self._free)):
            if self._free[i][2] is block:
                del self._free[i]
                return
        raise AssertionError("free block missing from the free list")

    def _merge(self, block: _Block) -> _Block:
        nxt = block.next
        if nxt is not None and nxt.free:
            self._remove_free(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        prv = block.prev
        if prv is not None and prv.free:
            self._remove_free(prv)
            prv.size += block.size
            prv.next = block.next
            if block.next is not None:
                block.next.prev = prv
            block = prv
        return block

    def _release_free_chunks(self) -> int:
        released = 0
        for chunk in list(self._chunks):
            if chunk.free_bytes == chunk.size:
                self._remove_free(chunk.head)
                self._raw_free(chunk.ptr, chunk.size)
                self._chunks.remove(chunk)
                self._stats.reserved -= chunk.size
                self._stats.num_chunks -= 1
                released += chunk.size
        return released
