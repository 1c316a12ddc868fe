"""The GGUF container: header, metadata and tensor table, parsed straight from a memory map.

The layout (version 2 and 3, either byte order): magic ``GGUF``, version (u32), tensor count and
metadata count (u64); the metadata as key (string), value type (u32), value; the tensor table as
name, dimension count (u32), dimensions (u64, innermost first), ggml type (u32) and offset into
the data section (u64); the data section at the next multiple of ``general.alignment``. A string
is a u64 byte count and UTF-8 bytes; an array an item type (u32), a count (u64) and the items.

Tensors are read-only NumPy views of the map, checked against the file (``check_layout``) before
any is made. A file that breaks the layout raises ValueError saying where; metadata text that is
not UTF-8 and a bad tensor entry raise ModelLoadError naming the file and the key or tensor.
"""
from __future__ import annotations

import ctypes
import enum
import math
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import _native
from ...runtime.block_formats import BLOCK_FORMATS
from ..errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4


GGMLType = enum.IntEnum("GGMLType", {f.name: f.type_id for f in BLOCK_FORMATS})
GGMLType.__doc__ = "The ggml tensor types llaisys reads, numbered as GGUF numbers them (runtime.block_formats)."

# type -> (values per block, bytes per block)
BLOCK_SIZES: dict[int, tuple[int, int]] = {GGMLType(f.type_id): (f.block_size, f.block_bytes) for f in BLOCK_FORMATS}

# GGUF value types
_STRING, _ARRAY = 8, 9
_SCALAR_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_CODES = {"B": "u1", "b": "i1", "H": "u2", "h": "i2", "I": "u4", "i": "i4", "f": "f4", "?": "?",
                "Q": "u8", "q": "i8", "d": "f8"}
_UINT32 = 4


def type_info(raw_type: int) -> tuple[str, int, int]:
    """(name, values per block, bytes per block) of ggml type id ``raw_type``; the ``gguf``
    package is asked about types llaisys does not read. KeyError for an id neither knows."""
    if raw_type in BLOCK_SIZES:
        return (GGMLType(raw_type).name, *BLOCK_SIZES[raw_type])
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise KeyError(raw_type) from None
    return (qtype.name, *GGML_QUANT_SIZES[qtype])


def type_name(raw_type: int) -> str:
    """The name of ggml type id ``raw_type`` (``Q4_1``)."""
    return type_info(raw_type)[0]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a GGUF header, as stored."""

    name: str
    raw_type: int  # ggml type id
    dims: tuple[int, ...]  # ggml order: innermost (row length) first
    offset: int  # bytes from the start of the data section


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its entry and a read-only view of its bytes in the map."""

    name: str
    tensor_type: int  # a GGMLType for the types llaisys reads, else the raw id
    shape: tuple[int, ...]  # ggml order: innermost (row length) first
    n_bytes: int
    data_offset: int  # bytes from the start of the file
    data: np.ndarray  # F32/F16: values, NumPy order; other types: uint8, rows of stored bytes

    @property
    def type_name(self) -> str:
        """The stored type's name (``Q4_1``)."""
        return type_name(self.tensor_type)


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata (strings decoded, arrays as lists), tensors, and the map."""

    path: str
    data: np.ndarray  # uint8 (file size,), the whole file, read-only
    meta: dict[str, Any]
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int  # where the data section starts
    byte_order: str  # "<" or ">"


def check_layout(path: str, tensors: list[TensorInfo], data_start: int, alignment: int, file_size: int) -> None:
    """Check the header's tensors against the file before any of them is mapped: known types,
    no empty dimensions, whole quantization blocks per row, unique names, and byte ranges
    that start at a multiple of ``alignment``, end inside the file and overlap no other tensor.

    Raises ModelLoadError naming the file and the tensor.
    """
    spans = []
    names: set[str] = set()
    for t in tensors:
        if t.name in names:
            raise ModelLoadError(f"{path}: tensor {t.name!r} appears twice in the header")
        names.add(t.name)
        start = data_start + t.offset
        end = start + tensor_bytes(path, t)
        if t.offset % alignment:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} starts at data offset {t.offset}, "
                f"not a multiple of the alignment {alignment}"
            )
        if end > file_size:
            raise ModelLoadError(
                f"{path}: file is truncated: tensor {t.name!r} needs bytes up to {end} but the file has {file_size}"
            )
        spans.append((start, end, t.name))
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if end > start:
            raise ModelLoadError(
                f"{path}: tensor {name!r} ends at byte {end}, past the start of tensor {other!r} at byte {start}; "
                f"expected tensors that do not overlap"
            )


def tensor_bytes(path: str, t: TensorInfo) -> int:
    """Bytes tensor ``t`` takes in the data section (its type and dimensions checked)."""
    try:
        name, block, type_size = type_info(t.raw_type)
    except KeyError:
        supported = ", ".join(GGMLType(k).name for k in BLOCK_SIZES)
        raise ModelLoadError(f"{path}: tensor {t.name!r} has unknown type id {t.raw_type}; supported: {supported}") from None
    if 0 in t.dims:
        raise ModelLoadError(f"{path}: tensor {t.name!r} has a zero dimension in its shape {t.dims[::-1]}")
    if t.dims[0] % block:
        raise ModelLoadError(f"{path}: tensor {t.name!r} has rows of {t.dims[0]} values; {name} needs a multiple of {block}")
    return math.prod(t.dims) // block * type_size


def parse(path: str) -> GGUFFile:
    """Map ``path`` and parse its header and tensor table (OSError when it cannot be opened)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _Parser(path, mapped).file()


class _Parser:
    """One pass over a GGUF header; ``offs`` is the next byte to read."""

    def __init__(self, path: str, buf: mmap.mmap):
        self.path, self.buf, self.size, self.offs = path, buf, len(buf), 0
        self.set_order("<")

    def set_order(self, order: str) -> None:
        """Read numbers in byte order ``order`` (struct's and NumPy's "<" or ">") from now on."""
        self.order = order
        self.u32, self.u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")

    def fail(self, what: str) -> ValueError:
        """The error for ``what``, at the current byte, running past the end of the file."""
        return ValueError(f"{what} at byte {self.offs} runs past the end of the file ({self.size} bytes)")

    def unpack(self, fmt: struct.Struct) -> Any:
        """The one value of ``fmt`` at the current byte; moves past it."""
        try:
            (value,) = fmt.unpack_from(self.buf, self.offs)
        except struct.error:
            raise self.fail("a value") from None
        self.offs += fmt.size
        return value

    def raw_string(self) -> bytes:
        """The bytes of the string at the current byte (its u64 length, then them); moves past it."""
        n = self.unpack(self.u64)
        if n > self.size - self.offs:
            raise self.fail(f"a string of {n} bytes")
        start = self.offs
        self.offs += n
        return self.buf[start:self.offs]

    def file(self) -> GGUFFile:
        """The whole file: header, metadata, tensor table, then the tensors checked and mapped."""
        if self.buf[:4] != MAGIC:
            raise ValueError(f"not a GGUF file: it starts with {self.buf[:4]!r}, not {MAGIC!r}")
        self.offs = 4
        version = self.unpack(self.u32)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self.set_order(">")
            version = int.from_bytes(self.buf[4:8], "big")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported; expected {' or '.join(map(str, VERSIONS))}")
        n_tensors, n_kv = self.unpack(self.u64), self.unpack(self.u64)
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self.raw_string().decode("utf-8")
            if key in meta:
                raise ValueError(f"metadata key {key!r} appears twice")
            value_type = self.unpack(self.u32)
            if key == "general.alignment" and value_type != _UINT32:
                raise ValueError("general.alignment must be a UINT32")
            meta[key] = self.value(key, value_type)
        infos = [self.tensor_info() for _ in range(n_tensors)]
        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if alignment == 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment={alignment} is not a power of two")
        data_offset = -(-self.offs // alignment) * alignment
        check_layout(self.path, infos, data_offset, alignment, self.size)
        data = np.frombuffer(self.buf, np.uint8)
        tensors = [self.tensor(data, data_offset, t) for t in infos]
        return GGUFFile(self.path, data, meta, tensors, alignment, data_offset, self.order)

    def value(self, key: str, value_type: int) -> Any:
        """The value of metadata ``key``, of GGUF value type ``value_type``, at the current byte."""
        code = _SCALAR_CODES.get(value_type)
        if code is not None:
            return self.unpack(struct.Struct(self.order + code))
        if value_type == _STRING:
            raw = self.raw_string()
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise self.bad_text(key, exc) from None
        if value_type == _ARRAY:
            return self.array(key)
        raise ValueError(f"metadata key {key!r} has unknown value type {value_type}")

    def bad_text(self, key: str, exc: UnicodeDecodeError) -> ModelLoadError:
        """The error for text of metadata ``key`` that is not UTF-8."""
        return ModelLoadError(f"{self.path}: metadata key {key!r} holds text that is not valid UTF-8 ({exc})")

    def array(self, key: str) -> list:
        """An array's items as a list; nested arrays are flattened into it."""
        item_type, count = self.unpack(self.u32), self.unpack(self.u64)
        code = _SCALAR_CODES.get(item_type)
        if code is not None:
            dtype = np.dtype(self.order + _NUMPY_CODES[code])
            if count > (self.size - self.offs) // dtype.itemsize:
                raise self.fail(f"an array of {count} items")
            items = np.frombuffer(self.buf, dtype, count, self.offs)
            self.offs += count * dtype.itemsize
            return items.tolist()
        if item_type == _STRING:
            return self.strings(key, count)
        if item_type == _ARRAY:
            if count > (self.size - self.offs) // 12:  # an array takes at least its type and count
                raise self.fail(f"an array of {count} arrays")
            return [item for _ in range(count) for item in self.array(key)]
        raise ValueError(f"metadata key {key!r} has arrays of unknown value type {item_type}")

    def strings(self, key: str, count: int) -> list[str]:
        """``count`` strings: gathered by the native library when it is built and they are well
        formed, else (and to report what is wrong) one at a time."""
        gathered = _gather_strings(self.buf, self.size, self.offs, count, self.order == ">")
        if gathered is None:
            return self.strings_one_by_one(key, count)
        self.offs, items = gathered
        return items

    def strings_one_by_one(self, key: str, count: int) -> list[str]:
        # The vocabulary and merges hold ~100k strings: one tight loop, no per-item calls.
        buf, size, u64 = self.buf, self.size, self.u64.unpack_from
        offs = self.offs
        if count > (size - offs) // 8:
            raise self.fail(f"an array of {count} strings")
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                start = offs + 8
                offs = start + u64(buf, offs)[0]
                if offs > size:
                    break
                append(buf[start:offs].decode("utf-8"))
        except struct.error:
            offs = size + 1
        except UnicodeDecodeError as exc:
            raise self.bad_text(key, exc) from None
        if offs > size:
            self.offs = start - 8
            raise self.fail(f"string {len(out)} of {key!r}")
        self.offs = offs
        return out

    def tensor_info(self) -> TensorInfo:
        """The tensor table entry at the current byte."""
        name = self.raw_string().decode("utf-8")
        n_dims = self.unpack(self.u32)
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has {n_dims} dimensions; expected 1 to {GGML_MAX_DIMS}")
        dims = tuple(self.unpack(self.u64) for _ in range(n_dims))
        return TensorInfo(name, self.unpack(self.u32), dims, self.unpack(self.u64))

    def tensor(self, data: np.ndarray, data_offset: int, t: TensorInfo) -> GGUFTensor:
        """Entry ``t`` with a view of its bytes in ``data`` (the whole file; checked by check_layout)."""
        _, block, type_size = type_info(t.raw_type)
        n_bytes = math.prod(t.dims) // block * type_size
        start = data_offset + t.offset
        shape = t.dims[::-1]  # NumPy order
        raw = data[start:start + n_bytes]
        if t.raw_type in (GGMLType.F32, GGMLType.F16):
            view = raw.view(np.dtype(self.order + ("f4" if t.raw_type == GGMLType.F32 else "f2"))).reshape(shape)
        else:
            view = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        kind = GGMLType(t.raw_type) if t.raw_type in BLOCK_SIZES else t.raw_type
        return GGUFTensor(t.name, kind, t.dims, n_bytes, start, view)


_library: list = []  # [the library or None], once looked up


def _gather_strings(buf: mmap.mmap, size: int, offs: int, count: int, big_endian: bool) -> tuple[int, list[str]] | None:
    """(end, strings) of the string array of ``count`` items at ``offs``, gathered by
    csrc/gguf in one pass and decoded at once; None when that library is not built or the
    array needs the one-by-one loop (it runs past the end, is not UTF-8, or holds 0 bytes)."""
    if not _library:
        _library.append(_native.optional("gguf", "the native GGUF reader (llaisys._native._gguf) is not "
                                         "built: GGUF vocabularies are read in Python, more slowly"))
    lib = _library[0]
    if lib is None or count > (size - offs) // 8:
        return None
    address = np.frombuffer(buf, np.uint8).ctypes.data
    total = ctypes.c_int64()
    end = lib.llaisys_gguf_strings(address, size, offs, count, big_endian, None, ctypes.byref(total))
    if end < 0:
        return None
    out = np.empty(total.value, np.uint8)
    lib.llaisys_gguf_strings(address, size, offs, count, big_endian, out.ctypes.data, ctypes.byref(total))
    try:
        items = out.tobytes().decode("utf-8").split("\0")
    except UnicodeDecodeError:
        return None
    items.pop()  # the empty text after the last 0
    return (end, items) if len(items) == count else None
