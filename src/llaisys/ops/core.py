"""The nine ops, output first. Shapes: S = sequence length, T = total (KV) length,
H = query heads, KH = key/value heads, D = head dim, M = rows, K = in features, N = out features."""
from __future__ import annotations

from ..kernels import dispatch
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from ._checks import (FLOAT_TYPES, dtype_in, ndim_is, same_device, same_dtype, shape_is, tensor_arg)


def add(c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """c = a + b, elementwise; all three of one shape and float dtype. Returns c."""
    for n, t in (("c", c), ("a", a), ("b", b)):
        tensor_arg("add", n, t)
    same_device("add", c=c, a=a, b=b)
    dtype_in("add", "c", c, FLOAT_TYPES)
    same_dtype("add", "c", c, a=a, b=b)
    shape_is("add", "a", a, c.shape)
    shape_is("add", "b", b, c.shape)
    dispatch("add", c.dtype, (c,), (a, b), {})
    return c


def argmax(max_idx: Tensor, max_val: Tensor, vals: Tensor) -> tuple[Tensor, Tensor]:
    """Index (I64) and value of the maximum over the last dimension of ``vals`` (..., n).

    Outputs have shape vals.shape[:-1], or (1,) when vals is 1-D. Ties give the first index.
    """
    for n, t in (("max_idx", max_idx), ("max_val", max_val), ("vals", vals)):
        tensor_arg("argmax", n, t)
    same_device("argmax", vals=vals, max_idx=max_idx, max_val=max_val)
    dtype_in("argmax", "vals", vals, FLOAT_TYPES)
    dtype_in("argmax", "max_idx", max_idx, (DataType.I64,))
    same_dtype("argmax", "vals", vals, max_val=max_val)
    if vals.ndim == 0 or vals.shape[-1] == 0:
        raise ValueError(f"argmax: vals must have a non-empty last dimension; got shape {vals.shape}")
    out_shape = vals.shape[:-1] if vals.ndim > 1 else (1,)
    shape_is("argmax", "max_idx", max_idx, out_shape)
    shape_is("argmax", "max_val", max_val, out_shape)
    dispatch("argmax", vals.dtype, (max_idx, max_val), (vals,), {})
    return max_idx, max_val


def embedding(out: Tensor, index: Tensor, weight: Tensor) -> Tensor:
    """out[i] = weight[index[i]]: index (S,) I64, weight (V, D), out (S, D). Returns out."""
    for n, t in (("out", out), ("index", index), ("weight", weight)):
        tensor_arg("embedding", n, t)
    same_device("embedding", out=out, index=index, weight=weight)
    dtype_in("embedding", "index", index, (DataType.I64,))
    dtype_in("embedding", "weight", weight, FLOAT_TYPES)
    same_dtype("embedding", "weight", weight, out=out)
    ndim_is("embedding", "index", index, 1, "(S,) token ids")
    ndim_is("embedding", "weight", weight, 2, "(V, D) table")
    shape_is("embedding", "out", out, (index.shape[0], weight.shape[1]))
    dispatch("embedding", weight.dtype, (out,), (index, weight), {})
    return out


def linear(out: Tensor, inp: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """out = inp @ weight^T + bias: inp (..., K), weight (N, K) (not transposed), bias (N,)
    or None, out (..., N). Returns out."""
    for n, t in (("out", out), ("in", inp), ("weight", weight)):
        tensor_arg("linear", n, t)
    if bias is not None:
        tensor_arg("linear", "bias", bias)
    same_device("linear", out=out, inp=inp, weight=weight, bias=bias)
    dtype_in("linear", "out", out, FLOAT_TYPES)
    same_dtype("linear", "out", out, inp=inp, weight=weight, bias=bias)
    ndim_is("linear", "weight", weight, 2, "(N, K) matrix")
    if inp.ndim < 1 or inp.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: in has shape {inp.shape} but weight {weight.shape} expects in features K={weight.shape[1]} in the last dimension")
    shape_is("linear", "out", out, inp.shape[:-1] + (weight.shape[0],))
    if bias is not None:
        shape_is("linear", "bias", bias, (weight.shape[0],))
    dispatch("linear", out.dtype, (out,), (inp, weight, bias), {})
    return out


def rearrange(out: Tensor, inp: Tensor) -> Tensor:
    """Copy ``inp`` into ``out`` (same shape and dtype, any strides of either). Returns out."""
    tensor_arg("rearrange", "out", out)
    tensor_arg("rearrange", "in", inp)
    same_device("rearrange", out=out, inp=inp)
    same_dtype("rearrange", "out", out, inp=inp)
    shape_is("rearrange", "in", inp, out.shape)
    if out.numel():
        dispatch("rearrange", out.dtype, (out,), (inp,), {})
    return out


def rms_norm(out: Tensor, inp: Tensor, weight: Tensor, eps: float) -> Tensor:
    """out = inp / sqrt(mean(inp^2 over the last dim) + eps) * weight: inp, out (..., D),
    weight (D,). Returns out."""
    for n, t in (("out", out), ("in", inp), ("weight", weight)):
        tensor_arg("rms_norm", n, t)
    same_device("rms_norm", out=out, inp=inp, weight=weight)
    dtype_in("rms_norm", "out", out, FLOAT_TYPES)
    same_dtype("rms_norm", "out", out, inp=inp, weight=weight)
    if inp.ndim < 1:
        raise ValueError("rms_norm: in must have at least one dimension")
    shape_is("rms_norm", "out", out, inp.shape)
    shape_is("rms_norm", "weight", weight, (inp.shape[-1],))
    if not eps >= 0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps}")
    dispatch("rms_norm", out.dtype, (out,), (inp, weight), {"eps": float(eps)})
    return out


def rope(out: Tensor, inp: Tensor, pos_ids: Tensor, theta: float) -> Tensor:
    """Rotary position embedding on inp (S, H, D) at positions pos_ids (S,) I64.

    With a = x[..., :D/2], b = x[..., D/2:] and phi_j = pos / theta^(2j/D):
    out[..., :D/2] = a cos(phi) - b sin(phi); out[..., D/2:] = b cos(phi) + a sin(phi).
    Returns out.
    """
    for n, t in (("out", out), ("in", inp), ("pos_ids", pos_ids)):
        tensor_arg("rope", n, t)
    same_device("rope", out=out, inp=inp, pos_ids=pos_ids)
    dtype_in("rope", "out", out, FLOAT_TYPES)
    same_dtype("rope", "out", out, inp=inp)
    dtype_in("rope", "pos_ids", pos_ids, (DataType.I64,))
    ndim_is("rope", "in", inp, 3, "(S, H, D)")
    shape_is("rope", "out", out, inp.shape)
    shape_is("rope", "pos_ids", pos_ids, (inp.shape[0],))
    if inp.shape[2] % 2:
        raise ValueError(f"rope: head dim D must be even; got D={inp.shape[2]}")
    if not theta > 0:
        raise ValueError(f"rope: theta must be > 0, got {theta}")
    dispatch("rope", out.dtype, (out,), (inp, pos_ids), {"theta": float(theta)})
    return out


def self_attention(attn_val: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention: q (S, H, D), k (T, KH, D), v (T, KH, Dv), attn_val (S, H, Dv), T >= S.

    Query i sits at position T - S + i and sees keys 0..T - S + i; query head h uses KV head
    h // (H / KH). attn_val = softmax(q k^T * scale + mask) v. Returns attn_val.
    """
    for n, t in (("attn_val", attn_val), ("q", q), ("k", k), ("v", v)):
        tensor_arg("self_attention", n, t)
    same_device("self_attention", attn_val=attn_val, q=q, k=k, v=v)
    dtype_in("self_attention", "q", q, FLOAT_TYPES)
    same_dtype("self_attention", "q", q, k=k, v=v, attn_val=attn_val)
    ndim_is("self_attention", "q", q, 3, "(S, H, D)")
    ndim_is("self_attention", "k", k, 3, "(T, KH, D)")
    ndim_is("self_attention", "v", v, 3, "(T, KH, Dv)")
    s, h, d = q.shape
    t, kh, dk = k.shape
    if dk != d:
        raise ValueError(f"self_attention: k head dim {dk} differs from q head dim {d}")
    if v.shape[:2] != (t, kh):
        raise ValueError(f"self_attention: v has shape {v.shape}; expected ({t}, {kh}, Dv) to match k {k.shape}")
    if kh == 0 or h % kh:
        raise ValueError(f"self_attention: {h} query heads are not a multiple of {kh} key/value heads")
    if t < s:
        raise ValueError(f"self_attention: KV length {t} is shorter than query length {s}")
    shape_is("self_attention", "attn_val", attn_val, (s, h, v.shape[2]))
    dispatch("self_attention", q.dtype, (attn_val,), (q, k, v), {"scale": float(scale)})
    return attn_val


def swiglu(out: Tensor, gate: Tensor, up: Tensor) -> Tensor:
    """out = up * gate * sigmoid(gate), elementwise; all of one shape. Returns out."""
    for n, t in (("out", out), ("gate", gate), ("up", up)):
        tensor_arg("swiglu", n, t)
    same_device("swiglu", out=out, gate=gate, up=up)
    dtype_in("swiglu", "out", out, FLOAT_TYPES)
    same_dtype("swiglu", "out", out, gate=gate, up=up)
    shape_is("swiglu", "gate", gate, out.shape)
    shape_is("swiglu", "up", up, out.shape)
    dispatch("swiglu", out.dtype, (out,), (gate, up), {})
    return out
