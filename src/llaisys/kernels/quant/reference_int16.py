"""Readable NumPy form of the "int16" arithmetic of the native quantized linear (quant_int.c):
activations as 16-bit integers per 32-element block, met by the weights' integer codes in exact
integer sums, each block's sum scaled and added in float32 in one fixed order. The native
kernels are tested against it bit for bit; it is tested against a float64 product.

    y = linear_int16(x, "Q4_K", raw, bias)     # x (M, K) float32, raw (N, row_bytes) -> (M, N)

Per output y[m, n]: for each 32-element block b of row m of x, s = amax / XQ_MAX and the codes
q = rint(x / s) (|q| <= XQ_MAX, two signed bytes 256 hi + lo in the kernels); the weights of
block b of row n are integer codes c with weight = scale * (c - offset) (Q4_0, Q5_0, Q8_0),
scale * c + min (Q4_1, Q5_1, Q4_K, Q5_K) or, for Q6_K, a scale per 16 elements; then in
float32, blocks in order from 0:
    offset formats: acc = acc + float(sum (c - offset) q) * (scale * s)
    min formats:    acc = acc + float(sum c q) * (scale * s);  acc = acc + min * (s * float(sum q))
    Q6_K:           acc = acc + float(sum_first16 (c - 32) q) * (scale * s)
                    acc = acc + float(sum_last16 (c - 32) q) * (scale2 * s)
and y = acc + bias.

The "int8" arithmetic is the same with XQ8_MAX = 127 in place of XQ_MAX (codes that fit one
signed byte, as llama.cpp's 8-bit activations do): ``linear_int16(..., bits=8)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .formats import QK_K, get_format
from .reference import _f16, _fifth_bits, _nibbles, _scales_k4

XQ_MAX = 32639  # largest |code| of an activation (256 hi + lo with both parts in int8)
XQ8_MAX = 127  # the int8 arithmetic's
BLOCK = 32


@dataclass(frozen=True)
class BlockCodes:
    """A weight's blocks of 32 as integer codes and float32 scales."""

    codes: np.ndarray   # (N, nb, 32) int64: unsigned codes
    scale: np.ndarray   # (N, nb) float32
    scale2: np.ndarray  # (N, nb) float32: Q6_K's scale of elements 16..31, else zeros
    minimum: np.ndarray  # (N, nb) float32: the min formats' added term, else zeros
    kind: str           # "offset", "min" or "q6"
    offset: int


def quantize_activations(x: np.ndarray, bits: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """x (M, K) float32 -> codes (M, nb, 32) int64 and scales (M, nb) float32, as the kernels
    quantize them (s = amax / XQ_MAX, or XQ8_MAX for ``bits`` 8; codes rounded to nearest even
    and clamped)."""
    q_max = {16: XQ_MAX, 8: XQ8_MAX}[bits]
    m, k = x.shape
    blocks = np.asarray(x, np.float32).reshape(m, k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=2)  # (M, nb)
    s = np.where(amax > 0, amax / np.float32(q_max), np.float32(0)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(blocks / np.where(s > 0, s, np.float32(1))[:, :, None])
    q = np.where(s[:, :, None] > 0, np.clip(q, -q_max, q_max), 0).astype(np.int64)
    return q, s


def _k4_codes(b: np.ndarray, qh: np.ndarray | None, qs: np.ndarray) -> BlockCodes:
    n = b.shape[0]
    sc, mn = _scales_k4(b[:, 4:16])  # (n, 8)
    chunks = qs.reshape(n, 4, 1, 32)
    c = np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, 8, 32)
    if qh is not None:
        c = c | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
    scale = (_f16(b, 0) * sc).astype(np.float32)
    minimum = -(_f16(b, 2) * mn).astype(np.float32)
    return BlockCodes(c.astype(np.int64), scale, np.zeros_like(scale), minimum, "min", 0)


def _q6_codes(b: np.ndarray) -> BlockCodes:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 2, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1, 1)) & 0x0F
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    c = (low.reshape(n, 2, 4, 32) | (high << 4)).reshape(n, 8, 32)
    scales = (_f16(b, 208) * b[:, 192:208].copy().view(np.int8).astype(np.float32)).reshape(n, 8, 2)
    return BlockCodes(c.astype(np.int64), scales[:, :, 0].copy(), scales[:, :, 1].copy(), np.zeros((n, 8), np.float32),
                      "q6", 32)


def _simple(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None, offset: int) -> BlockCodes:
    n = codes.shape[0]
    scale = scale.reshape(n, 1)
    if minimum is None:
        return BlockCodes(codes.astype(np.int64).reshape(n, 1, 32), scale, np.zeros_like(scale), np.zeros_like(scale),
                          "offset", offset)
    return BlockCodes(codes.astype(np.int64).reshape(n, 1, 32), scale, np.zeros_like(scale), minimum.reshape(n, 1),
                      "min", 0)


def block_codes(qtype: int | str, raw: np.ndarray) -> BlockCodes:
    """The codes and scales of every 32-element block of a weight (N, row_bytes) uint8."""
    fmt = get_format(qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8)
    n = raw.shape[0]
    b = raw.reshape(-1, fmt.block_bytes)
    name = fmt.name
    if name == "Q4_0":
        parts = _simple(_nibbles(b[:, 2:18]), _f16(b, 0), None, 8)
    elif name == "Q4_1":
        parts = _simple(_nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2), 0)
    elif name == "Q5_0":
        parts = _simple(_nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6]), _f16(b, 0), None, 16)
    elif name == "Q5_1":
        parts = _simple(_nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8]), _f16(b, 0), _f16(b, 2), 0)
    elif name == "Q8_0":
        parts = _simple(b[:, 2:34].copy().view(np.int8).astype(np.int64) + 128, _f16(b, 0), None, 128)
    elif name == "Q4_K":
        parts = _k4_codes(b, None, b[:, 16:144])
    elif name == "Q5_K":
        parts = _k4_codes(b, b[:, 16:48], b[:, 48:176])
    elif name == "Q6_K":
        parts = _q6_codes(b)
    else:
        raise ValueError(f"the int16 arithmetic takes the block formats, not {name}")
    per_row = parts.codes.shape[0] * parts.codes.shape[1] // n  # blocks of 32 per row
    return BlockCodes(parts.codes.reshape(n, per_row, 32), parts.scale.reshape(n, per_row),
                      parts.scale2.reshape(n, per_row), parts.minimum.reshape(n, per_row), parts.kind, parts.offset)


def linear_int16(x: np.ndarray, qtype: int | str, raw: np.ndarray, bias: np.ndarray | None = None,
                 bits: int = 16) -> np.ndarray:
    """x (M, K) float32 . W (N, K)^T (+ bias) in the int16 arithmetic (``bits`` 8: the int8
    one) -> float32 (M, N)."""
    x = np.asarray(x, np.float32)
    w = block_codes(qtype, raw)
    q, s = quantize_activations(x, bits)                # (M, nb, 32), (M, nb)
    m, n, nb = x.shape[0], w.codes.shape[0], w.codes.shape[1]
    assert nb * BLOCK == x.shape[1] and QK_K % BLOCK == 0
    c = w.codes - w.offset                               # (N, nb, 32)
    acc = np.zeros((m, n), np.float32)
    for b in range(nb):
        scale_s = w.scale[None, :, b] * s[:, b, None]   # (M, N) float32
        if w.kind == "q6":
            first = (q[:, b, None, :16] * c[None, :, b, :16]).sum(axis=2)
            second = (q[:, b, None, 16:] * c[None, :, b, 16:]).sum(axis=2)
            acc = acc + first.astype(np.float32) * scale_s
            acc = acc + second.astype(np.float32) * (w.scale2[None, :, b] * s[:, b, None])
            continue
        total = (q[:, b, None, :] * c[None, :, b, :]).sum(axis=2)  # (M, N) exact
        acc = acc + total.astype(np.int32).astype(np.float32) * scale_s
        if w.kind == "min":
            s_sum = s[:, b] * q[:, b].sum(axis=1).astype(np.float32)  # (M,)
            acc = acc + w.minimum[None, :, b] * s_sum[:, None]
    return acc if bias is None else acc + np.asarray(bias, np.float32)
