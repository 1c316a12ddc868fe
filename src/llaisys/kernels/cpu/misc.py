"""argmax and embedding on the CPU."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..registry import register_kernel
from ._common import FLOATS

if TYPE_CHECKING:
    from ...tensor import Tensor


@register_kernel("argmax", "cpu", dtypes=FLOATS)
def argmax(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """outputs (max_idx I64, max_val) = index and value of the maximum over the last dim of vals (..., n)."""
    idx_out, val_out = (t.host_array() for t in outputs)
    vals = inputs[0].host_array()  # (..., n)
    idx = np.argmax(vals, axis=-1)  # (...)
    idx_out[...] = np.reshape(idx, idx_out.shape)
    val_out[...] = np.reshape(np.take_along_axis(vals, idx[..., None], axis=-1), val_out.shape)


@register_kernel("embedding", "cpu", dtypes=FLOATS)
def embedding(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out (S, D) = weight (V, D) rows at index (S,) I64; ValueError for an index outside [0, V)."""
    out = outputs[0].host_array()  # (S, D)
    index = inputs[0].host_array()  # (S,)
    weight = inputs[1].host_array()  # (V, D)
    if index.size and (index.min() < 0 or index.max() >= weight.shape[0]):
        bad = index[(index < 0) | (index >= weight.shape[0])][0]
        raise ValueError(f"embedding: index {int(bad)} is out of range for a table of {weight.shape[0]} rows")
    np.take(weight, index, axis=0, out=out)
