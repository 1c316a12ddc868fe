"""add, swiglu and rearrange on NVIDIA GPUs: one strided elementwise Triton kernel; geglu and
scale: a second one, which takes a float factor; gelu (tanh and erf forms): a third.

Tensors of any strides (up to four dimensions once runs of dimensions that are contiguous in
every operand are merged) are walked by flat index; F16/BF16 are computed in F32 and rounded
once, as the CPU kernels do.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

from ...runtime.dtypes import DataType
from ..registry import register_kernel
from ._common import FLOATS, TORCH_DTYPES, launch, tv

if TYPE_CHECKING:
    from ...tensor import Tensor

COPY, ADD, SWIGLU = 0, 1, 2
BLOCK = 1024
MAX_DIMS = 4


@triton.jit
def _index(idx, s1, s2, s3):
    """The 4-D index (i0, i1, i2, i3) of flat element ``idx`` of sizes (., s1, s2, s3)."""
    i3 = idx % s3
    rest = idx // s3
    i2 = rest % s2
    rest = rest // s2
    return rest // s1, rest % s1, i2, i3


@triton.jit
def _elementwise(out, a, b, n, s1, s2, s3, o0, o1, o2, o3, a0, a1, a2, a3, b0, b1, b2, b3,
                 OP: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = op(a[i], b[i]) for the n elements of a 4-D index space (sizes (n / (s1 s2 s3),
    s1, s2, s3)), each operand with its own element strides."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, i1, i2, i3 = _index(idx, s1, s2, s3)
    x = tl.load(a + i0 * a0 + i1 * a1 + i2 * a2 + i3 * a3, mask=mask)
    if OP == 0:
        y = x
    else:
        xf = x.to(tl.float32)
        yf = tl.load(b + i0 * b0 + i1 * b1 + i2 * b2 + i3 * b3, mask=mask).to(tl.float32)
        if OP == 1:
            y = xf + yf
        else:  # swiglu: a is the gate, b is up; silu(g) = g / (1 + e^-g)
            y = xf / (1.0 + tl.exp(-xf)) * yf
    tl.store(out + i0 * o0 + i1 * o1 + i2 * o2 + i3 * o3, y.to(out.dtype.element_ty), mask=mask)


def collapse(shape: tuple, *strides: tuple) -> tuple[list[int], list[list[int]]]:
    """``shape`` and each operand's ``strides`` with size-1 dimensions dropped and neighbours
    merged where every operand is contiguous across them, padded in front to four dims.
    ValueError when more than four remain."""
    dims = [i for i, d in enumerate(shape) if d != 1]
    sizes = [shape[i] for i in dims]
    strs = [[s[i] for i in dims] for s in strides]
    j = len(sizes) - 1
    while j > 0:
        if all(st[j - 1] == st[j] * sizes[j] for st in strs):
            sizes[j - 1] *= sizes[j]
            for st in strs:
                st[j - 1] = st[j]
                del st[j]
            del sizes[j]
        j -= 1
    if len(sizes) > MAX_DIMS:
        raise ValueError(f"strided elementwise kernel: shape {shape} with strides {strides} has more than "
                         f"{MAX_DIMS} dimensions that cannot be merged")
    pad = MAX_DIMS - len(sizes)
    return [1] * pad + sizes, [[0] * pad + st for st in strs]


def index_space(out: "Tensor", a: "Tensor", b: "Tensor | None") -> tuple:
    """The arguments after the operands of the strided kernels (and scalars): n, the
    collapsed sizes s1..s3, then out's, a's and b's element strides (a's again without b)."""
    ops = (out, a) if b is None else (out, a, b)
    sizes, strides = collapse(out.shape, *(t.strides for t in ops))
    if b is None:
        strides.append(strides[1])
    return (out.numel(), sizes[1], sizes[2], sizes[3], *strides[0], *strides[1], *strides[2])


def launch_strided(kernel: Any, op: int, out: "Tensor", a: "Tensor", b: "Tensor | None" = None,
                   *scalars: float) -> None:
    """Launch ``kernel`` (``_elementwise``, ``_gelu``, or ``_geglu_scale`` with its factor in ``scalars``)
    for ``op`` on llaisys tensors of one shape."""
    args = (tv(out), tv(a), tv(a if b is None else b), *scalars, *index_space(out, a, b))
    launch(kernel, (triton.cdiv(out.numel(), BLOCK),), args, {"OP": op, "BLOCK": BLOCK},
           exact=out.dtype is DataType.F32)


@register_kernel("add", "nvidia", dtypes=FLOATS)
def add(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """c = a + b for outputs (c,), inputs (a, b) of one shape, any strides; summed in F32."""
    launch_strided(_elementwise, ADD, outputs[0], inputs[0], inputs[1])


@register_kernel("swiglu", "nvidia", dtypes=FLOATS)
def swiglu(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """out = up * gate / (1 + exp(-gate)) for outputs (out,), inputs (gate, up), in F32."""
    launch_strided(_elementwise, SWIGLU, outputs[0], inputs[0], inputs[1])


@register_kernel("rearrange", "nvidia", dtypes=tuple(TORCH_DTYPES))
def rearrange(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """Strided copy of inputs (in,) into outputs (out,), one shape and dtype."""
    out, src = outputs[0], inputs[0]
    if out.is_contiguous() and src.is_contiguous():
        tv(out).copy_(tv(src))  # a plain device memcpy
        return
    launch_strided(_elementwise, COPY, out, src)


GEGLU, SCALE = 0, 1  # _geglu_scale
GELU_TANH, GELU_ERF = 0, 1  # _gelu


@triton.jit
def _tanh(x):
    """tanh in float32 as the CPU's native kernel computes it (Cephes tanhf): an odd polynomial
    below |x| = 0.625, else 1 - 2 / (e^2|x| + 1) with x's sign (no cancellation there)."""
    ax = tl.abs(x)
    z = x * x
    p = -5.70498872745e-3 * z + 2.06390887954e-2
    p = p * z - 5.37397155531e-2
    p = p * z + 1.33314422036e-1
    p = p * z - 3.33332819422e-1
    small = p * z * x + x
    big = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)
    return tl.where(ax < 0.625, small, tl.where(x < 0, -big, big))


@triton.jit
def _geglu_scale(out, a, b, factor, n, s1, s2, s3, o0, o1, o2, o3, a0, a1, a2, a3, b0, b1, b2, b3,
                 OP: tl.constexpr, BLOCK: tl.constexpr):
    """geglu (out = 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))) b, a the gate, b up) or
    scale (out = a * factor) over the n elements of a 4-D index space, as ``_elementwise``."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, i1, i2, i3 = _index(idx, s1, s2, s3)
    x = tl.load(a + i0 * a0 + i1 * a1 + i2 * a2 + i3 * a3, mask=mask).to(tl.float32)
    if OP == 0:
        u = tl.load(b + i0 * b0 + i1 * b1 + i2 * b2 + i3 * b3, mask=mask).to(tl.float32)
        inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
        y = 0.5 * x * (1.0 + _tanh(inner)) * u
    else:
        y = x * factor
    tl.store(out + i0 * o0 + i1 * o1 + i2 * o2 + i3 * o3, y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _gelu(out, a, b, n, s1, s2, s3, o0, o1, o2, o3, a0, a1, a2, a3, b0, b1, b2, b3,
          OP: tl.constexpr, BLOCK: tl.constexpr):
    """out = gelu(a) over the n elements of a 4-D index space, as ``_elementwise`` (b unused):
    OP 0 the tanh form 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))), as geglu's; OP 1 the erf
    form 0.5 a (1 + erf(a / sqrt(2)))."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, i1, i2, i3 = _index(idx, s1, s2, s3)
    x = tl.load(a + i0 * a0 + i1 * a1 + i2 * a2 + i3 * a3, mask=mask).to(tl.float32)
    if OP == 0:
        y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * (x * x * x))))
    else:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    tl.store(out + i0 * o0 + i1 * o1 + i2 * o2 + i3 * o3, y.to(out.dtype.element_ty), mask=mask)


@register_kernel("geglu", "nvidia", dtypes=FLOATS)
def geglu(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """out = up * gelu_tanh(gate) for outputs (out,), inputs (gate, up) of one shape, any strides, in F32."""
    launch_strided(_geglu_scale, GEGLU, outputs[0], inputs[0], inputs[1], 1.0)


@register_kernel("scale", "nvidia", dtypes=FLOATS)
def scale(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """out = in * float32(factor) for outputs (out,), inputs (in,) of one shape (out may be in), in F32."""
    launch_strided(_geglu_scale, SCALE, outputs[0], inputs[0], None, float(attrs["factor"]))


@register_kernel("gelu_tanh", "nvidia", dtypes=FLOATS)
def gelu_tanh(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) for outputs (out,), inputs (x,) of one
    shape (out may be x), any strides, in F32."""
    launch_strided(_gelu, GELU_TANH, outputs[0], inputs[0])


@register_kernel("gelu_erf", "nvidia", dtypes=FLOATS)
def gelu_erf(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """out = 0.5 x (1 + erf(x / sqrt(2))) for outputs (out,), inputs (x,) of one shape (out may be
    x), any strides, in F32."""
    launch_strided(_gelu, GELU_ERF, outputs[0], inputs[0])
