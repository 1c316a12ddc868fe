"""The weight formats the quantized kernels handle: those of ``runtime.block_formats`` that
they compute on (F32, F16, BF16 and the block formats Q4_0 ... Q6_K; not Q2_K or Q3_K, which
are dequantized at load).
"""
from __future__ import annotations

from ...runtime.block_formats import QK, QK_K, BlockFormat, block_format

_HANDLED = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_ALL = tuple(block_format(name) for name in _HANDLED)

FORMATS: dict[int, BlockFormat] = {f.type_id: f for f in _ALL}

__all__ = ["FORMATS", "QK", "QK_K", "BlockFormat", "get_format"]


def get_format(qtype: int | str | BlockFormat) -> BlockFormat:
    """The format of a GGML type given by id (an int or ``gguf.GGMLQuantizationType``) or name
    (``"Q4_K"``, case-insensitive); ValueError naming the supported ones otherwise."""
    if isinstance(qtype, BlockFormat):
        return qtype
    try:
        found = block_format(qtype if isinstance(qtype, str) else int(qtype))
    except (KeyError, TypeError, ValueError):
        found = None
    if found is None or found not in _ALL:
        supported = ", ".join(f"{f.name} ({f.type_id})" for f in _ALL)
        label = getattr(qtype, "name", None) or repr(qtype)
        raise ValueError(f"unsupported weight type {label}: the quantized kernels handle {supported}")
    return found
