"""GGML's tensor types as GGUF files store them: the one table of their ids, names and block
geometry. Every other view of them reads it: the data types (``dtypes.DataType.block_size``),
the GGUF reader (``models.loaders.gguf_file``), the quantized kernels (``kernels.quant.formats``),
the tensor-parallel split and the NVIDIA kernels. The C kernels keep their own structs, and
``tests/test_quant_kernels.py`` checks their sizes against this table.

A row of K elements is K / block_size blocks of block_bytes bytes each, back to back; a matrix
(N, K) is N such rows, i.e. a uint8 array (N, row_bytes(K)). F32, F16 and BF16 are formats with
one element per block.
"""
from __future__ import annotations

from dataclasses import dataclass

QK = 32     # elements per block of the 32-element formats
QK_K = 256  # elements per K-quant super-block


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """One GGML tensor type: its id in GGUF files, its name, elements and bytes per block."""

    type_id: int
    name: str
    block_size: int   # elements per block
    block_bytes: int  # bytes per block

    @property
    def is_block_format(self) -> bool:
        """True for the quantized formats (more than one element per block)."""
        return self.block_size > 1

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


# In GGML's order of ids. Q2_K and Q3_K are read (dequantized at load) but not computed on.
BLOCK_FORMATS = (
    BlockFormat(0, "F32", 1, 4),
    BlockFormat(1, "F16", 1, 2),
    BlockFormat(2, "Q4_0", QK, 2 + QK // 2),
    BlockFormat(3, "Q4_1", QK, 2 + 2 + QK // 2),
    BlockFormat(6, "Q5_0", QK, 2 + 4 + QK // 2),
    BlockFormat(7, "Q5_1", QK, 2 + 2 + 4 + QK // 2),
    BlockFormat(8, "Q8_0", QK, 2 + QK),
    BlockFormat(10, "Q2_K", QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    BlockFormat(11, "Q3_K", QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    BlockFormat(12, "Q4_K", QK_K, 2 + 2 + 12 + QK_K // 2),
    BlockFormat(13, "Q5_K", QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    BlockFormat(14, "Q6_K", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    BlockFormat(30, "BF16", 1, 2),
)

BY_ID: dict[int, BlockFormat] = {f.type_id: f for f in BLOCK_FORMATS}
BY_NAME: dict[str, BlockFormat] = {f.name: f for f in BLOCK_FORMATS}


def block_format(kind: int | str) -> BlockFormat:
    """The format of GGML type id ``kind`` (an int, or an IntEnum such as ``gguf.GGMLQuantizationType``)
    or name (``"Q4_K"``, case-insensitive); KeyError naming the known ones otherwise."""
    found = BY_NAME.get(kind.upper()) if isinstance(kind, str) else BY_ID.get(int(kind))
    if found is None:
        known = ", ".join(f"{f.name} ({f.type_id})" for f in BLOCK_FORMATS)
        raise KeyError(f"unknown GGML type {kind!r}; known: {known}")
    return found
