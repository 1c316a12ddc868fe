"""A caching allocator: carves blocks out of large device chunks and keeps freed blocks for reuse.

Requests are padded by ``extra_padding_size`` and rounded up to ``min_chunk_size``. Requests
larger than ``max_chunk_size`` go straight to the device. Others are served best-fit from free
blocks; when none fits, a new chunk is taken from the device (``init_alloc_size`` the first
time, ``realloc_size`` after, or the request if larger). A freed block merges with free
neighbours in its chunk. On out-of-memory the cache is emptied and the request tried once more.
"""
from __future__ import annotations

import bisect
import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from .errors import OutOfMemoryError
from .interface import AllocatorSizes


class _Chunk:
    """One allocation from the device, split into blocks."""

    __slots__ = ("ptr", "size", "free_bytes", "head")

    def __init__(self, ptr: int, size: int):
        self.ptr = ptr
        self.size = size
        self.free_bytes = size
        self.head = _Block(self, ptr, size)


class _Block:
    """A piece of a chunk; neighbours in address order are linked for coalescing."""

    __slots__ = ("chunk", "ptr", "size", "free", "prev", "next")

    def __init__(self, chunk: _Chunk, ptr: int, size: int, prev: "_Block | None" = None, nxt: "_Block | None" = None):
        self.chunk = chunk
        self.ptr = ptr
        self.size = size
        self.free = True
        self.prev = prev
        self.next = nxt


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
    """Caching allocator over a device's raw ``allocate``/``deallocate`` functions.

    ``raw_alloc(nbytes) -> ptr`` raises OutOfMemoryError when the device is full;
    ``raw_free(ptr, nbytes)`` gives memory back. Thread-safe.
    """

    def __init__(
        self,
        raw_alloc: Callable[[int], int],
        raw_free: Callable[[int, int], None],
        sizes: AllocatorSizes,
        name: str = "device",
    ):
        if sizes.min_chunk_size <= 0:
            raise ValueError(f"{name}: min_chunk_size must be positive, got {sizes.min_chunk_size}")
        if sizes.extra_padding_size < 0:
            raise ValueError(f"{name}: extra_padding_size must be >= 0, got {sizes.extra_padding_size}")
        self._raw_alloc = raw_alloc
        self._raw_free = raw_free
        self.sizes = sizes
        self.name = name
        # Reentrant: a Storage finalizer run by the garbage collector inside malloc frees on the
        # same thread; such frees wait in _deferred until the outer call is done with the lists.
        self._lock = threading.RLock()
        self._busy = False
        self._deferred: list[int] = []
        self._chunks: list[_Chunk] = []
        # Free blocks by size: the sorted distinct sizes for best fit, and the blocks of each.
        self._free_sizes: list[int] = []
        self._free_by_size: dict[int, dict[_Block, None]] = {}
        self._live: dict[int, tuple[_Block | None, int, int]] = {}  # ptr -> (block, size, requested)
        self._stats = AllocatorStats()

    # ---- public ----------------------------------------------------------------------
    def round_size(self, nbytes: int) -> int:
        """The size a request of ``nbytes`` really takes: ``nbytes`` (at least 1) plus the
        padding, rounded up to a multiple of ``min_chunk_size``."""
        m = self.sizes.min_chunk_size
        n = (nbytes or 1) + self.sizes.extra_padding_size
        return (n + m - 1) // m * m

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns a device pointer. Raises OutOfMemoryError when the
        device cannot provide it even after the cache is emptied."""
        if nbytes < 0:
            raise ValueError(f"{self.name}: cannot allocate a negative size ({nbytes})")
        size = self.round_size(nbytes)
        with self._exclusive():
            st = self._stats
            if size > self.sizes.max_chunk_size:
                ptr = self._device_alloc(size)
                self._live[ptr] = (None, size, nbytes)
                self._reserve(size)
            else:
                block = self._take_block(size)
                ptr = block.ptr
                self._live[ptr] = (block, size, nbytes)
            st.allocated += size
            st.requested += nbytes
            st.num_allocs += 1
            if st.allocated > st.peak_allocated:
                st.peak_allocated = st.allocated
            return ptr

    def free(self, ptr: int) -> None:
        """Return memory from ``malloc`` to the cache (direct allocations go back to the device).
        Called from inside another call of this allocator on the same thread (a finalizer the
        garbage collector ran there), it is done when that call ends."""
        with self._lock:
            if self._busy:
                self._deferred.append(ptr)
                return
        with self._exclusive():
            self._free(ptr)

    def _free(self, ptr: int) -> None:
        with self._lock:
            try:
                block, size, requested = self._live.pop(ptr)
            except KeyError:
                raise ValueError(f"{self.name}: pointer {ptr:#x} was not allocated here or is freed") from None
            st = self._stats
            st.allocated -= size
            st.requested -= requested
            if block is None:
                self._raw_free(ptr, size)
                st.reserved -= size
                return
            block.free = True
            block.chunk.free_bytes += block.size
            self._push_free(self._merge(block))

    def empty_cache(self) -> int:
        """Give every wholly free chunk back to the device; returns the bytes released."""
        with self._exclusive():
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
    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the lock for a call that changes the lists; the frees deferred meanwhile run
        before it lets go (still marked busy, so frees they set off wait their turn too)."""
        with self._lock:
            if self._busy:
                raise RuntimeError(f"{self.name}: an allocation from inside the allocator (a finalizer that allocates)")
            self._busy = True
            try:
                yield
            finally:
                try:
                    while self._deferred:
                        self._free(self._deferred.pop())
                finally:
                    self._busy = False

    def _device_alloc(self, size: int) -> int:
        cap = self.sizes.max_alloc_size
        if cap and self._stats.reserved + size > cap:
            self._release_free_chunks()
            if self._stats.reserved + size > cap:
                raise OutOfMemoryError(
                    self.name, "allocate",
                    f"{size} bytes would exceed the device's max_alloc_size of {cap} "
                    f"({self._stats.reserved} reserved)",
                )
        try:
            ptr = self._raw_alloc(size)
        except OutOfMemoryError:
            self._release_free_chunks()
            ptr = self._raw_alloc(size)  # once more; a second failure propagates
        self._stats.num_device_allocs += 1
        return ptr

    def _take_block(self, size: int) -> _Block:
        sizes = self._free_sizes
        i = bisect.bisect_left(sizes, size)
        if i < len(sizes):
            fit = sizes[i]
            bucket = self._free_by_size[fit]
            block = bucket.popitem()[0]
            if not bucket:
                del self._free_by_size[fit]
                del sizes[i]
        else:
            block = self._new_chunk(size).head
        if block.size > size:  # split; the rest stays free
            rest = _Block(block.chunk, block.ptr + size, block.size - size, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._push_free(rest)
        block.free = False
        block.chunk.free_bytes -= size
        return block

    def _new_chunk(self, size: int) -> _Chunk:
        grow = self.sizes.realloc_size if self._chunks else self.sizes.init_alloc_size
        chunk_size = max(size, grow)
        chunk = _Chunk(self._device_alloc(chunk_size), chunk_size)
        self._chunks.append(chunk)
        self._stats.num_chunks += 1
        self._reserve(chunk_size)
        return chunk

    def _reserve(self, size: int) -> None:
        """Count ``size`` more bytes held from the device (a chunk or a direct allocation)."""
        st = self._stats
        st.reserved += size
        if st.reserved > st.peak_reserved:
            st.peak_reserved = st.reserved

    def _push_free(self, block: _Block) -> None:
        bucket = self._free_by_size.get(block.size)
        if bucket is None:
            self._free_by_size[block.size] = {block: None}
            bisect.insort(self._free_sizes, block.size)
        else:
            bucket[block] = None

    def _remove_free(self, block: _Block) -> None:
        bucket = self._free_by_size[block.size]
        del bucket[block]
        if not bucket:
            del self._free_by_size[block.size]
            del self._free_sizes[bisect.bisect_left(self._free_sizes, block.size)]

    def _merge(self, block: _Block) -> _Block:
        """``block`` joined with its free neighbours (taken off the free lists); the block that remains."""
        nxt, prv = block.next, block.prev
        if nxt is not None and nxt.free:
            self._remove_free(nxt)
            self._absorb(block, nxt)
        if prv is not None and prv.free:
            self._remove_free(prv)
            self._absorb(prv, block)
            block = prv
        return block

    @staticmethod
    def _absorb(block: _Block, nxt: _Block) -> None:
        """Grow ``block`` over ``nxt``, the block after it, and unlink ``nxt``."""
        block.size += nxt.size
        block.next = nxt.next
        if nxt.next is not None:
            nxt.next.prev = block

    def _release_free_chunks(self) -> int:
        released = 0
        for chunk in [c for c in self._chunks if c.free_bytes == c.size]:
            # A wholly free chunk has merged back into its single head block.
            self._remove_free(chunk.head)
            self._chunks.remove(chunk)
            self._raw_free(chunk.ptr, chunk.size)
            self._stats.reserved -= chunk.size
            self._stats.num_chunks -= 1
            released += chunk.size
        return released
