"""argmax and embedding on the CPU."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..._native import structs
from ...runtime.dtypes import DataType
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
    """out (S, D) = weight (V, D) rows at index (S,) I64 (an F16/BF16 weight's rows widened to
    an F32 out exactly); ValueError for an index outside [0, V)."""
    out = outputs[0].host_array()  # (S, D)
    index = inputs[0].host_array()  # (S,)
    weight = inputs[1].host_array()  # (V, D)
    if index.size and (index.min() < 0 or index.max() >= weight.shape[0]):
        bad = index[(index < 0) | (index >= weight.shape[0])][0]
        raise ValueError(f"embedding: index {int(bad)} is out of range for a table of {weight.shape[0]} rows")
    if weight.dtype == out.dtype:
        np.take(weight, index, axis=0, out=out)
    else:
        out[...] = weight[index]  # widened on the assignment


_WIDEN = {DataType.F16: 1, DataType.BF16: 2}  # LO_GATHER_F16, LO_GATHER_BF16 of csrc/ops/ops.h


def native_embedding(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                     attrs: dict[str, Any]) -> "native_calls.NativeCall | None":
    """``embedding`` as a row gather in C (``llaisys_ops_gather_call``: the same bytes as
    ``np.take``, or an F16/BF16 table's rows widened to F32 exactly), for a replayed plan: a batched pass's gather of the rows whose logits it
    wants then stays inside the pass's native stretch. The index is read at every run; an
    index out of range raises the direct call's ValueError. None where rows are strided or
    the library lacks the call."""
    from ... import _native
    from . import native_calls

    (out,), (index, weight) = outputs, inputs
    lib = _native.load("ops")
    widen = 0 if weight.dtype is out.dtype else _WIDEN.get(weight.dtype) if out.dtype is DataType.F32 else None
    if (lib is None or not hasattr(lib, "llaisys_ops_gather_call") or not native_calls.available()
            or out.strides[-1] != 1 or weight.strides[-1] != 1 or widen is None):
        return None
    z = out.dtype.itemsize
    block = structs.GatherCall(out.data_ptr, out.strides[0] * z, index.data_ptr, index.strides[0], weight.data_ptr,
                               weight.strides[0] * weight.dtype.itemsize, out.shape[0], out.shape[1] * z,
                               weight.shape[0], (0, 0), widen)

    def fail(status: int) -> None:
        raise ValueError(f"embedding: index {block.bad[1]} is out of range for a table of {weight.shape[0]} rows")

    return native_calls.NativeCall("embedding", native_calls.address(lib, "llaisys_ops_gather_call"), block,
                                   keep=(out, index, weight), fail=fail)


embedding.native_call = native_embedding  # type: ignore[attr-defined]
register_kernel("embedding", "cpu", dtypes=(DataType.F32,), weight_dtypes=(DataType.F16, DataType.BF16),
                kernel=embedding)
