"""The GGUF weight formats the quantized kernels handle: type ids, names and block geometry.

A row of K elements is K / block_size blocks of block_bytes bytes each, back to back, exactly
as a GGUF file stores it; a weight matrix (N, K) is N such rows, i.e. a uint8 array
(N, row_bytes(K)). F32, F16 and BF16 are "formats" with one element per block.
"""
from __future__ import annotations

from dataclasses import dataclass

QK = 32     # elements per block of the 32-element formats
QK_K = 256  # elements per K-quant super-block


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """One weight format: GGML type id, name, elements and bytes per block."""

    type_id: int
    name: str
    block_size: int   # elements per block
    block_bytes: int  # bytes per block

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` elements; ValueError unless ``k`` is a positive multiple of the block."""
        if k <= 0 or k % self.block_size:
            raise ValueError(f"{self.name} rows hold whole blocks of {self.block_size} elements, got K={k}")
        return k // self.block_size * self.block_bytes

    def row_elements(self, row_bytes: int) -> int:
        """Elements K in a row of ``row_bytes`` bytes; ValueError unless it is a positive number of blocks."""
        if row_bytes <= 0 or row_bytes % self.block_bytes:
            raise ValueError(f"{self.name} rows hold whole blocks of {self.block_bytes} bytes, "
                             f"got {row_bytes} bytes per row")
        return row_bytes // self.block_bytes * self.block_size


_ALL = (
    QuantFormat(0, "F32", 1, 4),
    QuantFormat(1, "F16", 1, 2),
    QuantFormat(30, "BF16", 1, 2),
    QuantFormat(2, "Q4_0", QK, 2 + QK // 2),
    QuantFormat(3, "Q4_1", QK, 2 + 2 + QK // 2),
    QuantFormat(6, "Q5_0", QK, 2 + 4 + QK // 2),
    QuantFormat(7, "Q5_1", QK, 2 + 2 + 4 + QK // 2),
    QuantFormat(8, "Q8_0", QK, 2 + QK),
    QuantFormat(12, "Q4_K", QK_K, 2 + 2 + 12 + QK_K // 2),
    QuantFormat(13, "Q5_K", QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    QuantFormat(14, "Q6_K", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
)

FORMATS: dict[int, QuantFormat] = {f.type_id: f for f in _ALL}
_BY_NAME = {f.name: f for f in _ALL}


def get_format(qtype: int | str | QuantFormat) -> QuantFormat:
    """The format of a GGML type given by id (an int or ``gguf.GGMLQuantizationType``) or name
    (``"Q4_K"``, case-insensitive); ValueError naming the supported ones otherwise."""
    if isinstance(qtype, QuantFormat):
        return qtype
    if isinstance(qtype, str):
        found = _BY_NAME.get(qtype.upper())
    else:
        try:
            found = FORMATS.get(int(qtype))
        except (TypeError, ValueError):
            found = None
    if found is None:
        supported = ", ".join(f"{f.name} ({f.type_id})" for f in _ALL)
        label = getattr(qtype, "name", None) or repr(qtype)
        raise ValueError(f"unsupported weight type {label}: the quantized kernels handle {supported}")
    return found
