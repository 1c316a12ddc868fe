"""rms_norm and rope on the CPU."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import functools

import numpy as np

from ..registry import register_kernel
from ._common import FLOATS, f32

if TYPE_CHECKING:
    from ...tensor import Tensor


@register_kernel("rms_norm", "cpu", dtypes=FLOATS)
def rms_norm(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out (..., D) = in / sqrt(mean(in^2) + eps) * weight (D,), in F32; attrs: eps."""
    out = outputs[0].host_array()
    x = f32(inputs[0].host_array())  # (..., D)
    w = f32(inputs[1].host_array())  # (D,)
    ms = np.einsum("...d,...d->...", x, x)[..., None]  # (..., 1)
    ms *= 1.0 / x.shape[-1]
    ms += attrs["eps"]
    y = x / np.sqrt(ms)
    y *= w
    out[...] = y


@functools.lru_cache(maxsize=32)
def _inv_freq(dim: int, theta: float) -> np.ndarray:
    # float64 so large positions keep their precision before cos/sin.
    return theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # (D/2,)


@register_kernel("rope", "cpu", dtypes=FLOATS)
def rope(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """Rotary embedding of in (S, H, D) at pos_ids (S,) I64, halves rotated by pos / theta^(2j/D); attrs: theta."""
    out = outputs[0].host_array()  # (S, H, D)
    x = f32(inputs[0].host_array())
    pos = inputs[1].host_array()  # (S,)
    half = x.shape[2] // 2
    angles = pos.astype(np.float64)[:, None] * _inv_freq(x.shape[2], attrs["theta"])  # (S, D/2)
    cos = np.cos(angles).astype(np.float32)[:, None, :]  # (S, 1, D/2)
    sin = np.sin(angles).astype(np.float32)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    ra = a * cos - b * sin
    rb = b * cos + a * sin
    out[..., :half] = ra
    out[..., half:] = rb
