"""The ops in functional form: each returns new output tensor(s) on the inputs' device.

Only what is needed to size the output is checked here; the op in ``core`` checks the rest.
"""
from __future__ import annotations

from ..runtime.dtypes import DataType
from ..tensor import Tensor
from . import core
from .moe import moe_mlp as _moe_mlp
from ._checks import ndim_is, tensors_match

_new = Tensor.empty_like


def add(a: Tensor, b: Tensor) -> Tensor:
    """a + b as a new tensor of a's shape and dtype."""
    tensors_match("add", ("a", "b"), (a, b))
    return core.add(_new(a), a, b)


def add_rms_norm(a: Tensor, b: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(a + b, weight, eps), a + b) as two new tensors of a's shape and dtype."""
    tensors_match("add_rms_norm", ("a", "b", "weight"), (a, b, weight))
    return core.add_rms_norm(_new(a), _new(a), a, b, weight, eps)


def argmax(vals: Tensor) -> tuple[Tensor, Tensor]:
    """(index I64, value) of the maximum over the last dimension of vals (..., n): two
    tensors of shape vals.shape[:-1], or (1,) when vals is 1-D."""
    tensors_match("argmax", ("vals",), (vals,))
    shape = vals.shape[:-1] if vals.ndim > 1 else (1,)
    return core.argmax(_new(vals, shape, DataType.I64), _new(vals, shape), vals)


def embedding(index: Tensor, weight: Tensor) -> Tensor:
    """Rows of weight (V, D) at index (S,) I64: (S, D), of weight's type (F32 for a
    block-quantized table)."""
    tensors_match("embedding", ("weight", "index"), (weight, index), dtypes=1)
    ndim_is("embedding", "index", index, 1, "(S,) token ids")
    ndim_is("embedding", "weight", weight, 2, "(V, D) table")
    dtype = DataType.F32 if weight.dtype.is_quantized else weight.dtype
    return core.embedding(_new(weight, (index.shape[0], weight.shape[1]), dtype), index, weight)


def linear(inp: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """inp (..., K) @ weight (N, K)^T + bias (N,): (..., N)."""
    tensors_match("linear", ("in", "weight", "bias"), (inp, weight, bias), dtypes=1)
    ndim_is("linear", "weight", weight, 2, "(N, K) matrix")
    return core.linear(_new(inp, inp.shape[:-1] + weight.shape[:1]), inp, weight, bias)


def rearrange(inp: Tensor) -> Tensor:
    """A contiguous copy of inp."""
    tensors_match("rearrange", ("in",), (inp,))
    return core.rearrange(_new(inp), inp)


def rms_norm(inp: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMS normalisation of inp (..., D) scaled by weight (D,): (..., D)."""
    tensors_match("rms_norm", ("in", "weight"), (inp, weight))
    return core.rms_norm(_new(inp), inp, weight, eps)


def layer_norm(inp: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """Layer normalisation of inp (..., D) scaled by weight (D,) plus bias (D,) or None: (..., D)."""
    tensors_match("layer_norm", ("in", "weight", "bias"), (inp, weight, bias))
    return core.layer_norm(_new(inp), inp, weight, bias, eps)


def rope(inp: Tensor, pos_ids: Tensor, theta: float, freqs: Tensor | None = None,
         attention_factor: float = 1.0) -> Tensor:
    """Rotary embedding of inp (S, H, D) at positions pos_ids (S,) I64: (S, H, D); ``freqs``
    and ``attention_factor`` as ``ops.rope`` takes them."""
    tensors_match("rope", ("in", "pos_ids", "freqs"), (inp, pos_ids, freqs), dtypes=1)
    return core.rope(_new(inp), inp, pos_ids, theta, freqs, attention_factor)


def self_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, *, causal: bool = True) -> Tensor:
    """Attention of q (S, H, D) over k (T, KH, D), v (T, KH, Dv): (S, H, Dv); causal unless
    ``causal=False`` (every query sees every key), as ``ops.self_attention``."""
    tensors_match("self_attention", ("q", "k", "v"), (q, k, v))
    ndim_is("self_attention", "q", q, 3, "(S, H, D)")
    ndim_is("self_attention", "v", v, 3, "(T, KH, Dv)")
    return core.self_attention(_new(q, q.shape[:2] + v.shape[2:]), q, k, v, scale, causal=causal)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """up * silu(gate) as a new tensor of gate's shape."""
    tensors_match("swiglu", ("gate", "up"), (gate, up))
    return core.swiglu(_new(gate), gate, up)


def geglu(gate: Tensor, up: Tensor) -> Tensor:
    """up * gelu_tanh(gate) as a new tensor of gate's shape."""
    tensors_match("geglu", ("gate", "up"), (gate, up))
    return core.geglu(_new(gate), gate, up)


def gelu(inp: Tensor, *, approximate: str = "tanh") -> Tensor:
    """gelu(inp) ("tanh" or "none", as ``ops.gelu``) as a new tensor of inp's shape and dtype."""
    tensors_match("gelu", ("in",), (inp,))
    return core.gelu(_new(inp), inp, approximate=approximate)


def scale(inp: Tensor, factor: float) -> Tensor:
    """inp * factor as a new tensor of inp's shape and dtype."""
    tensors_match("scale", ("in",), (inp,))
    return core.scale(_new(inp), inp, factor)


def moe_mlp(h: Tensor, router_logits: Tensor, gate: Tensor, up: Tensor, down: Tensor, top_k: int,
            norm_topk_prob: bool) -> Tensor:
    """The routed SwiGLU experts of h (N, D) (``ops.moe_mlp``) as a new (N, D) tensor of h's type."""
    tensors_match("moe_mlp", ("h",), (h,))
    return _moe_mlp(_new(h), h, router_logits, gate, up, down, top_k, norm_topk_prob)
