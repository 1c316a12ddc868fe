"""The ops in functional form: each returns new output tensor(s) on the inputs' device."""
from __future__ import annotations

from ..runtime.dtypes import DataType
from ..tensor import Tensor
from . import core


def _new(shape, like: Tensor, dtype: DataType | None = None) -> Tensor:
    return Tensor.empty(shape, dtype or like.dtype, like.device)


def add(a: Tensor, b: Tensor) -> Tensor:
    """a + b as a new tensor."""
    return core.add(_new(a.shape, a), a, b)


def argmax(vals: Tensor) -> tuple[Tensor, Tensor]:
    """(index I64, value) of the maximum over the last dimension of vals."""
    shape = vals.shape[:-1] if vals.ndim > 1 else (1,)
    return core.argmax(_new(shape, vals, DataType.I64), _new(shape, vals), vals)


def embedding(index: Tensor, weight: Tensor) -> Tensor:
    """Rows of weight (V, D) at index (S,): (S, D)."""
    return core.embedding(_new((index.shape[0], weight.shape[1]), weight), index, weight)


def linear(inp: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """inp (..., K) @ weight (N, K)^T + bias (N,): (..., N)."""
    return core.linear(_new(inp.shape[:-1] + (weight.shape[0],), inp), inp, weight, bias)


def rearrange(inp: Tensor) -> Tensor:
    """A contiguous copy of inp."""
    return core.rearrange(_new(inp.shape, inp), inp)


def rms_norm(inp: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMS normalisation of inp (..., D) scaled by weight (D,)."""
    return core.rms_norm(_new(inp.shape, inp), inp, weight, eps)


def rope(inp: Tensor, pos_ids: Tensor, theta: float) -> Tensor:
    """Rotary embedding of inp (S, H, D) at positions pos_ids (S,)."""
    return core.rope(_new(inp.shape, inp), inp, pos_ids, theta)


def self_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of q (S, H, D) over k (T, KH, D), v (T, KH, Dv): (S, H, Dv)."""
    return core.self_attention(_new(q.shape[:2] + (v.shape[2],), q), q, k, v, scale)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """up * silu(gate) as a new tensor."""
    return core.swiglu(_new(gate.shape, gate), gate, up)
