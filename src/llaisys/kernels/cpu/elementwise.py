"""add, swiglu, geglu, gelu (tanh and erf forms), scale and rearrange on the CPU."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import _native
from ..._native import structs
from ...runtime.dtypes import DataType
from ..registry import register_kernel
from ._common import FLOATS, f32

if TYPE_CHECKING:
    from ...tensor import Tensor


@register_kernel("add", "cpu", dtypes=FLOATS)
def add(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """c = a + b for outputs (c,), inputs (a, b) of one shape; F16/BF16 summed in F32."""
    c = outputs[0].host_array()
    a, b = (t.host_array() for t in inputs)
    if c.dtype == np.float32:
        np.add(a, b, out=c)
    else:
        c[...] = f32(a) + f32(b)


@register_kernel("swiglu", "cpu", dtypes=FLOATS)
def swiglu(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out = up * gate / (1 + exp(-gate)) for outputs (out,), inputs (gate, up) of one shape, in F32."""
    out = outputs[0].host_array()
    gate, up = (f32(t.host_array()) for t in inputs)
    # silu(g) = g / (1 + e^-g); e^-g overflowing to inf gives the right limit 0.
    with np.errstate(over="ignore"):
        denom = np.exp(-gate)
    denom += 1.0
    res = gate / denom
    res *= up
    out[...] = res


@register_kernel("rearrange", "cpu", dtypes=tuple(t for t in DataType if t not in (DataType.INVALID, DataType.C16, DataType.C32)))
def rearrange(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """Strided copy of inputs (in,) into outputs (out,), both of one shape and dtype. Two dense
    tensors are one memmove: a decoding step copies each layer's new key and value rows into
    the cache this way, through views made for that step, where building NumPy views would
    cost several times the copy."""
    out, src = outputs[0], inputs[0]
    if out.is_contiguous() and src.is_contiguous():
        ctypes.memmove(out.data_ptr, src.data_ptr, out.nbytes)
        return
    out.host_array()[...] = src.host_array()


def native_rearrange(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                     attrs: dict[str, Any]) -> "native_calls.NativeCall | None":
    """``rearrange`` of two dense tensors as a memmove block, for a replayed plan; rebinding it
    to other dense tensors of the same size moves its pointers (None: not dense)."""
    from . import native_calls

    out, src = outputs[0], inputs[0]
    if not native_calls.available() or not (out.is_contiguous() and src.is_contiguous()):
        return None
    lib = _native.load("ops")
    block = structs.CopyCall(out.data_ptr, src.data_ptr, out.nbytes)
    layout = (out.shape, out.strides, src.shape, src.strides)  # dense, so any views of this layout are

    def rebind(outputs: tuple, inputs: tuple) -> bool:
        out2, src2 = outputs[0], inputs[0]
        if (out2.shape, out2.strides, src2.shape, src2.strides) != layout:
            return False
        block.dst, block.src = out2.data_ptr, src2.data_ptr
        return True

    return native_calls.NativeCall("rearrange", native_calls.address(lib, "llaisys_ops_copy_call"), block,
                                   keep=(out, src), rebind=rebind)


rearrange.native_call = native_rearrange  # type: ignore[attr-defined]


GELU_BETA = np.float32(0.7978845608028654)  # sqrt(2/pi), rounded to float32 as torch's gelu has it
GELU_KAPPA = np.float32(0.044715)


def gelu_tanh(g: np.ndarray) -> np.ndarray:
    """0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) of float32 g, a new float32 array, in
    torch's order of operations (gelu(approximate="tanh"))."""
    inner = g * g  # (g g) g, as torch computes g^3
    inner *= g
    inner *= GELU_KAPPA
    inner += g
    inner *= GELU_BETA
    np.tanh(inner, out=inner)
    inner += np.float32(1.0)
    res = g * np.float32(0.5)
    res *= inner
    return res


@register_kernel("geglu", "cpu", dtypes=FLOATS)
def geglu(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * up for outputs (out,), inputs
    (g, up) of one shape, in F32, in torch's order of operations (gelu(approximate="tanh"))."""
    out = outputs[0].host_array()
    gate, up = (f32(t.host_array()) for t in inputs)
    res = gelu_tanh(gate)
    res *= up
    out[...] = res


@register_kernel("gelu_tanh", "cpu", dtypes=FLOATS)
def gelu_tanh_kernel(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) for outputs (out,), inputs (x,) of
    one shape (out may be x), in F32 as geglu computes it."""
    outputs[0].host_array()[...] = gelu_tanh(f32(inputs[0].host_array()))


# erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z/2), z >= 0 (Numerical Recipes' erfcc; relative
# error under 1.1e-7 everywhere, so x Phi(x) keeps float32 precision even deep in the left tail).
_ERFC_P = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
           1.48851587, -0.82215223, 0.17087277)


@register_kernel("gelu_erf", "cpu", dtypes=FLOATS)
def gelu_erf(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out = x (1 + erf(x / sqrt(2))) / 2 = x erfc(-x / sqrt(2)) / 2 for outputs (out,), inputs
    (x,) of one shape (out may be x), in F64 (NumPy has no erf) and rounded once to out's type."""
    x = inputs[0].host_array().astype(np.float64)
    z = np.abs(x)
    z *= np.sqrt(0.5)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = np.full_like(t, _ERFC_P[-1])
    for c in _ERFC_P[-2::-1]:
        poly *= t
        poly += c
    poly -= z * z
    tail = t * np.exp(poly)  # erfc(|x| / sqrt(2))
    # erfc(-x / sqrt(2)) is the tail itself for x <= 0 and 2 - tail above, so no 1 + erf cancels
    phi = np.where(x <= 0, tail, 2.0 - tail)
    phi *= 0.5
    phi *= x
    outputs[0].host_array()[...] = phi


@register_kernel("scale", "cpu", dtypes=FLOATS)
def scale(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out = in * float32(factor) for outputs (out,), inputs (in,) of one shape (out may be in),
    computed in F32 and rounded once to out's type."""
    out = outputs[0].host_array()
    x = f32(inputs[0].host_array())
    factor = np.float32(attrs["factor"])
    if out.dtype == np.float32:
        np.multiply(x, factor, out=out)  # NumPy copies an input the output overlaps first
    else:
        out[...] = x * factor
