"""linear (Y = X W^T + b) on the CPU through BLAS."""
from __future__ import annotations

import numpy as np

from ..registry import register_kernel
from ._common import FLOATS, f32


@register_kernel("linear", "cpu", dtypes=FLOATS)
def linear(outputs, inputs, attrs) -> None:
    out = outputs[0].host_array()
    x_t, w_t, b_t = inputs
    x, w = x_t.host_array(), w_t.host_array()
    if out.dtype == np.float32:
        np.matmul(x, w.T, out=out)  # (..., K) @ (K, N) -> (..., N)
        if b_t is not None:
            out += b_t.host_array()
        return
    y = np.matmul(f32(x), f32(w).T)
    if b_t is not None:
        y += f32(b_t.host_array())
    out[...] = y
