"""Data types: the public enum (numbering fixed by the runtime's C header, plus llaisys's
block-quantized extensions), sizes and NumPy mapping."""
from __future__ import annotations

import enum

import ml_dtypes
import numpy as np

from .block_formats import BY_ID


# Block-quantized types are llaisys extensions outside ``llaisysDataType_t`` (0..19): value =
# GGML_TYPE_BASE + the GGML type id, so the GGUF type of Q4_1 (103) is 3. Plugins never see them.
GGML_TYPE_BASE = 100


class DataType(enum.IntEnum):
    """Element type of a tensor; values 0..19 match ``llaisysDataType_t``. Q4_0 ... Q6_K are
    GGUF block formats (value ``GGML_TYPE_BASE + GGML type id``): K elements of a row are
    stored as K / block_size blocks of block_bytes bytes; tensors of them are 2-D weights."""

    INVALID = 0
    BYTE = 1
    BOOL = 2
    I8 = 3
    I16 = 4
    I32 = 5
    I64 = 6
    U8 = 7
    U16 = 8
    U32 = 9
    U64 = 10
    F8 = 11
    F16 = 12
    F32 = 13
    F64 = 14
    C16 = 15
    C32 = 16
    C64 = 17
    C128 = 18
    BF16 = 19
    Q4_0 = GGML_TYPE_BASE + 2
    Q4_1 = GGML_TYPE_BASE + 3
    Q5_0 = GGML_TYPE_BASE + 6
    Q5_1 = GGML_TYPE_BASE + 7
    Q8_0 = GGML_TYPE_BASE + 8
    Q4_K = GGML_TYPE_BASE + 12
    Q5_K = GGML_TYPE_BASE + 13
    Q6_K = GGML_TYPE_BASE + 14

    @property
    def itemsize(self) -> int:
        """Bytes per element; TypeError for a block format, whose elements share bytes."""
        try:
            return _ITEMSIZE[self]
        except KeyError:
            raise TypeError(f"{self.name} stores {self.block_size} elements in {self.block_bytes} bytes: it has no "
                            "per-element size; use nbytes_of") from None

    @property
    def is_quantized(self) -> bool:
        """True for the block formats (Q4_0 ... Q6_K)."""
        return self in _BLOCKS

    @property
    def block_size(self) -> int:
        """Elements per block: 32 or 256 for the block formats, 1 for the others."""
        return _BLOCKS[self][0] if self in _BLOCKS else 1

    @property
    def block_bytes(self) -> int:
        """Bytes per block: e.g. 20 for Q4_1; the itemsize for the others."""
        return _BLOCKS[self][1] if self in _BLOCKS else _ITEMSIZE[self]

    @property
    def ggml_type(self) -> int:
        """The GGML type id of a block format (3 for Q4_1); ValueError for the others."""
        if self not in _BLOCKS:
            raise ValueError(f"{self.name} is not a GGML block format")
        return int(self) - GGML_TYPE_BASE

    def nbytes_of(self, n: int) -> int:
        """Bytes of ``n`` elements; for a block format ``n`` must be whole blocks (ValueError)."""
        block = _BLOCKS.get(self)
        if block is None:
            return n * _ITEMSIZE[self]
        if n % block[0]:
            raise ValueError(f"{n} elements of {self.name} are not whole blocks of {block[0]}")
        return n // block[0] * block[1]

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype with the same bytes; raises for types NumPy cannot hold (C16, C32 and
        the block formats, whose raw bytes are uint8)."""
        try:
            return _TO_NUMPY[self]
        except KeyError:
            raise TypeError(f"data type {self.name} has no NumPy equivalent") from None

    @property
    def is_floating(self) -> bool:
        """True for the real floating-point types (F8, F16, BF16, F32, F64)."""
        return self in (DataType.F8, DataType.F16, DataType.F32, DataType.F64, DataType.BF16)


MemcpyKind = enum.IntEnum("MemcpyKind", {"H2H": 0, "H2D": 1, "D2H": 2, "D2D": 3})
MemcpyKind.__doc__ = "Direction of a memory copy; values match ``llaisysMemcpyKind_t``."

_ITEMSIZE = {
    DataType.INVALID: 0, DataType.BYTE: 1, DataType.BOOL: 1, DataType.I8: 1, DataType.I16: 2,
    DataType.I32: 4, DataType.I64: 8, DataType.U8: 1, DataType.U16: 2, DataType.U32: 4,
    DataType.U64: 8, DataType.F8: 1, DataType.F16: 2, DataType.F32: 4, DataType.F64: 8,
    DataType.C16: 2, DataType.C32: 4, DataType.C64: 8, DataType.C128: 16, DataType.BF16: 2,
}

# Block formats: (elements, bytes) per block, from the one table of them.
_BLOCKS = {t: (BY_ID[t - GGML_TYPE_BASE].block_size, BY_ID[t - GGML_TYPE_BASE].block_bytes)
           for t in DataType if t >= GGML_TYPE_BASE}
QUANTIZED_TYPES = tuple(_BLOCKS)

_TO_NUMPY = {
    DataType.BYTE: np.dtype(np.uint8), DataType.BOOL: np.dtype(np.bool_),
    DataType.I8: np.dtype(np.int8), DataType.I16: np.dtype(np.int16),
    DataType.I32: np.dtype(np.int32), DataType.I64: np.dtype(np.int64),
    DataType.U8: np.dtype(np.uint8), DataType.U16: np.dtype(np.uint16),
    DataType.U32: np.dtype(np.uint32), DataType.U64: np.dtype(np.uint64),
    DataType.F8: np.dtype(ml_dtypes.float8_e4m3fn), DataType.F16: np.dtype(np.float16),
    DataType.F32: np.dtype(np.float32), DataType.F64: np.dtype(np.float64),
    DataType.C64: np.dtype(np.complex64), DataType.C128: np.dtype(np.complex128),
    DataType.BF16: np.dtype(ml_dtypes.bfloat16),
}

# uint8 maps back to U8, not BYTE: BYTE is only chosen explicitly.
_FROM_NUMPY = {v: k for k, v in _TO_NUMPY.items() if k is not DataType.BYTE}

_BY_NAME = {
    **{t.name.lower(): t for t in DataType if t is not DataType.INVALID},
    "float32": DataType.F32, "float": DataType.F32, "float16": DataType.F16, "half": DataType.F16,
    "bfloat16": DataType.BF16, "float64": DataType.F64, "double": DataType.F64,
    "int64": DataType.I64, "int32": DataType.I32, "int16": DataType.I16, "int8": DataType.I8,
    "uint8": DataType.U8, "bool": DataType.BOOL,
}


def as_dtype(value: "DataType | str | np.dtype | type") -> DataType:
    """Convert a DataType, a name ("f32", "bfloat16") or a NumPy dtype to a DataType.

    Raises ValueError for an unknown name and TypeError for anything else without a match.
    """
    if isinstance(value, DataType):
        return value
    if value is None:  # np.dtype(None) would silently mean float64
        raise TypeError("expected a data type (a DataType, a name such as 'f32', or a NumPy dtype), got None")
    if isinstance(value, str):
        found = _BY_NAME.get(value.lower())
        if found is not None:
            return found
        try:  # NumPy spellings such as "<f4" or "bfloat16" via ml_dtypes
            npd = np.dtype(value)
        except TypeError:
            raise ValueError(f"unknown data type {value!r}; expected one of {sorted(_BY_NAME)}") from None
        return as_dtype(npd)
    try:
        npd = np.dtype(value)
    except TypeError:
        raise TypeError(f"cannot interpret {value!r} as a data type") from None
    try:
        return _FROM_NUMPY[npd.newbyteorder("=") if npd.byteorder == ">" else npd]
    except KeyError:
        raise TypeError(f"NumPy dtype {npd} has no llaisys data type") from None
