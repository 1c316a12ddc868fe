"""Tensor: storage + byte offset + shape, strides (in elements), dtype and device.

Views (``view``, ``permute``, ``slice``) share storage; nothing is copied unless asked
(``contiguous``, ``to``, ``numpy``, ``clone``).
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from ..runtime.device import Device, as_device
from ..runtime.dtypes import DataType, MemcpyKind, as_dtype
from ..runtime.runtime import get_runtime
from .storage import Storage

Shape = tuple[int, ...]


def _contiguous_strides(shape: Shape) -> Shape:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


def _as_shape(shape: "Iterable[int] | int") -> Shape:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    out = tuple(int(d) for d in shape)
    if any(d < 0 for d in out):
        raise ValueError(f"shape {out} has a negative dimension")
    return out


class Tensor:
    """An n-dimensional array on one device."""

    __slots__ = ("storage", "offset", "shape", "strides", "dtype", "_array")

    def __init__(self, storage: Storage, offset: int, shape: Shape, strides: Shape, dtype: DataType):
        self.storage = storage
        self.offset = offset  # bytes into storage
        self.shape = shape
        self.strides = strides  # elements
        self.dtype = dtype
        self._array: np.ndarray | None = None

    # ---- creation ----------------------------------------------------------------------
    @staticmethod
    def empty(shape: "Iterable[int] | int", dtype: "DataType | str" = DataType.F32, device: "Device | str | None" = None) -> "Tensor":
        """An uninitialised contiguous tensor."""
        shape = _as_shape(shape)
        dtype = as_dtype(dtype)
        if dtype is DataType.INVALID:
            raise ValueError("cannot create a tensor of data type INVALID")
        runtime = get_runtime(device)
        storage = Storage(runtime, math.prod(shape) * dtype.itemsize)
        return Tensor(storage, 0, shape, _contiguous_strides(shape), dtype)

    @staticmethod
    def zeros(shape: "Iterable[int] | int", dtype: "DataType | str" = DataType.F32, device: "Device | str | None" = None) -> "Tensor":
        """A contiguous tensor filled with zeros."""
        t = Tensor.empty(shape, dtype, device)
        t.storage.runtime.memset(t.storage.ptr, 0, t.storage.nbytes)
        return t

    @staticmethod
    def from_numpy(array: np.ndarray, device: "Device | str | None" = None, dtype: "DataType | str | None" = None) -> "Tensor":
        """A new tensor holding a copy of ``array`` (converted to ``dtype`` if given)."""
        array = np.asarray(array)
        target = as_dtype(dtype) if dtype is not None else as_dtype(array.dtype)
        t = Tensor.empty(array.shape, target, device)
        t.load(array)
        return t

    # ---- properties --------------------------------------------------------------------
    @property
    def device(self) -> Device:
        return self.storage.runtime.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    @property
    def data_ptr(self) -> int:
        """Address of the first element (an opaque device pointer off the CPU)."""
        return self.storage.ptr + self.offset

    def is_contiguous(self) -> bool:
        """True when the elements lie densely in row-major order."""
        acc = 1
        for dim, stride in zip(reversed(self.shape), reversed(self.strides)):
            if dim != 1 and stride != acc:
                return False
            acc *= dim
        return True

    # ---- host access -------------------------------------------------------------------
    def host_array(self) -> np.ndarray:
        """A NumPy view of this CPU tensor without a copy; writes go to the tensor."""
        arr = self._array
        if arr is None:
            item = self.dtype.itemsize
            if self.numel() == 0:
                arr = np.empty(self.shape, self.dtype.numpy)
            else:
                arr = np.ndarray(
                    self.shape, self.dtype.numpy, buffer=self.storage.host_bytes(),
                    offset=self.offset, strides=tuple(s * item for s in self.strides),
                )
            self._array = arr
        return arr

    def numpy(self) -> np.ndarray:
        """A host copy as a NumPy array (contiguous)."""
        if self.device.is_cpu:
            return np.array(self.host_array(), copy=True)
        src = self if self.is_contiguous() else self.contiguous()
        out = np.empty(self.shape, self.dtype.numpy)
        if out.nbytes:
            src.storage.runtime.memcpy(out.ctypes.data, src.data_ptr, out.nbytes, MemcpyKind.D2H)
        return out

    def load(self, host: "np.ndarray | bytes | bytearray | memoryview") -> "Tensor":
        """Fill this tensor from host data: an array of the same shape (cast to this dtype)
        or a buffer of exactly ``nbytes`` raw bytes. Returns self."""
        if isinstance(host, (bytes, bytearray, memoryview)):
            raw = np.frombuffer(host, dtype=np.uint8)
            if raw.nbytes != self.nbytes:
                raise ValueError(f"load: buffer has {raw.nbytes} bytes, tensor {self.shape} {self.dtype.name} needs {self.nbytes}")
            host = raw.view(self.dtype.numpy).reshape(self.shape)
        host = np.asarray(host)
        if host.shape != self.shape:
            raise ValueError(f"load: array shape {host.shape} does not match tensor shape {self.shape}")
        if self.device.is_cpu:
            self.host_array()[...] = host
            return self
        host = np.ascontiguousarray(host, dtype=self.dtype.numpy)
        if self.is_contiguous():
            self.storage.runtime.memcpy(self.data_ptr, host.ctypes.data, host.nbytes, MemcpyKind.H2D)
        else:
            self.copy_(Tensor.from_numpy(host, self.device))
        return self

    # ---- views -------------------------------------------------------------------------
    def view(self, *shape: "int | Sequence[int]") -> "Tensor":
        """The same elements with a new shape, sharing storage. One dimension may be -1.

        Raises ValueError when the strides cannot express the new shape without a copy.
        """
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        shape = tuple(int(d) for d in shape)
        n = self.numel()
        if shape.count(-1) > 1:
            raise ValueError(f"view: only one dimension may be -1, got {shape}")
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            if known == 0 or n % known:
                raise ValueError(f"view: cannot infer -1 in {shape} for {n} elements")
            shape = tuple(n // known if d == -1 else d for d in shape)
        if math.prod(shape) != n or any(d < 0 for d in shape):
            raise ValueError(f"view: shape {shape} does not hold the {n} elements of shape {self.shape}")
        strides = _view_strides(self.shape, self.strides, shape)
        if strides is None:
            raise ValueError(
                f"view: a tensor of shape {self.shape} and strides {self.strides} cannot be viewed as "
                f"{shape} without a copy; call .contiguous() first"
            )
        return Tensor(self.storage, self.offset, shape, strides, self.dtype)

    reshape_view = view

    def permute(self, *dims: "int | Sequence[int]") -> "Tensor":
        """A view with dimensions reordered: new dim i is old dim ``dims[i]``."""
        if len(dims) == 1 and not isinstance(dims[0], (int, np.integer)):
            dims = tuple(dims[0])
        dims = tuple(int(d) % self.ndim if self.ndim else int(d) for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute: {dims} is not a permutation of the {self.ndim} dimensions")
        return Tensor(self.storage, self.offset, tuple(self.shape[d] for d in dims), tuple(self.strides[d] for d in dims), self.dtype)

    def slice(self, dim: int, start: int, end: int) -> "Tensor":
        """A view of indices ``start:end`` (end exclusive) along ``dim``."""
        if not -self.ndim <= dim < self.ndim:
            raise ValueError(f"slice: dim {dim} is out of range for {self.ndim} dimensions")
        dim %= self.ndim
        size = self.shape[dim]
        if not 0 <= start <= end <= size:
            raise ValueError(f"slice: [{start}, {end}) is not within dimension {dim} of size {size}")
        shape = self.shape[:dim] + (end - start,) + self.shape[dim + 1:]
        offset = self.offset + start * self.strides[dim] * self.dtype.itemsize
        return Tensor(self.storage, offset, shape, self.strides, self.dtype)

    # ---- copies ------------------------------------------------------------------------
    def contiguous(self) -> "Tensor":
        """Self when already contiguous, else a contiguous copy on the same device."""
        if self.is_contiguous():
            return self
        out = Tensor.empty(self.shape, self.dtype, self.device)
        out.copy_(self)
        return out

    def clone(self) -> "Tensor":
        """A contiguous copy on the same device."""
        out = Tensor.empty(self.shape, self.dtype, self.device)
        out.copy_(self)
        return out

    def to(self, device: "Device | str") -> "Tensor":
        """This tensor on ``device``: self when it is there already, else a contiguous copy."""
        device = as_device(device)
        if device == self.device:
            return self
        out = Tensor.empty(self.shape, self.dtype, device)
        out.copy_(self)
        return out

    def copy_(self, src: "Tensor") -> "Tensor":
        """Copy ``src`` (same shape and dtype, any device and layout) into self. Returns self."""
        if src.shape != self.shape or src.dtype != self.dtype:
            raise ValueError(f"copy_: source {src.shape} {src.dtype.name} does not match {self.shape} {self.dtype.name}")
        if self.numel() == 0:
            return self
        if self.device.is_cpu and src.device.is_cpu:
            self.host_array()[...] = src.host_array()
            return self
        if self.device == src.device:
            from ..kernels.registry import dispatch  # strided copy on the device itself

            dispatch("rearrange", self.dtype, (self,), (src,), {})
            return self
        dst = self if self.is_contiguous() else Tensor.empty(self.shape, self.dtype, self.device)
        src_c = src.contiguous()
        if dst.device.is_cpu:
            src_c.storage.runtime.memcpy(dst.data_ptr, src_c.data_ptr, dst.nbytes, MemcpyKind.D2H)
        elif src_c.device.is_cpu:
            dst.storage.runtime.memcpy(dst.data_ptr, src_c.data_ptr, dst.nbytes, MemcpyKind.H2D)
        else:  # between two non-CPU devices: through the host
            dst.load(src_c.numpy())
        if dst is not self:
            self.copy_(dst)
        return self

    # ---- printing ----------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"Tensor(shape={self.shape}, dtype={self.dtype.name}, device={self.device}, "
                f"strides={self.strides}, offset={self.offset})")

    def __str__(self) -> str:
        body = np.array2string(self.numpy(), threshold=64, edgeitems=3, precision=4)
        return f"{repr(self)[:-1]},\n       data={body})"

    def debug(self) -> None:
        """Print metadata and values (the debug print of the tensor API)."""
        print(str(self))


def _view_strides(old_shape: Shape, old_strides: Shape, new_shape: Shape) -> Shape | None:
    """Strides for ``new_shape`` over the same memory, or None if impossible without a copy."""
    # Group old dims into contiguous runs; each new dim must come from within one run.
    old = [(d, s) for d, s in zip(old_shape, old_strides) if d != 1]
    new_strides = [0] * len(new_shape)
    if math.prod(old_shape) == 0:
        return _contiguous_strides(new_shape)
    oi = 0
    ni = 0
    while ni < len(new_shape) or oi < len(old):
        # skip size-1 new dims
        while ni < len(new_shape) and new_shape[ni] == 1:
            new_strides[ni] = 1
            ni += 1
        if oi >= len(old):
            if ni < len(new_shape):
                return None
            break
        # take a run of old dims that are mutually contiguous
        run_size = old[oi][0]
        run_inner_stride = old[oi][1]
        oj = oi + 1
        while oj < len(old) and old[oj - 1][1] == old[oj][0] * old[oj][1]:
            run_size *= old[oj][0]
            run_inner_stride = old[oj][1]
            oj += 1
        # cover this run with new dims
        produced = 1
        start = ni
        while ni < len(new_shape) and produced < run_size:
            produced *= new_shape[ni]
            ni += 1
        while ni < len(new_shape) and new_shape[ni] == 1:
            ni += 1
        if produced != run_size:
            # the run may be split further across old dims only at contiguous boundaries
            return None
        acc = run_inner_stride
        for k in range(ni - 1, start - 1, -1):
            new_strides[k] = acc
            acc *= new_shape[k]
        oi = oj
    return tuple(new_strides)
