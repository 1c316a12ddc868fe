"""rms_norm (alone or after a residual add), layer_norm and rope on NVIDIA GPUs, in Triton.

All compute in F32 with the CPU kernels' order of operations (mean of squares times 1/D, plus
eps; x divided by the correctly rounded square root, times the weight; layer_norm likewise on x
minus its mean, then plus the bias; rope's angles in F64 from the same inverse frequencies,
cos/sin rounded to F32).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import triton
import triton.language as tl

from ...runtime.dtypes import DataType
from ..registry import register_kernel
from ._common import FLOATS, launch, next_pow2, rows, run_rows, tv

if TYPE_CHECKING:
    from ...tensor import Tensor


@triton.jit
def _rms_norm(out, total, x, b, w, D, x_s, b_s, t_s, o_s, eps, ADD: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row r: v = x[r] (+ b[r], stored rounded to total[r]); out[r] = v / sqrt(mean(v^2) + eps) * w."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    v = tl.load(x + row * x_s + cols, mask=m, other=0.0).to(tl.float32)
    if ADD:
        v = v + tl.load(b + row * b_s + cols, mask=m, other=0.0).to(tl.float32)
        rounded = v.to(total.dtype.element_ty)
        tl.store(total + row * t_s + cols, rounded, mask=m)
        v = rounded.to(tl.float32)
    ms = tl.sum(v * v, 0) * (1.0 / D) + eps
    y = tl.div_rn(v, tl.sqrt_rn(ms)) * tl.load(w + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out + row * o_s + cols, y.to(out.dtype.element_ty), mask=m)


def _norm(out_t: "Tensor", x_t: "Tensor", w_t: "Tensor", eps: float,
          total_t: "Tensor | None" = None, b_t: "Tensor | None" = None) -> None:
    d = x_t.shape[-1]
    x2 = rows(tv(x_t), d)  # (M, D)
    w = tv(w_t).contiguous()  # (D,)
    consts = {"ADD": total_t is not None, "BLOCK_D": next_pow2(d)}
    num_warps = 4 if d <= 2048 else 8

    def run(out2: torch.Tensor, total2: torch.Tensor, b2: torch.Tensor) -> None:
        args = (out2, total2, x2, b2, w, d, x2.stride(0), b2.stride(0), total2.stride(0), out2.stride(0), eps)
        launch(_rms_norm, (x2.shape[0],), args, consts, num_warps, exact=out_t.dtype is DataType.F32)

    if total_t is None:
        run_rows(tv(out_t), d, lambda out2: run(out2, out2, x2))
        return
    b2 = rows(tv(b_t), d)
    # total may be a itself (the residual stream): each row reads a and b before writing total.
    run_rows(tv(total_t), d, lambda total2: run_rows(tv(out_t), d, lambda out2: run(out2, total2, b2)))


@register_kernel("rms_norm", "nvidia", dtypes=FLOATS)
def rms_norm(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """out (..., D) = in / sqrt(mean(in^2) + eps) * weight (D,), in F32; attrs: eps."""
    _norm(outputs[0], inputs[0], inputs[1], attrs["eps"])


@register_kernel("add_rms_norm", "nvidia", dtypes=FLOATS)
def add_rms_norm(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """outputs (out, total), inputs (a, b, weight): total = a + b (rounded to its type), then
    out = rms_norm(total); attrs: eps."""
    _norm(outputs[0], inputs[0], inputs[2], attrs["eps"], total_t=outputs[1], b_t=inputs[1])


@triton.jit
def _layer_norm(out, x, w, b, D, x_s, o_s, eps, BIAS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row r: c = x[r] - mean(x[r]); out[r] = c / sqrt(mean(c^2) + eps) * w (+ b where BIAS)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    v = tl.load(x + row * x_s + cols, mask=m, other=0.0).to(tl.float32)
    c = tl.where(m, v - tl.sum(v, 0) / D, 0.0)
    var = tl.sum(c * c, 0) / D + eps
    y = tl.div_rn(c, tl.sqrt_rn(var)) * tl.load(w + cols, mask=m, other=0.0).to(tl.float32)
    if BIAS:
        y = y + tl.load(b + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out + row * o_s + cols, y.to(out.dtype.element_ty), mask=m)


@register_kernel("layer_norm", "nvidia", dtypes=FLOATS)
def layer_norm(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """out (..., D) = (in - mean) / sqrt(var + eps) * weight (D,) + bias (D,), the biased
    variance, in F32; inputs (in, weight, bias or None); attrs: eps."""
    x_t, w_t, b_t = inputs
    d = x_t.shape[-1]
    x2 = rows(tv(x_t), d)  # (M, D)
    w = tv(w_t).contiguous()  # (D,)
    b = w if b_t is None else tv(b_t).contiguous()  # (D,); not read without a bias
    consts = {"BIAS": b_t is not None, "BLOCK_D": next_pow2(d)}

    def run(out2: torch.Tensor) -> None:
        args = (out2, x2, w, b, d, x2.stride(0), out2.stride(0), float(attrs["eps"]))
        launch(_layer_norm, (x2.shape[0],), args, consts, 4 if d <= 2048 else 8, exact=outputs[0].dtype is DataType.F32)

    run_rows(tv(outputs[0]), d, run)


@triton.jit
def _rotate(out, x, pos, freqs, H, HALF, REST, x_s, x_h, x_d, o_s, o_h, o_d, factor, SCALED: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Row s: halves (a, b) of the first R = 2 * HALF dims of every head rotated by pos[s] * freqs
    (angles in F64), cos and sin times ``factor`` where SCALED; the REST dims after them copied."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    m = (h < H) & (j < HALF)
    p = tl.load(pos + s).to(tl.float64)
    angle = p * tl.load(freqs + j, mask=j < HALF, other=0.0).to(tl.float64)  # (1, HALF) float64
    if SCALED:
        cos = (tl.cos(angle) * factor).to(tl.float32)
        sin = (tl.sin(angle) * factor).to(tl.float32)
    else:
        cos = tl.cos(angle).to(tl.float32)
        sin = tl.sin(angle).to(tl.float32)
    src = x + s * x_s + h * x_h + j * x_d
    a = tl.load(src, mask=m, other=0.0).to(tl.float32)
    b = tl.load(src + HALF * x_d, mask=m, other=0.0).to(tl.float32)
    dst = out + s * o_s + h * o_h + j * o_d
    tl.store(dst, (a * cos - b * sin).to(out.dtype.element_ty), mask=m)
    tl.store(dst + HALF * o_d, (b * cos + a * sin).to(out.dtype.element_ty), mask=m)
    if BLOCK_REST > 0:
        k = tl.arange(0, BLOCK_REST)[None, :]
        mk = (h < H) & (k < REST)
        rest = tl.load(x + s * x_s + h * x_h + (2 * HALF + k) * x_d, mask=mk, other=0.0)
        tl.store(out + s * o_s + h * o_h + (2 * HALF + k) * o_d, rest.to(out.dtype.element_ty), mask=mk)


@triton.jit
def _rope(out, x, pos, inv_freq, H, HALF, x_s, x_h, x_d, o_s, o_h, o_d,
          BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Row s: halves (a, b) of every head rotated by pos[s] * inv_freq (F64)."""
    _rotate(out, x, pos, inv_freq, H, HALF, 0, x_s, x_h, x_d, o_s, o_h, o_d, 1.0, False, BLOCK_H, BLOCK_HALF, 0)


@triton.jit
def _rope_freqs(out, x, pos, freqs, H, HALF, REST, x_s, x_h, x_d, o_s, o_h, o_d, factor,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """``_rotate`` by freqs (F32), cos and sin times ``factor``, the REST dims copied."""
    _rotate(out, x, pos, freqs, H, HALF, REST, x_s, x_h, x_d, o_s, o_h, o_d, factor, True, BLOCK_H, BLOCK_HALF,
            BLOCK_REST)


@functools.lru_cache(maxsize=32)
def _inv_freq_host(dim: int, theta: float) -> np.ndarray:
    # The CPU kernel's float64 inverse frequencies, so the angles are the same numbers.
    return theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # (D/2,)


_inv_freq_cache: dict[tuple, torch.Tensor] = {}


def _inv_freq(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    key = (dim, theta, str(device))
    t = _inv_freq_cache.get(key)
    if t is None:
        t = _inv_freq_cache[key] = torch.from_numpy(_inv_freq_host(dim, theta)).to(device)
    return t


@register_kernel("rope", "nvidia", dtypes=FLOATS)
def rope(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """Rotary embedding of in (S, H, D) at pos_ids (S,) I64 into out (S, H, D); attrs: theta.
    in and out may be strided (q and k heads read from the fused qkv buffer)."""
    out, x, pos = tv(outputs[0]), tv(inputs[0]), tv(inputs[1])
    s, h, d = x.shape
    half = d // 2
    args = (out, x, pos, _inv_freq(d, float(attrs["theta"]), x.device), h, half, *x.stride(), *out.stride())
    launch(_rope, (s,), args, {"BLOCK_H": next_pow2(h), "BLOCK_HALF": next_pow2(half)},
           exact=outputs[0].dtype is DataType.F32)


@register_kernel("rope_freqs", "nvidia", dtypes=FLOATS)
def rope_freqs(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """Rotary embedding of in (S, H, D) at pos_ids (S,) I64 with inverse frequencies freqs
    (R/2,) F32 into out (S, H, D): the first R dims rotated, cos and sin times
    attrs["attention_factor"], dims R.. copied. in and out may be strided."""
    out, x, pos, freqs = tv(outputs[0]), tv(inputs[0]), tv(inputs[1]), tv(inputs[2])
    s, h, d = x.shape
    half = freqs.shape[0]
    rest = d - 2 * half
    args = (out, x, pos, freqs, h, half, rest, *x.stride(), *out.stride(), float(attrs["attention_factor"]))
    consts = {"BLOCK_H": next_pow2(h), "BLOCK_HALF": next_pow2(half), "BLOCK_REST": next_pow2(rest) if rest else 0}
    launch(_rope_freqs, (s,), args, consts, exact=outputs[0].dtype is DataType.F32)
