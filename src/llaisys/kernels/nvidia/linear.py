"""linear (Y = X W^T + b) on NVIDIA GPUs: cuBLAS through ``torch.matmul`` on the device.

F32 runs with TF32 off (the backend sets it; ``LLAISYS_NVIDIA_TF32=1`` allows it) and adds the
bias after the product, as the CPU does; F16/BF16 add it in cuBLAS's epilogue (``addmm``). A
block-quantized weight, or an F16/BF16 weight under F32 activations, is dequantized once to
the activations' type (``quant.dequantized``), or, with ``LLAISYS_NVIDIA_QUANT_GEMM=1``, multiplied
as stored by ``quant.quantized_linear``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...runtime.dtypes import QUANTIZED_TYPES, DataType
from ..registry import register_kernel
from ._common import FLOATS, rows, run_rows, tv
from .quant import dequantized, quantized_linear, use_quantized_gemm

if TYPE_CHECKING:
    from ...tensor import Tensor


def linear(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """out (..., N) = in (..., K) @ weight (N, K)^T + bias (N,) for inputs (in, weight, bias or None)."""
    out_t = outputs[0]
    x_t, w_t, b_t = inputs
    n, k = w_t.shape
    x2 = rows(tv(x_t), k)  # (M, K)
    bias = None if b_t is None else tv(b_t)  # (N,)
    if use_quantized_gemm(w_t):
        run_rows(tv(out_t), n, lambda out2: quantized_linear(out2, x2, w_t, bias, out_t.dtype))
        return
    w = tv(w_t) if w_t.dtype is out_t.dtype else dequantized(w_t, out_t.dtype)  # (N, K)
    f32 = out_t.dtype is DataType.F32

    def compute(out2: torch.Tensor) -> None:  # (M, N)
        if bias is None:
            torch.matmul(x2, w.t(), out=out2)
        elif f32:
            torch.matmul(x2, w.t(), out=out2)
            out2.add_(bias)
        else:
            torch.addmm(bias, x2, w.t(), out=out2)

    run_rows(tv(out_t), n, compute)


register_kernel("linear", "nvidia", dtypes=FLOATS, kernel=linear)
register_kernel("linear", "nvidia", dtypes=FLOATS, weight_dtypes=QUANTIZED_TYPES, kernel=linear)
register_kernel("linear", "nvidia", dtypes=(DataType.F32,), weight_dtypes=(DataType.F16, DataType.BF16), kernel=linear)
