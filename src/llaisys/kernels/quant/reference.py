"""Readable NumPy dequantization of the GGUF formats: the reference the native kernels are
tested against (bit for bit), itself tested against ``gguf.quants.dequantize``.

Every function takes the blocks of a weight as uint8 (n_blocks, block_bytes) and returns float32
(n_blocks, block_size), computing in float32 with the same operations as the native decoders:
``d * q`` or ``d * q + m`` (a multiply, then an add).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .formats import QK_K, get_format


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The half float at bytes [start, start + 2) of each block, as float32 (n_blocks, 1)."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) values: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes, a little-endian 32-bit word per block -> (n, 32): bit j as 0 or 16."""
    word = qh.copy().view("<u4")  # (n, 1)
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _q4_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)  # (n, 32)
    return _f16(b, 0) * q.astype(np.float32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 4:20]).astype(np.float32)
    return _f16(b, 0) * q + _f16(b, 2)


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = (_nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6])).astype(np.int8) - np.int8(16)
    return _f16(b, 0) * q.astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = (_nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8])).astype(np.float32)
    return _f16(b, 0) * q + _f16(b, 2)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return b[:, 2:34].copy().view(np.int8).astype(np.float32) * _f16(b, 0)


def _scales_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes per super-block -> (scale, min) of its 8 sub-blocks, 6 bits each, as float32.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; sub-blocks 4-7 take
    their low 4 bits from bytes 8-11 (scale low nibble, min high nibble) and their top 2
    bits from the top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    lo_sc, lo_mn, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = np.concatenate([lo_sc & 63, (extra & 0x0F) | ((lo_sc >> 6) << 4)], axis=1)
    minimum = np.concatenate([lo_mn & 63, (extra >> 4) | ((lo_mn >> 6) << 4)], axis=1)
    return scale.astype(np.float32), minimum.astype(np.float32)  # (n, 8) each


def _k4(b: np.ndarray, qh: np.ndarray | None, qs: np.ndarray) -> np.ndarray:
    """q4_K / q5_K: sub-block j of 32 = (d * scale_j) * q - dmin * min_j."""
    n = b.shape[0]
    scale, minimum = _scales_k4(b[:, 4:16])
    chunks = qs.reshape(n, 4, 1, 32)  # 32-byte chunk c holds sub-blocks 2c (low) and 2c+1 (high)
    q = np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, 8, 32)
    if qh is not None:  # bit j of qh[l] is bit 4 of element l of sub-block j
        q = q | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
    d = (_f16(b, 0) * scale)[:, :, None]  # (n, 8, 1)
    m = (_f16(b, 2) * minimum)[:, :, None]
    return (d * q.astype(np.float32) - m).reshape(n, QK_K)


def _q4_K(b: np.ndarray) -> np.ndarray:
    return _k4(b, None, b[:, 16:144])


def _q5_K(b: np.ndarray) -> np.ndarray:
    return _k4(b, b[:, 16:48], b[:, 48:176])


def _q6_K(b: np.ndarray) -> np.ndarray:
    """Per 128-element half h: elements 32t .. 32t+31 (t = 0..3) take their low 4 bits from
    ql[64h + 32(t % 2) + l] (low nibble for t < 2, high for t >= 2) and their top 2 bits from
    bits 2t, 2t+1 of qh[32h + l]; value = (d * scale) * (q - 32), one scale per 16."""
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 2, 32)  # (n, half, -, t % 2, l)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)   # (n, half, -, l)
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1, 1)) & 0x0F  # (n, 2, t // 2, t % 2, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3  # (n, 2, t, 32)
    q = (low.reshape(n, 2, 4, 32) | (high << 4)).astype(np.int8) - np.int8(32)
    scale = _f16(b, 208) * b[:, 192:208].copy().view(np.int8).astype(np.float32)  # (n, 16)
    return (scale[:, :, None] * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _f32(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float32)


def _f16_values(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _bf16(b: np.ndarray) -> np.ndarray:
    return (b.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


_DECODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "F32": _f32, "F16": _f16_values, "BF16": _bf16,
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q4_K": _q4_K, "Q5_K": _q5_K, "Q6_K": _q6_K,
}


def dequantize(qtype: int | str, raw: np.ndarray) -> np.ndarray:
    """Weights (N, row_bytes) uint8 in format ``qtype`` -> float32 (N, K)."""
    fmt = get_format(qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8)
    if raw.ndim != 2:
        raise ValueError(f"raw weights must be 2-D (N, row_bytes), got shape {raw.shape}")
    n, k = raw.shape[0], fmt.row_elements(raw.shape[1])
    blocks = raw.reshape(-1, fmt.block_bytes)  # (N * K / block_size, block_bytes)
    return _DECODERS[fmt.name](blocks).reshape(n, k)


def linear(x: np.ndarray, qtype: int | str, raw: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x (M, K) float32 @ dequantize(raw) (N, K)^T + bias (N,) -> float32 (M, N)."""
    y = np.matmul(np.asarray(x, np.float32), dequantize(qtype, raw).T)  # (M, N)
    return y if bias is None else y + np.asarray(bias, np.float32)
