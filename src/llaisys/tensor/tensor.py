"""Tensor: storage + byte offset + shape, strides (in elements), dtype and device.

Views (``view``, ``permute``, ``slice``) share storage; nothing is copied unless asked
(``contiguous``, ``to``, ``numpy``, ``clone``). ``freeze`` makes a tensor's storage read-only
for good (a model's weights): writes raise FrozenTensorError, and reads off the device may be
served from a host copy kept with the storage.

A tensor of a block-quantized type (``DataType.Q4_1``, ...) is a weight matrix (N, K): K a
multiple of the block size, rows stored one after another as GGUF stores them, so its raw
bytes are uint8 (N, row_bytes). It is always contiguous: row ranges (``slice`` on dim 0) are
its only views; anything that would split a block or reorder its elements is refused.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..runtime.context import current_runtime
from ..runtime.device import Device, as_device
from ..runtime.dtypes import DataType, MemcpyKind, as_dtype
from ..runtime.runtime import Runtime, get_runtime
from .storage import FrozenTensorError, Storage

Shape = tuple[int, ...]


def _contiguous_strides(shape: Shape) -> Shape:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


def _as_shape(shape: "Iterable[int] | int", what: str = "shape") -> Shape:
    """``shape`` as a tuple of non-negative ints; TypeError/ValueError name what was wrong."""
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{what} must be an int or a sequence of ints, got {type(shape).__name__}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"{what} {dims} has a non-integer dimension {d!r}")
        if d < 0:
            raise ValueError(f"{what} {dims} has a negative dimension")
    return dims if all(type(d) is int for d in dims) else tuple(int(d) for d in dims)


# Copies ``src`` into ``dst`` on one non-CPU device with its ``rearrange`` kernel: set by the
# kernel registry when it loads (a layer above this one), so the tensor names no kernel module.
_device_copy: "Callable[[Tensor, Tensor], None] | None" = None


def set_device_copy(copy: "Callable[[Tensor, Tensor], None]") -> None:
    """Install the same-device strided copy ``copy(dst, src)`` that ``Tensor.copy_`` runs."""
    global _device_copy
    _device_copy = copy


class Tensor:
    """An n-dimensional array on one device."""

    __slots__ = ("storage", "offset", "shape", "strides", "dtype", "_array", "_host_span", "_derived")

    def __init__(self, storage: Storage, offset: int, shape: Shape, strides: Shape, dtype: DataType):
        self.storage = storage
        self.offset = offset  # bytes into storage
        self.shape = shape
        self.strides = strides  # elements
        self.dtype = dtype
        self._array: np.ndarray | None = None
        self._host_span: Tensor | None = None  # a frozen tensor's view of its host copy
        self._derived: dict[str, Any] | None = None  # see ``derived``

    # ---- creation ----------------------------------------------------------------------
    @staticmethod
    def empty(shape: "Iterable[int] | int", dtype: "DataType | str" = DataType.F32, device: "Device | str | None" = None) -> "Tensor":
        """An uninitialised contiguous tensor of ``shape`` and ``dtype`` on ``device``
        (default: the thread's current device)."""
        shape = _as_shape(shape)
        if type(dtype) is not DataType:
            dtype = as_dtype(dtype)
        runtime = current_runtime() if device is None else get_runtime(device)
        return Tensor._allocate(runtime, shape, dtype)

    @staticmethod
    def empty_like(like: "Tensor", shape: "Iterable[int] | int | None" = None, dtype: "DataType | str | None" = None) -> "Tensor":
        """An uninitialised contiguous tensor on ``like``'s device, with ``like``'s shape and
        dtype unless given."""
        shape = like.shape if shape is None else _as_shape(shape)
        if dtype is None:
            dtype = like.dtype
        elif type(dtype) is not DataType:
            dtype = as_dtype(dtype)
        return Tensor._allocate(like.storage.runtime, shape, dtype)

    @staticmethod
    def _allocate(runtime: Runtime, shape: Shape, dtype: DataType) -> "Tensor":
        if dtype is DataType.INVALID:
            raise ValueError("cannot create a tensor of data type INVALID")
        if dtype.is_quantized:
            _check_block_shape(shape, dtype)
        storage = Storage(runtime, dtype.nbytes_of(math.prod(shape)))
        return Tensor(storage, 0, shape, _contiguous_strides(shape), dtype)

    @staticmethod
    def from_raw(raw: np.ndarray, dtype: "DataType | str", device: "Device | str | None" = None) -> "Tensor":
        """A new tensor of block format ``dtype`` (N, K) holding a copy of its raw blocks ``raw``:
        uint8 (N, row_bytes), row_bytes a multiple of the block's bytes."""
        dtype = as_dtype(dtype)
        if not dtype.is_quantized:
            raise TypeError(f"from_raw builds tensors of the block formats; {dtype.name} is not one (use from_numpy)")
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.ndim != 2:
            raise ValueError(f"from_raw: raw {dtype.name} blocks must be uint8 (N, row_bytes), got {raw.dtype} {raw.shape}")
        if raw.shape[1] == 0 or raw.shape[1] % dtype.block_bytes:
            raise ValueError(f"from_raw: rows of {raw.shape[1]} bytes are not whole {dtype.name} blocks of "
                             f"{dtype.block_bytes} bytes")
        t = Tensor.empty((raw.shape[0], raw.shape[1] // dtype.block_bytes * dtype.block_size), dtype, device)
        return t.load(raw)

    @staticmethod
    def host_view(raw: np.ndarray, shape: "Iterable[int] | int", dtype: "DataType | str") -> "Tensor":
        """A frozen contiguous CPU tensor of ``shape`` and ``dtype`` over the bytes ``raw``
        (uint8 (nbytes,)) without a copy: weights left in a read-only memory map of their file."""
        shape, dtype = _as_shape(shape), as_dtype(dtype)
        if dtype.is_quantized:
            _check_block_shape(shape, dtype)
        if raw.nbytes != dtype.nbytes_of(math.prod(shape)):
            raise ValueError(f"host_view: {raw.nbytes} bytes do not hold a {dtype.name} tensor {shape}")
        return Tensor(Storage.host_view(raw), 0, shape, _contiguous_strides(shape), dtype)

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
        if target.is_quantized:
            raise TypeError(f"from_numpy does not quantize: build a {target.name} tensor from its raw blocks "
                            "with Tensor.from_raw")
        t = Tensor.empty(array.shape, target, device)
        t.load(array)
        return t

    # ---- properties --------------------------------------------------------------------
    @property
    def device(self) -> Device:
        """The device holding this tensor's storage."""
        return self.storage.runtime.device

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (not of the storage, which a view may share); whole blocks for
        a block format."""
        return self.dtype.nbytes_of(self.numel())

    @property
    def raw_shape(self) -> tuple[int, int]:
        """The shape of a block-format tensor's raw bytes: (N, row_bytes)."""
        if not self.dtype.is_quantized:
            raise TypeError(f"raw_shape is for the block formats; this tensor is {self.dtype.name}")
        return (self.shape[0], self.dtype.nbytes_of(self.shape[1]))

    def derived(self, key: str, make: "Callable[[Tensor], Any]") -> Any:
        """``make(self)``, made on the first call with ``key`` and kept with this tensor: kernels
        keep a prepared form of a weight here (the quantized linear its checked weight). What
        ``make`` returns must stay valid while this tensor lives (a view of its bytes, or a
        copy of a frozen tensor's)."""
        cache = self._derived
        if cache is None:
            cache = self._derived = {}
        value = cache.get(key)
        if value is None:
            value = cache[key] = make(self)
        return value

    @property
    def frozen(self) -> bool:
        """Whether the storage is read-only (``freeze``)."""
        return self.storage.frozen

    def freeze(self) -> "Tensor":
        """Make this tensor's storage, and so every view of it, read-only for good; returns
        self. Writes through ops, ``copy_`` or ``load`` then raise FrozenTensorError, and
        CPU views are read-only NumPy arrays. ``clone()`` gives a writable copy."""
        self.storage.freeze()
        if self._array is not None:
            self._array.flags.writeable = False
        return self

    def check_writable(self, what: str) -> None:
        """Raise FrozenTensorError, naming ``what`` would write, when this tensor is frozen."""
        if self.storage.frozen:
            raise FrozenTensorError(
                f"{what}: cannot write into a frozen (read-only) tensor {self.shape} {self.dtype.name} on "
                f"{self.device}; frozen tensors, such as a model's weights, are never written; clone() it for a "
                "writable copy")

    @property
    def data_ptr(self) -> int:
        """Address of the first element (an opaque device pointer off the CPU)."""
        return self.storage.ptr + self.offset

    def is_contiguous(self) -> bool:
        """True when the elements lie densely in row-major order (always, when there are none)."""
        if 0 in self.shape:
            return True
        acc = 1
        for dim, stride in zip(reversed(self.shape), reversed(self.strides)):
            if dim != 1 and stride != acc:
                return False
            acc *= dim
        return True

    # ---- host access -------------------------------------------------------------------
    def host_array(self) -> np.ndarray:
        """A NumPy view of this CPU tensor (same shape, strides and dtype) without a copy;
        writes go to the tensor (read-only when frozen). Made once per tensor: kernels call
        this on every op. A block-format tensor gives its raw bytes, uint8 (N, row_bytes)."""
        arr = self._array
        if arr is None:
            if 0 in self.shape:
                arr = np.empty(self.raw_shape if self.dtype.is_quantized else self.shape,
                               np.uint8 if self.dtype.is_quantized else self.dtype.numpy)
            elif self.dtype.is_quantized:
                arr = np.ndarray(self.raw_shape, np.uint8, buffer=self.storage.host_memory(), offset=self.offset)
            else:
                item = self.dtype.itemsize
                arr = np.ndarray(
                    self.shape, self.dtype.numpy, buffer=self.storage.host_memory(),
                    offset=self.offset, strides=tuple([s * item for s in self.strides]),
                )
            if self.storage.frozen:
                arr.flags.writeable = False
            self._array = arr
        return arr

    def numpy(self) -> np.ndarray:
        """A host copy as a C-contiguous NumPy array; a block-format tensor is dequantized to
        float32 (N, K) (its raw bytes: ``raw_numpy``)."""
        if self.dtype.is_quantized:
            return _dequantize(self.raw_numpy(), self.dtype)
        if self.device.is_cpu:
            return np.array(self.host_array(), copy=True, order="C")
        if 0 in self.shape:
            return np.empty(self.shape, self.dtype.numpy)
        if self.is_contiguous():
            out = np.empty(self.shape, self.dtype.numpy)
            self.storage.runtime.memcpy(out.ctypes.data, self.data_ptr, out.nbytes, MemcpyKind.D2H)
            return out
        return np.array(self._read_span(), copy=True, order="C")

    def raw_numpy(self) -> np.ndarray:
        """A host copy of a block-format tensor's raw bytes, uint8 (N, row_bytes)."""
        if self.device.is_cpu:
            return self.host_array().copy()
        out = np.empty(self.raw_shape, np.uint8)
        if out.size:
            self.storage.runtime.memcpy(out.ctypes.data, self.data_ptr, out.nbytes, MemcpyKind.D2H)
        return out

    # Off the CPU, a strided view moves as the byte span from its first to its last element
    # (the gaps included) and is taken apart on the host: no device kernel is needed.
    def _span_nbytes(self) -> int:
        if self.numel() == 0:
            return 0
        return self.dtype.nbytes_of(1 + sum((d - 1) * s for d, s in zip(self.shape, self.strides)))

    def host_span(self, copy: bool = True) -> "Tensor":
        """A CPU tensor with this tensor's shape and strides over a host copy of the bytes it
        spans (first to last element). Needs only the device's D2H copy, no kernel. A frozen
        tensor's comes from its storage's host copy (``Storage.host_copy``): copied once,
        read-only. ``copy=False`` leaves the bytes uninitialised (for an output to be written
        whole before ``store_host_span``)."""
        if self.storage.frozen:
            view = self._host_span
            if view is None:
                view = Tensor(self.storage.host_copy(), self.offset, self.shape, self.strides, self.dtype)
                self._host_span = view
            return view
        host = Storage.host_scratch(self._span_nbytes())
        if copy and host.nbytes:
            self.storage.runtime.memcpy(host.ptr, self.data_ptr, host.nbytes, MemcpyKind.D2H)
        return Tensor(host, 0, self.shape, self.strides, self.dtype)

    def store_host_span(self, host: "Tensor") -> None:
        """Write back the span that ``host_span`` read (after changes on the host). Bytes
        between this tensor's elements go back as they were read."""
        self.check_writable("store_host_span")
        if host.storage.nbytes:
            self.storage.runtime.memcpy(self.data_ptr, host.data_ptr, host.storage.nbytes, MemcpyKind.H2D)

    def _read_span(self) -> np.ndarray:
        """This device tensor's elements as a strided host array."""
        return self.host_span().host_array()

    def _write_span(self, values: np.ndarray) -> None:
        """Store ``values`` into this device tensor, keeping the bytes between its elements."""
        host = self.host_span()
        host.host_array()[...] = values
        self.store_host_span(host)

    def load(self, host: "np.ndarray | bytes | bytearray | memoryview") -> "Tensor":
        """Fill this tensor from host data: an array of the same shape (cast to this dtype)
        or a buffer of exactly ``nbytes`` raw bytes; a block-format tensor takes its raw
        bytes, uint8 (N, row_bytes) or a buffer. Returns self."""
        if self.dtype.is_quantized:
            return self._load_raw(host)
        if isinstance(host, (bytes, bytearray, memoryview)):
            raw = np.frombuffer(host, dtype=np.uint8)
            if raw.nbytes != self.nbytes:
                raise ValueError(f"load: buffer has {raw.nbytes} bytes, tensor {self.shape} {self.dtype.name} needs {self.nbytes}")
            host = raw.view(self.dtype.numpy).reshape(self.shape)
        self.check_writable("load")
        host = np.asarray(host)
        if host.shape != self.shape:
            raise ValueError(f"load: array shape {host.shape} does not match tensor shape {self.shape}")
        if self.device.is_cpu:
            self.host_array()[...] = host
        elif 0 in self.shape:
            pass
        elif self.is_contiguous():
            host = np.ascontiguousarray(host, dtype=self.dtype.numpy)
            self.storage.runtime.memcpy(self.data_ptr, host.ctypes.data, host.nbytes, MemcpyKind.H2D)
        else:
            self._write_span(host)
        return self

    def _load_raw(self, host: "np.ndarray | bytes | bytearray | memoryview") -> "Tensor":
        """``load`` for a block format: raw blocks, uint8 (N, row_bytes) or a buffer of nbytes."""
        if isinstance(host, (bytes, bytearray, memoryview)):
            raw = np.frombuffer(host, dtype=np.uint8)
            if raw.nbytes != self.nbytes:
                raise ValueError(f"load: buffer has {raw.nbytes} bytes, tensor {self.shape} {self.dtype.name} "
                                 f"needs {self.nbytes}")
            raw = raw.reshape(self.raw_shape)
        else:
            raw = np.asarray(host)
            if raw.dtype != np.uint8 or raw.shape != self.raw_shape:
                raise ValueError(f"load: a {self.dtype.name} tensor {self.shape} takes its raw blocks, uint8 "
                                 f"{self.raw_shape}; got {raw.dtype} {raw.shape}")
        self.check_writable("load")
        if self.device.is_cpu:
            self.host_array()[...] = raw
        elif raw.size:
            raw = np.ascontiguousarray(raw)
            self.storage.runtime.memcpy(self.data_ptr, raw.ctypes.data, raw.nbytes, MemcpyKind.H2D)
        return self

    # ---- views -------------------------------------------------------------------------
    def view(self, *shape: "int | Sequence[int]") -> "Tensor":
        """The same elements with a new shape, sharing storage. One dimension may be -1.

        Raises ValueError when the strides cannot express the new shape without a copy.
        """
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        for d in shape:
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
                raise TypeError(f"view: shape {shape} has a non-integer dimension {d!r}")
        shape = tuple(int(d) for d in shape)
        n = self.numel()
        if shape.count(-1) > 1:
            raise ValueError(f"view: only one dimension may be -1, got {shape}")
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            if known == 0 or n % known:
                raise ValueError(f"view: cannot infer -1 in {shape} for {n} elements")
            shape = tuple(n // known if d == -1 else d for d in shape)
        if any(d < 0 for d in shape) or math.prod(shape) != n:
            raise ValueError(f"view: shape {shape} does not hold the {n} elements of shape {self.shape}")
        if self.dtype.is_quantized and shape != self.shape:
            raise ValueError(f"view: a {self.dtype.name} tensor {self.shape} keeps its shape (its rows are blocks of "
                             f"{self.dtype.block_size} elements); got {shape}")
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
        n = self.ndim
        if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) for d in dims):
            raise TypeError(f"permute: dims {dims} must be ints")
        if any(not -n <= d < n for d in dims):
            raise ValueError(f"permute: dims {dims} are out of range for {n} dimensions")
        dims = tuple(int(d) % n for d in dims)
        if sorted(dims) != list(range(n)):
            raise ValueError(f"permute: {dims} is not a permutation of the {n} dimensions")
        if self.dtype.is_quantized and dims != tuple(range(n)):
            raise ValueError(f"permute: a {self.dtype.name} tensor cannot be permuted: its elements are packed in "
                             f"blocks of {self.dtype.block_size} along each row")
        return Tensor(self.storage, self.offset, tuple(self.shape[d] for d in dims), tuple(self.strides[d] for d in dims), self.dtype)

    def slice(self, dim: int, start: int, end: int) -> "Tensor":
        """A view of indices ``start:end`` (end exclusive) along ``dim``."""
        for name, v in (("dim", dim), ("start", start), ("end", end)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"slice: {name} must be an int, got {type(v).__name__}")
        if not -self.ndim <= dim < self.ndim:
            raise ValueError(f"slice: dim {dim} is out of range for {self.ndim} dimensions")
        dim %= self.ndim
        size = self.shape[dim]
        if not 0 <= start <= end <= size:
            raise ValueError(f"slice: [{start}, {end}) is not within dimension {dim} of size {size}")
        shape = self.shape[:dim] + (end - start,) + self.shape[dim + 1:]
        if self.dtype.is_quantized:
            if dim != 0 and (start, end) != (0, size):
                raise ValueError(f"slice: a {self.dtype.name} tensor is sliced by rows (dim 0) only; columns "
                                 f"[{start}, {end}) would split its blocks of {self.dtype.block_size} elements")
            return Tensor(self.storage, self.offset + self.dtype.nbytes_of(start * self.strides[0]), shape,
                          self.strides, self.dtype)
        offset = self.offset + start * self.strides[dim] * self.dtype.itemsize
        return Tensor(self.storage, offset, shape, self.strides, self.dtype)

    # ---- copies ------------------------------------------------------------------------
    def contiguous(self) -> "Tensor":
        """Self when already contiguous, else a contiguous copy on the same device."""
        if self.is_contiguous():
            return self
        return Tensor.empty_like(self).copy_(self)

    def clone(self) -> "Tensor":
        """A contiguous copy on the same device."""
        return Tensor.empty_like(self).copy_(self)

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
        if not isinstance(src, Tensor):
            raise TypeError(f"copy_: src must be a llaisys Tensor, got {type(src).__name__}")
        if src.shape != self.shape or src.dtype != self.dtype:
            raise ValueError(f"copy_: source {src.shape} {src.dtype.name} does not match {self.shape} {self.dtype.name}")
        self.check_writable("copy_")
        if self.numel() == 0:
            return self
        if self.dtype.is_quantized:  # always contiguous: the bytes move as they are
            return self._copy_blocks(src)
        if self.device.is_cpu and src.device.is_cpu:
            self.host_array()[...] = src.host_array()
            return self
        if self.device == src.device:  # a strided copy on the device itself: its rearrange kernel
            if _device_copy is None:
                raise RuntimeError("copy_ on a device needs the kernel registry (import llaisys)")
            _device_copy(self, src)
        elif self.device.is_cpu and self.is_contiguous() and src.is_contiguous():
            src.storage.runtime.memcpy(self.data_ptr, src.data_ptr, self.nbytes, MemcpyKind.D2H)
        elif self.device.is_cpu:
            self.host_array()[...] = src._read_span()
        else:  # to a non-CPU device, from the CPU or (through the host) from another device
            self.load(src.host_array() if src.device.is_cpu else src.numpy())
        return self

    def _copy_blocks(self, src: "Tensor") -> "Tensor":
        """``copy_`` for block formats (both contiguous, same shape): a plain byte copy."""
        if self.device.is_cpu and src.device.is_cpu:
            self.host_array()[...] = src.host_array()
        elif self.device == src.device:
            self.storage.runtime.memcpy(self.data_ptr, src.data_ptr, self.nbytes, MemcpyKind.D2D)
        else:
            self._load_raw(src.host_array() if src.device.is_cpu else src.raw_numpy())
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


def _check_block_shape(shape: Shape, dtype: DataType) -> None:
    """A block-format tensor is a matrix (N, K) of whole blocks per row; ValueError otherwise."""
    if len(shape) != 2 or shape[1] == 0 or shape[1] % dtype.block_size:
        raise ValueError(f"a {dtype.name} tensor must be 2-D (N, K) with K a positive multiple of "
                         f"{dtype.block_size} (whole blocks per row); got shape {shape}")


def _dequantize(raw: np.ndarray, dtype: DataType) -> np.ndarray:
    """Raw blocks uint8 (N, row_bytes) of ``dtype`` as float32 (N, K), by ``gguf.quants``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    k = raw.shape[1] // dtype.block_bytes * dtype.block_size
    if raw.shape[0] == 0:
        return np.empty((0, k), np.float32)
    return dequantize(raw, GGMLQuantizationType(dtype.ggml_type)).astype(np.float32, copy=False).reshape(-1, k)


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
