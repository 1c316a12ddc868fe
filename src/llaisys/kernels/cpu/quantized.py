"""linear and embedding on weights kept as stored: GGUF block formats (Q4_0 ... Q6_K) with any
float activations, and F16/BF16 weights with F32 activations, through ``kernels.quant.native``.

Activations are float32 (F16/BF16 ones are widened, the output rounded once) and never
quantized. Each weight's checked ``QuantWeight`` is kept with its tensor (``Tensor.derived``),
so a call costs a few microseconds of Python on top of the native kernel. ``linear`` is
batch-invariant: a row of the output has the same bits whatever the other rows of the input
are (the native kernels compute every output one fixed way; ``kernels.quant.native``). Where
the native library was not built (no C compiler at install), the NumPy reference decodes the
weight a tile of rows at a time instead, each input row multiplied on its own so the rule
still holds: the same results up to rounding, far slower, said once in the log.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ...runtime.dtypes import QUANTIZED_TYPES, DataType
from ..quant import native, reference
from . import native_calls
from ..registry import register_kernel
from ._common import FLOATS, f32

if TYPE_CHECKING:
    from ...tensor import Tensor

_FORMAT = {t: t.name for t in QUANTIZED_TYPES} | {DataType.F16: "F16", DataType.BF16: "BF16"}
_TILE_ELEMENTS = 1 << 20  # float32 elements of weight decoded at a time by the portable path

log = logging.getLogger(__name__)
_warned: list[bool] = []


class PortableWeight:
    """The interface of ``native.QuantWeight`` over the NumPy reference decoder, for a build
    without the native library: ``linear`` decodes a tile of rows at a time."""

    def __init__(self, fmt: str, raw: np.ndarray):
        self.fmt, self.raw = fmt, raw  # (N, row_bytes) uint8, or (N, K) F16/BF16

    def _decode(self, raw_rows: np.ndarray) -> np.ndarray:
        if self.fmt in ("F16", "BF16"):
            return raw_rows.astype(np.float32)
        return reference.dequantize(self.fmt, raw_rows)  # (rows, K)

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` (S,) of the weight as float32 (S, K)."""
        return self._decode(self.raw[np.asarray(index, np.int64)])

    def linear(self, x: np.ndarray, bias: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """x (M, K) float32 @ weight (N, K)^T + bias (N,) into out (M, N) (new when None).

        Each row of x is multiplied alone, from the same buffers (one matrix-vector product
        per row and tile), so its result does not depend on M or on the other rows."""
        m, k = x.shape
        n = self.raw.shape[0]
        out = np.empty((m, n), np.float32) if out is None else out
        step = max(1, _TILE_ELEMENTS // max(k, 1))
        row = np.empty(k, np.float32)  # (K,)
        result = np.empty(min(step, n), np.float32)  # (tile rows,)
        for start in range(0, n, step):
            stop = min(start + step, n)
            w = self._decode(self.raw[start:stop])  # (tile rows, K)
            for r in range(m):
                row[...] = x[r]
                np.matmul(w, row, out=result[: stop - start])
                out[r, start:stop] = result[: stop - start]
        if bias is not None:
            out += bias
        return out


def repacks(dtype: DataType) -> bool:
    """Whether ``linear`` on the CPU keeps a weight of block format ``dtype`` repacked for the
    integer arithmetic now in use (and so reads its stored bytes no more once it has run)."""
    return dtype in QUANTIZED_TYPES and native.available() and native.packs(_FORMAT[dtype])


def prepare_weight(w_t: "Tensor") -> None:
    """Check a block-format weight on the CPU now, and in an integer arithmetic repack it, as
    ``linear``'s first call on it would: at load, so that no request pays for it."""
    if w_t.device.is_cpu and w_t.dtype in QUANTIZED_TYPES and native.available():
        w_t.derived("quant", _prepare)


def _prepare(w_t: "Tensor") -> "native.QuantWeight | PortableWeight":
    """The weight (N, K) checked once for the native kernels (an F16/BF16 view that is not
    C-contiguous is copied once, kept with the tensor)."""
    w = np.ascontiguousarray(w_t.host_array())  # (N, row_bytes) uint8, or (N, K) F16/BF16
    if not native.available():
        if not _warned:
            _warned.append(True)
            log.warning("the native kernels (llaisys._native._kernels) are not built: quantized and 16-bit "
                        "weights run on the slow NumPy path; reinstall llaisys with a C compiler on PATH")
        return PortableWeight(_FORMAT[w_t.dtype], w)
    weight = native.prepare(_FORMAT[w_t.dtype], w)
    if weight.packed is not None and w_t.is_contiguous():
        # the kernels read the packed copy: where the stored bytes are the file's memory map, its
        # pages need not stay in this process (an embedding lookup of a tied head reads its rows
        # from the file again)
        w_t.storage.drop_file_pages(w_t.offset, w.nbytes)
    return weight


def _no_calls(out_t: "Tensor") -> dict:
    return {}


@dataclass(slots=True)
class _BoundLinear:
    """A linear call kept with its output (by its inputs' ids): the tensors, which keep their
    ids theirs, and the native call bound to their memory (None: the general path runs)."""

    x: "Tensor"
    w: "Tensor"
    bias: "Tensor | None"
    call: "Callable[[], None] | None"


def _rows(a: np.ndarray) -> np.ndarray:
    """``a`` (..., C) as float32 (M, C), C-contiguous (a view when it already is)."""
    a2 = a.reshape(-1, a.shape[-1])
    if a2.dtype != np.float32 or not a2.flags.c_contiguous:
        a2 = np.ascontiguousarray(a2, dtype=np.float32)
    return a2


def _bindable(out_t: "Tensor", x_t: "Tensor", w_t: "Tensor", b_t: "Tensor | None") -> tuple | None:
    """(weight, x (M, K), bias (N,) or None, out (M, N)) as arrays over the tensors' memory, for a
    native call made once and repeated; None where the general path must run: no native
    library, a non-F32 input or output, an input whose rows are not one contiguous run at one
    stride, an output aliasing the input."""
    qw = w_t.derived("quant", _prepare)
    if not isinstance(qw, native.QuantWeight):
        return None
    x, out = x_t.host_array(), out_t.host_array()  # (..., K), (..., N)
    bias = None if b_t is None else b_t.host_array()  # (N,)
    if x.dtype != np.float32 or out.dtype != np.float32:
        return None
    if bias is not None and (bias.dtype != np.float32 or bias.strides != (4,)):
        return None
    if out.ndim == 2:  # rows at any stride (a column range of a wider buffer): the kernel takes one
        if out.strides[1] != 4 or (out.shape[0] > 1 and out.strides[0] < 4 * out.shape[1]):
            return None
        out2 = out  # (M, N)
    elif out.flags.c_contiguous:
        out2 = out.reshape(-1, out.shape[-1])  # (M, N)
    else:
        return None
    x2 = _rows(x)  # (M, K)
    if not np.may_share_memory(x2, x) or np.may_share_memory(out2, x2):  # a copy of x, or out aliasing it
        return None
    return qw, x2, bias, out2


def _bound_call(out_t: "Tensor", x_t: "Tensor", w_t: "Tensor", b_t: "Tensor | None") -> "Callable[[], None] | None":
    """The native call of this linear bound to the tensors' memory (``QuantWeight.bind``), or
    None where the general path must run (``_bindable``)."""
    parts = _bindable(out_t, x_t, w_t, b_t)
    return None if parts is None else parts[0].bind(*parts[1:])


def native_linear(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                  attrs: dict[str, Any]) -> "native_calls.NativeCall | None":
    """``linear`` as a C function and its argument block, for a replayed plan (None: the
    ordinary call must run)."""
    parts = _bindable(outputs[0], *inputs)
    if parts is None or not native_calls.available():
        return None
    made = parts[0].call_block(*parts[1:])
    if made is None:
        return None
    return native_calls.NativeCall(f"linear of {parts[0]!r}", made[0], made[1], keep=parts)


def linear(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out (..., N) = in (..., K) @ weight (N, K)^T + bias (N,) for inputs (in, weight, bias or
    None), weight block-quantized or F16/BF16 (then in and out F32).

    A call repeated on the same tensors (a replayed decoding step) runs the native call bound
    to them the first time, kept with the output tensor by its input tensors."""
    out_t = outputs[0]
    x_t, w_t, b_t = inputs
    bound = out_t.derived("quant.linear", _no_calls)  # (ids of x, w, bias) -> _BoundLinear
    entry = bound.get((id(x_t), id(w_t), id(b_t)))
    if entry is None:
        entry = bound[(id(x_t), id(w_t), id(b_t))] = _BoundLinear(x_t, w_t, b_t, _bound_call(out_t, x_t, w_t, b_t))
    if entry.call is not None:
        entry.call()
        return
    qw = w_t.derived("quant", _prepare)
    x, out = x_t.host_array(), out_t.host_array()  # (..., K), (..., N)
    bias = None if b_t is None else f32(b_t.host_array())  # (N,)
    x2 = _rows(x)  # (M, K)
    direct = out.dtype == np.float32 and out.flags.c_contiguous
    out2 = out.reshape(-1, out.shape[-1]) if direct else None  # (M, N) view of out, or a new array
    if direct and np.may_share_memory(out2, x2):  # out aliases in: keep the input intact
        x2 = x2.copy()
    y = qw.linear(x2, None if bias is None else np.ascontiguousarray(bias), out2)  # (M, N)
    if not direct:
        out[...] = y.reshape(out.shape)  # rounded once, to the output type


def embedding(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out (S, D) = rows index (S,) I64 of a block-quantized weight (V, D), dequantized;
    ValueError for an index outside [0, V)."""
    out = outputs[0].host_array()  # (S, D)
    index = inputs[0].host_array()  # (S,)
    w_t = inputs[1]
    n = w_t.shape[0]
    if index.size and (index.min() < 0 or index.max() >= n):
        bad = index[(index < 0) | (index >= n)][0]
        raise ValueError(f"embedding: index {int(bad)} is out of range for a table of {n} rows")
    out[...] = w_t.derived("quant", _prepare).rows(index)  # (S, D) float32


def native_embedding(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                     attrs: dict[str, Any]) -> "native_calls.NativeCall | None":
    """``embedding`` of a block-quantized table as one C call (``llaisys_quant_gather_call``:
    each row dequantized as ``QuantWeight.rows`` does it, the same bits), for a replayed plan:
    a pass's first op then runs inside its native stretch. The index is read at every run; an
    index out of range raises the direct call's ValueError. None for a non-F32 output, strided
    rows, or without the native library."""
    from ... import _native
    from ..._native import structs

    (out,), (index, weight) = outputs, inputs
    if out.dtype is not DataType.F32 or out.strides[-1] != 1 or out.ndim != 2 or not native_calls.available():
        return None
    lib = _native.load("kernels")
    qw = weight.derived("quant", _prepare)
    if lib is None or not hasattr(lib, "llaisys_quant_gather_call") or not isinstance(qw, native.QuantWeight):
        return None
    block = structs.QuantGatherCall(qw.fmt.type_id, qw.n, qw.k, index.strides[0], out.shape[0], out.strides[0],
                                    qw.raw.ctypes.data, index.data_ptr, out.data_ptr, (0, 0))

    def fail(status: int) -> None:
        raise ValueError(f"embedding: index {block.bad[1]} is out of range for a table of {qw.n} rows")

    return native_calls.NativeCall("embedding", native_calls.address(lib, "llaisys_quant_gather_call"), block,
                                   keep=(out, index, weight, qw), fail=fail)


embedding.native_call = native_embedding  # type: ignore[attr-defined]
linear.native_call = native_linear  # type: ignore[attr-defined]
register_kernel("linear", "cpu", dtypes=FLOATS, weight_dtypes=QUANTIZED_TYPES, kernel=linear)
register_kernel("linear", "cpu", dtypes=(DataType.F32,), weight_dtypes=(DataType.F16, DataType.BF16), kernel=linear)
register_kernel("embedding", "cpu", dtypes=FLOATS, weight_dtypes=QUANTIZED_TYPES, kernel=embedding)
