"""Storage: a block of one device's memory, shared by every tensor view of it."""
from __future__ import annotations

import ctypes

import numpy as np

from ..runtime.device import Device
from ..runtime.runtime import Runtime


class Storage:
    """``nbytes`` of memory at ``ptr`` on ``runtime``'s device, from its caching allocator.

    Freed back to the allocator when the last tensor using it goes away.
    """

    __slots__ = ("runtime", "ptr", "nbytes", "__weakref__")

    def __init__(self, runtime: Runtime, nbytes: int):
        self.runtime = runtime
        self.nbytes = nbytes
        self.ptr = runtime.malloc(nbytes)

    @property
    def device(self) -> Device:
        """The device this memory lives on."""
        return self.runtime.device

    def host_buffer(self) -> ctypes.Array:
        """The storage as a ctypes byte array over its memory, without a copy (CPU storage
        only). It keeps this storage alive, and so does any NumPy array made from it."""
        if not self.runtime.is_cpu:
            raise TypeError(f"storage on {self.device} is not host-addressable; copy it to the CPU first")
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        raw.owner = self  # ties the storage's life to the buffer and its users
        return raw

    def host_bytes(self) -> np.ndarray:
        """The storage as a uint8 NumPy array (nbytes,), without a copy (CPU storage only).
        The array keeps this storage alive."""
        return np.frombuffer(self.host_buffer(), dtype=np.uint8)

    def __del__(self) -> None:
        try:
            self.runtime.free(self.ptr)
        except Exception:  # interpreter shutdown: the allocator may be gone
            pass
