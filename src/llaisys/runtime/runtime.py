"""One Runtime per device: the backend's functions bound to a device index, plus its allocator.

Every layer above reaches a device only through its Runtime. Backend failures are re-raised
as DeviceError naming the device and the API.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .allocator import AllocatorStats, CachingAllocator
from .backends import get_backend
from .device import Device, as_device
from .dtypes import MemcpyKind
from .errors import DeviceError, LlaisysError
from .interface import DeviceBackend
from .stream import Event, Stream


class Runtime:
    """The runtime of one device (``cpu:0``, ``custom_cpu:1``)."""

    def __init__(self, device: Device, backend: DeviceBackend):
        count = backend.device_count()
        if not 0 <= device.index < count:
            raise ValueError(f"device {device} does not exist; {device.type.name} has {count} device(s)")
        self.device = device
        self.backend = backend
        self.index = device.index
        self.is_cpu = device.is_cpu
        sizes = self._call("allocator_sizes")
        self.allocator = CachingAllocator(
            lambda n: self._call("allocate", n),
            lambda p, n: self._call("deallocate", p, n),
            sizes,
            name=str(device),
        )
        self.default_stream = Stream(self, None, owned=False)

    def _call(self, api: str, *args: Any) -> Any:
        try:
            return getattr(self.backend, api)(self.index, *args)
        except LlaisysError:
            raise
        except Exception as exc:
            raise DeviceError(self.device, api, f"{type(exc).__name__}: {exc}") from exc

    # ---- device -----------------------------------------------------------------------
    def activate(self) -> None:
        """Make this device the backend's current one (``set_device``)."""
        self._call("set_device")

    def synchronize(self) -> None:
        """Block until all work on this device is done."""
        self._call("synchronize_device")

    def create_stream(self) -> Stream:
        """A new stream on this device."""
        return Stream(self)

    def create_event(self) -> Event:
        """A new event on this device."""
        return Event(self)

    # ---- memory -----------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        """Device memory of at least ``nbytes`` from the caching allocator."""
        return self.allocator.malloc(nbytes)

    def free(self, ptr: int) -> None:
        """Return memory from ``malloc``."""
        self.allocator.free(ptr)

    def malloc_host(self, nbytes: int) -> int:
        """Host memory suited to copies with this device."""
        return self._call("host_allocate", nbytes)

    def free_host(self, ptr: int, nbytes: int) -> None:
        self._call("host_deallocate", ptr, nbytes)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        """Fill ``nbytes`` of device memory with byte ``value``."""
        if not 0 <= value <= 255:
            raise ValueError(f"memset value must be a byte (0..255), got {value}")
        if nbytes:
            self._call("memset", ptr, value, nbytes)

    def memcpy(self, dst: int, src: int, nbytes: int, kind: MemcpyKind) -> None:
        """Synchronous copy of ``nbytes`` (host addresses and device pointers as ``kind`` says)."""
        if nbytes:
            self._call("copy", dst, src, nbytes, MemcpyKind(kind))

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: MemcpyKind, stream: Stream | None = None) -> None:
        """Copy queued on ``stream`` (the default stream when None)."""
        if nbytes:
            handle = None if stream is None else stream.handle
            self._call("copy_async", dst, src, nbytes, MemcpyKind(kind), handle)

    def host_view(self, ptr: int, nbytes: int) -> np.ndarray:
        """uint8 view of device memory; only for host-addressable devices (the CPU)."""
        return self.backend.host_view(ptr, nbytes)

    def memory_stats(self) -> dict[str, int]:
        """Device totals and this runtime's allocator counts, in bytes."""
        total, free = self._call("memory_stats")
        stats: AllocatorStats = self.allocator.stats()
        return {"total": total, "free": free, **vars(stats)}

    def empty_cache(self) -> int:
        """Release cached, unused device memory; returns the bytes released."""
        return self.allocator.empty_cache()

    def __repr__(self) -> str:
        return f"Runtime({self.device}, {self.backend.origin})"


_lock = threading.Lock()
_runtimes: dict[Device, Runtime] = {}


def get_runtime(device: "Device | str | None" = None) -> Runtime:
    """The Runtime of ``device`` (default: the current device), created on first use."""
    dev = as_device(device)
    rt = _runtimes.get(dev)
    if rt is not None:
        return rt
    with _lock:
        rt = _runtimes.get(dev)
        if rt is None:
            rt = Runtime(dev, get_backend(dev.type))
            _runtimes[dev] = rt
        return rt


def drop_runtimes(device_type_name: str) -> None:
    """Forget the runtimes of one device type (when its plugin is unloaded)."""
    with _lock:
        for dev in [d for d in _runtimes if d.type.name == device_type_name]:
            del _runtimes[dev]


def synchronize(device: "Device | str | None" = None) -> None:
    """Block until all work on ``device`` (default: current) is done."""
    get_runtime(device).synchronize()
