"""Storage: a block of one device's memory, shared by every tensor view of it."""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

from ..runtime.device import Device, as_device
from ..runtime.dtypes import MemcpyKind
from ..runtime.runtime import Runtime, get_runtime


_CPU = as_device("cpu")


class FrozenTensorError(ValueError):
    """A write into frozen (read-only) storage, such as a model's weights."""


class Storage:
    """``nbytes`` of memory at ``ptr`` on ``runtime``'s device, from its caching allocator.

    Freed back to the allocator when the last tensor using it goes away. A frozen storage is
    read-only for good (``freeze``); off the CPU it keeps a host copy of its bytes once one is
    asked for (``host_copy``), freed with it.
    """

    __slots__ = ("runtime", "ptr", "nbytes", "frozen", "_host", "_buffer", "__weakref__")

    def __init__(self, runtime: Runtime, nbytes: int):
        self.runtime = runtime
        self.nbytes = nbytes
        self.frozen = False
        self._host: Storage | None = None
        self._buffer: np.ndarray | None = None  # set for host scratch, which NumPy owns
        self.ptr = runtime.malloc(nbytes)

    @classmethod
    def host_scratch(cls, nbytes: int) -> "Storage":
        """CPU storage of ``nbytes`` over a new NumPy buffer rather than the CPU caching
        allocator: cheaper to make and drop, for short-lived host copies."""
        return cls._over(np.empty(nbytes, np.uint8), frozen=False)

    @classmethod
    def host_view(cls, buffer: np.ndarray) -> "Storage":
        """Frozen CPU storage over the bytes of ``buffer`` (uint8, 1-D, contiguous) without a
        copy, such as a read-only memory map of a model file; it keeps ``buffer`` alive."""
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.c_contiguous:
            raise ValueError(f"host_view takes contiguous uint8 bytes (n,), got {buffer.dtype} {buffer.shape}")
        return cls._over(buffer, frozen=True)

    def drop_file_pages(self, offset: int, nbytes: int) -> bool:
        """Let the OS take back this process's pages of bytes [offset, offset + nbytes) where
        this storage is a read-only memory map of a file (``host_view``): a touched byte is read
        from the file again, so nothing changes but the memory held (the whole pages inside the
        range only). For a weight whose bytes a kernel keeps in another form. False, doing
        nothing, for any other memory."""
        if self._buffer is None or offset < 0 or nbytes <= 0 or offset + nbytes > self.nbytes:
            return False
        return drop_file_pages(self._buffer[offset:offset + nbytes])

    @classmethod
    def _over(cls, buffer: np.ndarray, frozen: bool) -> "Storage":
        storage = cls.__new__(cls)
        storage.runtime = get_runtime(_CPU)
        storage.nbytes = buffer.nbytes
        storage.frozen = frozen
        storage._host = None
        storage._buffer = buffer
        storage.ptr = buffer.ctypes.data
        return storage

    @property
    def device(self) -> Device:
        """The device this memory lives on."""
        return self.runtime.device

    def freeze(self) -> None:
        """Make this storage read-only from now on: writes through tensors raise
        FrozenTensorError, and the CPU fallback may keep a host copy of it."""
        self.frozen = True

    def host_copy(self) -> "Storage":
        """A frozen CPU storage with this frozen storage's bytes: copied from the device the
        first time, then kept with this storage. A CPU storage is its own host copy."""
        if not self.frozen:
            raise ValueError(f"storage on {self.device} is not frozen; only frozen storage keeps a host copy")
        if self.runtime.is_cpu:
            return self
        host = self._host
        if host is None:
            host = Storage(get_runtime(_CPU), self.nbytes)
            if self.nbytes:
                self.runtime.memcpy(host.ptr, self.ptr, self.nbytes, MemcpyKind.D2H)
            host.freeze()
            self._host = host
        return host

    def host_buffer(self) -> ctypes.Array:
        """The storage as a ctypes byte array over its memory, without a copy (CPU storage
        only). It keeps this storage alive, and so does any NumPy array made from it."""
        if not self.runtime.is_cpu:
            raise TypeError(f"storage on {self.device} is not host-addressable; copy it to the CPU first")
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        raw.owner = self  # ties the storage's life to the buffer and its users
        return raw

    def host_memory(self) -> "ctypes.Array | np.ndarray":
        """An object exposing the storage's memory through the buffer protocol, without a copy
        (CPU storage only); it keeps that memory alive."""
        return self.host_buffer() if self._buffer is None else self._buffer

    def host_bytes(self) -> np.ndarray:
        """The storage as a uint8 NumPy array (nbytes,), without a copy (CPU storage only).
        The array keeps this storage alive; it is read-only when the storage is frozen."""
        arr = np.frombuffer(self.host_buffer(), dtype=np.uint8)
        if self.frozen:
            arr.flags.writeable = False
        return arr

    def __del__(self) -> None:
        try:
            if self._buffer is None:
                self.runtime.free(self.ptr)
        except Exception:  # interpreter shutdown: the allocator may be gone
            pass


def drop_file_pages(view: np.ndarray) -> bool:
    """Give the OS back this process's whole pages under ``view`` (contiguous bytes) when they
    belong to a read-only memory map of a file: touched again, they are read from the file, so
    only the memory held changes. False, doing nothing, for any other memory (where dropping
    pages would lose their contents)."""
    mapping = _read_only_file_map(view)
    if mapping is None or not view.flags.c_contiguous or view.nbytes == 0:
        return False
    start = view.ctypes.data - np.frombuffer(mapping, np.uint8).ctypes.data  # offset in the mapping
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        mapping.madvise(mmap.MADV_DONTNEED, first, end - first)
    return True


def _read_only_file_map(buffer: "np.ndarray | None") -> "mmap.mmap | None":
    """The memory map under ``buffer`` (through NumPy views and memoryviews) when it is read-only,
    else None. madvise(MADV_DONTNEED) only drops such pages: on anonymous memory it would zero them."""
    obj: object = buffer
    while isinstance(obj, (np.ndarray, memoryview)):
        obj = obj.base if isinstance(obj, np.ndarray) else obj.obj
    if not isinstance(obj, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    return obj if memoryview(obj).readonly else None
