"""GGUF block formats on NVIDIA GPUs: dequantized once, at first use, to the activations' type.

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are decoded on the device by a Triton kernel with the NumPy
reference's arithmetic (``d * q``, ``d * q + m`` in F32, then rounded once to F16/BF16); the
K-quants (Q4_K, Q5_K, Q6_K) by the NumPy reference on the host, copied up. The result is a
device tensor kept with the weight (``Tensor.derived``) when the weight is frozen (a model's
weights always are), so ``linear`` and ``embedding`` then run on 16/32-bit weights: a
quantized model takes the memory of a 16-bit one on the GPU, plus its blocks.

``LLAISYS_NVIDIA_QUANT_GEMM=1`` (experimental, not yet measured on a GPU) makes ``linear`` on
Q4_0 ... Q8_0 weights run ``_qlinear`` instead, which decodes the blocks inside the GEMM tiles
and never makes the 16-bit copy.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ...runtime.dtypes import DataType
from ..quant import reference
from ._common import TORCH_DTYPES, interpreted, launch, tv

if TYPE_CHECKING:
    from ...tensor import Tensor

# The block layouts are ggml's (block_q4_0 ...): a half d, a half m (Q4_1, Q5_1), 4 bytes of fifth bits (Q5).
# format -> (kernel id, block bytes, offset of the nibbles, offset of the fifth bits)
DEVICE_FORMATS = {t: (kind, t.block_bytes, qs, qh) for t, kind, qs, qh in (
    (DataType.Q4_0, 0, 2, 0), (DataType.Q4_1, 1, 4, 0), (DataType.Q5_0, 2, 6, 2), (DataType.Q5_1, 3, 8, 4),
    (DataType.Q8_0, 4, 2, 0))}
BLOCKS_PER_PROGRAM = 64
INTERPRETED_BLOCKS_PER_PROGRAM = 16384  # the interpreter runs a program as NumPy: fewer, larger ones
QUANT_GEMM_ENV = "LLAISYS_NVIDIA_QUANT_GEMM"


@triton.jit
def _decode32(base, e, ok, FMT: tl.constexpr, QS: tl.constexpr, QH: tl.constexpr):
    """The 32 values e (1, 32) of the blocks at byte pointers base (R, 1) (rows where ok), as
    float32 (R, 32), with the reference's arithmetic. QS: where the nibbles start, after d (and
    m) (and the 4 bytes of fifth bits at QH)."""
    d = tl.load(base, mask=ok, other=0).to(tl.uint16) | (tl.load(base + 1, mask=ok, other=0).to(tl.uint16) << 8)
    d = d.to(tl.float16, bitcast=True).to(tl.float32)  # (R, 1)
    if FMT == 4:  # Q8_0: d, then 32 int8
        q = tl.load(base + 2 + e, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        y = q * d
    else:
        byte = tl.load(base + QS + (e % 16), mask=ok, other=0).to(tl.int32)
        q = tl.where(e < 16, byte & 15, byte >> 4)
        if FMT == 2 or FMT == 3:
            hb = tl.load(base + QH + e // 8, mask=ok, other=0).to(tl.int32)
            q = q | (((hb >> (e % 8)) & 1) << 4)
        if FMT == 0:
            y = d * (q - 8).to(tl.float32)
        elif FMT == 2:
            y = d * (q - 16).to(tl.float32)
        else:  # with a minimum m after d
            m = tl.load(base + 2, mask=ok, other=0).to(tl.uint16)
            m = (m | (tl.load(base + 3, mask=ok, other=0).to(tl.uint16) << 8)).to(tl.float16, bitcast=True)
            y = d * q.to(tl.float32) + m.to(tl.float32)
    return y


@triton.jit
def _dequantize(out, raw, n_blocks, FMT: tl.constexpr, BB: tl.constexpr, QS: tl.constexpr, QH: tl.constexpr,
                BP: tl.constexpr):
    """Blocks pid*BP .. of 32 elements each, raw (n_blocks, BB) uint8 -> out (n_blocks, 32)."""
    blk = tl.program_id(0).to(tl.int64) * BP + tl.arange(0, BP)[:, None]  # (BP, 1)
    e = tl.arange(0, 32)[None, :]  # (1, 32)
    ok = blk < n_blocks
    y = _decode32(raw + blk * BB, e, ok, FMT, QS, QH)
    tl.store(out + blk * 32 + e, y.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _qlinear(y, x, w, b, M, N, K, x_m, y_m, row_bytes, FMT: tl.constexpr, BB: tl.constexpr, QS: tl.constexpr,
             QH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             IEEE: tl.constexpr):
    """y (M, N) = x (M, K) @ w (N, K)^T (+ b) with w in its blocks, decoded a block column
    (32 values of BLOCK_N rows) at a time next to the product: the weight is read as stored."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    e = tl.arange(0, 32)
    m_ok = rm[:, None] < M
    n_ok = rn[:, None] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, K // 32):
        xt = tl.load(x + rm[:, None] * x_m + kb * 32 + e[None, :], mask=m_ok, other=0.0)  # (BM, 32)
        wt = _decode32(w + rn[:, None] * row_bytes + kb * BB, e[None, :], n_ok, FMT, QS, QH)  # (BN, 32) f32
        if IEEE:
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wt.to(xt.dtype)))
    if HAS_BIAS:
        acc += tl.load(b + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rm[:, None] * y_m + rn[None, :], acc.to(y.dtype.element_ty), mask=m_ok & (rn[None, :] < N))


def quantized_linear(out2: torch.Tensor, x2: torch.Tensor, w_t: "Tensor", bias: "torch.Tensor | None",
                     dtype: DataType) -> None:
    """out2 (M, N) = x2 (M, K) @ w_t (N, K)^T + bias on the stored blocks of a Q4_0 ... Q8_0
    weight (``QUANT_GEMM``); unit last strides."""
    kind, bb, qs, qh = DEVICE_FORMATS[w_t.dtype]
    m, k = x2.shape
    n = w_t.shape[0]
    block_m = 16 if m <= 16 else 64
    block_n = 256 if interpreted() else 64
    args = (out2, x2, tv(w_t), x2 if bias is None else bias, m, n, k, x2.stride(0), out2.stride(0), w_t.raw_shape[1])
    launch(_qlinear, (triton.cdiv(m, block_m), triton.cdiv(n, block_n)), args,
           {"FMT": kind, "BB": bb, "QS": qs, "QH": qh, "HAS_BIAS": bias is not None, "BLOCK_M": block_m,
            "BLOCK_N": block_n, "IEEE": dtype is DataType.F32 or (dtype is DataType.BF16 and interpreted())},
           exact=dtype is DataType.F32)


def use_quantized_gemm(w_t: "Tensor") -> bool:
    """Whether ``linear`` runs on ``w_t``'s blocks (``LLAISYS_NVIDIA_QUANT_GEMM=1`` and a format
    the kernel decodes) rather than on its dequantized copy."""
    return w_t.dtype in DEVICE_FORMATS and os.environ.get(QUANT_GEMM_ENV, "0") == "1"


def dequantize_into(out: torch.Tensor, w_t: "Tensor") -> None:
    """Decode block-format ``w_t`` (N, K) into ``out`` (N, K) contiguous, any float type."""
    fmt = DEVICE_FORMATS.get(w_t.dtype)
    if fmt is None:  # K-quants: the NumPy reference on the host
        host = reference.dequantize(w_t.dtype.name, w_t.raw_numpy())  # (N, K) float32
        out.copy_(torch.from_numpy(host))
        return
    kind, bb, qs, qh = fmt
    raw = tv(w_t)  # (N, row_bytes) uint8
    n_blocks = raw.numel() // bb
    bp = INTERPRETED_BLOCKS_PER_PROGRAM if interpreted() else BLOCKS_PER_PROGRAM
    launch(_dequantize, (triton.cdiv(n_blocks, bp),), (out, raw, n_blocks),
           {"FMT": kind, "BB": bb, "QS": qs, "QH": qh, "BP": bp}, exact=True)


def _decode(w_t: "Tensor", out: torch.Tensor) -> torch.Tensor:
    if w_t.dtype.is_quantized:
        dequantize_into(out, w_t)
    else:  # an F16/BF16 weight with F32 activations
        out.copy_(tv(w_t))
    return out


def dequantized(w_t: "Tensor", dtype: DataType) -> torch.Tensor:
    """Weight ``w_t`` (N, K) (a block format, or F16/BF16) as a contiguous torch tensor of
    ``dtype`` on its device. A frozen weight's is made once, in a tensor of the device's
    caching allocator kept with the weight; any other's anew, in memory of its own."""
    if not w_t.frozen:
        device = tv(w_t).device
        return _decode(w_t, torch.empty(w_t.shape, dtype=TORCH_DTYPES[dtype], device=device))

    def make(w: "Tensor") -> tuple:
        from ...tensor import Tensor

        t = Tensor.empty(w.shape, dtype, w.device)
        return t, _decode(w, tv(t))

    return w_t.derived(f"nvidia.{dtype.name}", make)[1]


__all__ = ["DEVICE_FORMATS", "dequantize_into", "dequantized", "quantized_linear", "use_quantized_gemm"]
