"""The device interface every backend implements (the built-in CPU one included).

It mirrors the runtime table of ``runtime.h`` and the plugin ABI's ``C_DeviceInterface``:
device count and selection, synchronisation, streams, events, host callbacks, device and host
memory, memset, copies in four directions (sync and async) and memory information.

Pointers are plain integers. A device pointer is opaque: nothing on the host may read or write
it except through this interface's copy functions. Streams and events are opaque handles the
backend made.

A backend implements the methods marked *required*. The others have working defaults here
that fall back to synchronous behaviour, as the ABI allows:

=====================  ==============================================================
optional API missing   fallback
=====================  ==============================================================
async copies           synchronise the stream, then copy synchronously
memset                 H2D copy of a host buffer filled with the value
host allocate/free     ordinary (pageable) host memory
streams                one implicit stream; work runs synchronously
events                 recorded after synchronising the stream; always complete
callbacks              synchronise the stream, then call
allocator sizes        ``DEFAULT_ALLOCATOR_SIZES``
=====================  ==============================================================
"""
from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .device import DeviceType
from .dtypes import MemcpyKind

MiB = 1 << 20


@dataclass(frozen=True)
class AllocatorSizes:
    """How a device's caching allocator grows and rounds (all in bytes).

    ``min_chunk_size``: every request is rounded up to a multiple of it (after adding
    ``extra_padding_size``). Requests above ``max_chunk_size`` bypass the cache. The first
    chunk is ``init_alloc_size`` bytes, later ones ``realloc_size`` (or the request, if larger).
    ``max_alloc_size`` caps the memory the allocator will hold (0: no cap).
    """

    min_chunk_size: int
    max_chunk_size: int
    max_alloc_size: int
    extra_padding_size: int
    init_alloc_size: int
    realloc_size: int


DEFAULT_ALLOCATOR_SIZES = AllocatorSizes(
    min_chunk_size=256,
    max_chunk_size=64 * MiB,
    max_alloc_size=0,
    extra_padding_size=0,
    init_alloc_size=64 * MiB,
    realloc_size=64 * MiB,
)


class SyncEvent:
    """The event a backend without events hands out: complete once recorded."""

    __slots__ = ("recorded",)

    def __init__(self) -> None:
        self.recorded = False


class DeviceBackend(ABC):
    """One device type's table of runtime functions. All methods take the device index."""

    #: The device type this backend serves.
    device_type: DeviceType

    #: Human-readable origin (e.g. a plugin's library path), used in error messages.
    origin: str = "built-in"

    # ---- device ---------------------------------------------------------------------
    @abstractmethod
    def device_count(self) -> int:
        """Number of devices of this type (required)."""

    def set_device(self, index: int) -> None:
        """Make ``index`` the backend's current device for the calling thread."""

    def synchronize_device(self, index: int) -> None:
        """Block until all work on device ``index`` is done."""

    # ---- streams --------------------------------------------------------------------
    def create_stream(self, index: int) -> Any:
        """A new stream handle (an ordered queue of work)."""
        return None

    def destroy_stream(self, index: int, stream: Any) -> None:
        """Release a stream made by ``create_stream``."""

    def synchronize_stream(self, index: int, stream: Any) -> None:
        """Block until all work queued on ``stream`` is done."""
        self.synchronize_device(index)

    def query_stream(self, index: int, stream: Any) -> bool:
        """True when all work on ``stream`` is done (a synchronize when the API is missing)."""
        self.synchronize_stream(index, stream)
        return True

    def stream_add_callback(self, index: int, stream: Any, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the host after the work queued before it on ``stream``."""
        self.synchronize_stream(index, stream)
        callback()

    # ---- events ---------------------------------------------------------------------
    def create_event(self, index: int) -> Any:
        """A new event handle."""
        return SyncEvent()

    def destroy_event(self, index: int, event: Any) -> None:
        """Release an event made by ``create_event``."""

    def record_event(self, index: int, stream: Any, event: Any) -> None:
        """Mark ``event`` complete once the work queued so far on ``stream`` is done."""
        self.synchronize_stream(index, stream)
        event.recorded = True

    def query_event(self, index: int, event: Any) -> bool:
        """True when ``event`` is complete."""
        return True

    def synchronize_event(self, index: int, event: Any) -> None:
        """Block until ``event`` is complete."""

    def stream_wait_event(self, index: int, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event``."""
        self.synchronize_event(index, event)

    # ---- memory ---------------------------------------------------------------------
    @abstractmethod
    def allocate(self, index: int, nbytes: int) -> int:
        """Allocate ``nbytes`` of device memory; returns an opaque pointer (required).

        Raises OutOfMemoryError when the device has no room.
        """

    @abstractmethod
    def deallocate(self, index: int, ptr: int, nbytes: int) -> None:
        """Free device memory from ``allocate`` (required)."""

    def host_allocate(self, index: int, nbytes: int) -> int:
        """Allocate host memory suited to copies with this device (pinned where possible)."""
        buf = np.empty(max(nbytes, 1) + 64, dtype=np.uint8)
        ptr = (buf.ctypes.data + 63) & ~63
        self.__host_buffers()[ptr] = buf
        return ptr

    def host_deallocate(self, index: int, ptr: int, nbytes: int) -> None:
        """Free host memory from ``host_allocate``."""
        self.__host_buffers().pop(ptr, None)

    def __host_buffers(self) -> dict:
        try:
            return self.__dict__["_fallback_host_buffers"]
        except KeyError:
            return self.__dict__.setdefault("_fallback_host_buffers", {})

    @abstractmethod
    def copy_h2d(self, index: int, dst: int, src: int, nbytes: int) -> None:
        """Synchronous copy from host address ``src`` to device pointer ``dst`` (required)."""

    @abstractmethod
    def copy_d2h(self, index: int, dst: int, src: int, nbytes: int) -> None:
        """Synchronous copy from device pointer ``src`` to host address ``dst`` (required)."""

    @abstractmethod
    def copy_d2d(self, index: int, dst: int, src: int, nbytes: int) -> None:
        """Synchronous copy between two pointers of device ``index`` (required)."""

    def copy_async(self, index: int, dst: int, src: int, nbytes: int, kind: MemcpyKind, stream: Any) -> None:
        """Copy queued on ``stream`` (H2D, D2H or D2D); falls back to a synchronous copy."""
        self.synchronize_stream(index, stream)
        self.copy(index, dst, src, nbytes, kind)

    def copy(self, index: int, dst: int, src: int, nbytes: int, kind: MemcpyKind) -> None:
        """Synchronous copy in the direction ``kind``."""
        if kind == MemcpyKind.H2D:
            self.copy_h2d(index, dst, src, nbytes)
        elif kind == MemcpyKind.D2H:
            self.copy_d2h(index, dst, src, nbytes)
        elif kind == MemcpyKind.D2D:
            self.copy_d2d(index, dst, src, nbytes)
        else:
            ctypes.memmove(dst, src, nbytes)

    def memset(self, index: int, ptr: int, value: int, nbytes: int) -> None:
        """Fill ``nbytes`` at device pointer ``ptr`` with byte ``value``."""
        host = np.full(nbytes, value, dtype=np.uint8)
        self.copy_h2d(index, ptr, host.ctypes.data, nbytes)

    @abstractmethod
    def memory_stats(self, index: int) -> tuple[int, int]:
        """``(total_bytes, free_bytes)`` of device ``index`` (required)."""

    def allocator_sizes(self, index: int) -> AllocatorSizes:
        """How the caching allocator of device ``index`` should grow and round."""
        return DEFAULT_ALLOCATOR_SIZES

    # ---- capability report ----------------------------------------------------------
    def fallbacks(self) -> list[str]:
        """Names of optional APIs this backend lacks and that run on the fallback above."""
        return []

    def host_view(self, ptr: int, nbytes: int) -> np.ndarray:
        """A uint8 NumPy view of device memory. Only backends whose memory is host memory
        (the CPU) may provide it; others raise TypeError."""
        raise TypeError(f"memory of {self.device_type.name} devices is not host-addressable")
