"""rms_norm (alone or after a residual add), layer_norm and rope on the CPU."""
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
    _normalize(outputs[0].host_array(), inputs[0].host_array(), inputs[1].host_array(), attrs["eps"])


@register_kernel("add_rms_norm", "cpu", dtypes=FLOATS)
def add_rms_norm(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """outputs (out, total), inputs (a, b, weight): total = a + b (rounded to its type), then
    out = rms_norm(total) as the rms_norm kernel computes it; attrs: eps."""
    out, total = outputs[0].host_array(), outputs[1].host_array()  # (..., D)
    a, b = inputs[0].host_array(), inputs[1].host_array()  # (..., D)
    if total.dtype == np.float32:
        np.add(a, b, out=total)
    else:
        total[...] = f32(a) + f32(b)
    _normalize(out, total, inputs[2].host_array(), attrs["eps"])


def _normalize(out: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float) -> None:
    """out (..., D) = x / sqrt(mean(x^2) + eps) * w (D,), computed in F32."""
    x, w = f32(x), f32(w)
    ms = np.einsum("...d,...d->...", x, x)[..., None]  # (..., 1)
    ms *= 1.0 / x.shape[-1]
    ms += eps
    y = x / np.sqrt(ms)
    y *= w
    out[...] = y


@register_kernel("layer_norm", "cpu", dtypes=FLOATS)
def layer_norm(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out (..., D) = (in - mean) / sqrt(var + eps) * weight (D,) + bias (D,), the biased
    variance, in F32; inputs (in, weight, bias or None); attrs: eps."""
    out = outputs[0].host_array()  # (..., D)
    x, w = f32(inputs[0].host_array()), f32(inputs[1].host_array())  # (..., D), (D,)
    xc = x - x.mean(axis=-1, keepdims=True)  # (..., D)
    var = np.mean(np.square(xc), axis=-1, keepdims=True)  # (..., 1)
    var += attrs["eps"]
    y = xc / np.sqrt(var)
    y *= w
    if inputs[2] is not None:
        y += f32(inputs[2].host_array())
    out[...] = y


@functools.lru_cache(maxsize=32)
def _inv_freq(dim: int, theta: float) -> np.ndarray:
    # float64 so large positions keep their precision before cos/sin.
    return theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # (D/2,)


@functools.lru_cache(maxsize=8)
def _cos_sin(pos_bytes: bytes, dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (S, 1, D/2) float32 of the angles at positions ``pos_bytes`` (S,) I64.
    Kept for the last few position sets: every layer of a pass rotates at the same ones."""
    pos = np.frombuffer(pos_bytes, np.int64)  # (S,)
    angles = pos.astype(np.float64)[:, None] * _inv_freq(dim, theta)  # (S, D/2)
    cos, sin = np.cos(angles).astype(np.float32)[:, None, :], np.sin(angles).astype(np.float32)[:, None, :]
    cos.flags.writeable = sin.flags.writeable = False  # shared by every caller
    return cos, sin


@functools.lru_cache(maxsize=8)
def _cos_sin_freqs(pos_bytes: bytes, freqs_bytes: bytes, factor: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (S, 1, R/2) float32 of the angles pos * freqs at positions ``pos_bytes`` (S,)
    I64 for inverse frequencies ``freqs_bytes`` (R/2,) F32, each times ``factor``."""
    pos = np.frombuffer(pos_bytes, np.int64)  # (S,)
    angles = pos.astype(np.float64)[:, None] * np.frombuffer(freqs_bytes, np.float32).astype(np.float64)  # (S, R/2)
    cos, sin = np.cos(angles), np.sin(angles)
    if factor != 1.0:
        cos *= factor
        sin *= factor
    cos, sin = cos.astype(np.float32)[:, None, :], sin.astype(np.float32)[:, None, :]
    cos.flags.writeable = sin.flags.writeable = False  # shared by every caller
    return cos, sin


def _rotate(out: np.ndarray, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """out (S, H, D) = x with the halves of its first R = 2 * cos.shape[-1] dims rotated by the
    angles of cos, sin (S, 1, R/2); dims R.. copied. out may be x."""
    half = cos.shape[-1]
    a, b = x[..., :half], x[..., half:2 * half]
    ra = a * cos - b * sin
    rb = b * cos + a * sin
    out[..., :half] = ra
    out[..., half:2 * half] = rb
    if 2 * half < x.shape[2]:
        out[..., 2 * half:] = x[..., 2 * half:]


@register_kernel("rope", "cpu", dtypes=FLOATS)
def rope(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """Rotary embedding of in (S, H, D) at pos_ids (S,) I64, halves rotated by pos / theta^(2j/D); attrs: theta."""
    out = outputs[0].host_array()  # (S, H, D)
    x = f32(inputs[0].host_array())
    pos = inputs[1].host_array()  # (S,)
    cos, sin = _cos_sin(pos.tobytes(), x.shape[2], attrs["theta"])  # (S, 1, D/2) each
    _rotate(out, x, cos, sin)


@register_kernel("rope_freqs", "cpu", dtypes=FLOATS)
def rope_freqs(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """Rotary embedding of in (S, H, D) at pos_ids (S,) I64 with inverse frequencies freqs (R/2,)
    F32: the halves of the first R dims rotated by pos * freqs, cos and sin times
    attrs["attention_factor"]; dims R.. copied."""
    out = outputs[0].host_array()  # (S, H, D)
    x = f32(inputs[0].host_array())
    pos, freqs = inputs[1].host_array(), inputs[2].host_array()  # (S,), (R/2,)
    cos, sin = _cos_sin_freqs(pos.tobytes(), freqs.tobytes(), attrs["attention_factor"])  # (S, 1, R/2) each
    _rotate(out, x, cos, sin)
