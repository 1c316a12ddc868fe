"""add, swiglu, geglu, scale and rearrange on the CPU."""
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


@register_kernel("geglu", "cpu", dtypes=FLOATS)
def geglu(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * up for outputs (out,), inputs
    (g, up) of one shape, in F32, in torch's order of operations (gelu(approximate="tanh"))."""
    out = outputs[0].host_array()
    gate, up = (f32(t.host_array()) for t in inputs)
    inner = gate * gate  # (g g) g, as torch computes g^3
    inner *= gate
    inner *= GELU_KAPPA
    inner += gate
    inner *= GELU_BETA
    np.tanh(inner, out=inner)
    inner += np.float32(1.0)
    res = gate * np.float32(0.5)
    res *= inner
    res *= up
    out[...] = res


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
