"""linear (Y = X W^T + b) on the CPU through BLAS.

F16 and BF16 weights are widened to F32 a block of rows at a time into a reused buffer, so a
large matrix (the 49152 x 576 output head) is never copied whole and the block stays in cache.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import threading

import numpy as np

from ..registry import register_kernel
from ._common import FLOATS, f32

if TYPE_CHECKING:
    from ...tensor import Tensor

_BLOCK_BYTES = 4 << 20  # F32 bytes of weight widened per BLAS call
_scratch = threading.local()


def _weight_buffer(rows: int, cols: int) -> np.ndarray:
    """A reusable F32 buffer of at least ``rows * cols`` elements, viewed as (rows, cols)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < rows * cols:
        buf = _scratch.buf = np.empty(rows * cols, np.float32)
    return buf[: rows * cols].reshape(rows, cols)


@register_kernel("linear", "cpu", dtypes=FLOATS)
def linear(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out (..., N) = in (..., K) @ weight (N, K)^T + bias (N,) for inputs (in, weight, bias or None)."""
    out = outputs[0].host_array()  # (..., N)
    x_t, w_t, b_t = inputs
    x, w = x_t.host_array(), w_t.host_array()  # (..., K), (N, K)
    if x.ndim != 2 and x.flags.c_contiguous and out.flags.c_contiguous:
        # One GEMM over all rows rather than one per leading index.
        x, out = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])  # (M, K), (M, N)
    bias = None if b_t is None else b_t.host_array()  # (N,)
    if out.dtype == np.float32:
        np.matmul(x, w.T, out=out)
        if bias is not None:
            out += bias
        return
    x32 = f32(x)
    bias32 = None if bias is None else f32(bias)
    n, k = w.shape
    rows = max(1, _BLOCK_BYTES // (4 * max(k, 1)))
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        w32 = _weight_buffer(stop - start, k)  # (rows, K)
        w32[...] = w[start:stop]
        part = np.matmul(x32, w32.T)  # (..., rows)
        if bias32 is not None:
            part += bias32[start:stop]
        out[..., start:stop] = part  # rounded once, to the output type
