"""The ops, output first; given ``plan=`` (an ``ops.Plan``), an op checks its arguments and
records its kernel call there instead of running it. Shapes: S = sequence length, T = total
(KV) length, H = query heads, KH = key/value heads, D = head dim, M = rows, K = in features, N = out features."""
from __future__ import annotations

from ..kernels import find_kernel, resolve
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from .plan import Plan
from ._checks import FLOAT_TYPES, INDEX_TYPES, dtype_in, ndim_is, number, shape_is, tensors_match, weight_type_fits


def add(c: Tensor, a: Tensor, b: Tensor, *, plan: Plan | None = None) -> Tensor:
    """c = a + b, elementwise; all three of one shape and float dtype (F32, F16, BF16).
    Returns c."""
    tensors_match("add", ("c", "a", "b"), (c, a, b))
    dtype_in("add", "c", c, FLOAT_TYPES)
    shape_is("add", "a", a, c.shape)
    shape_is("add", "b", b, c.shape)
    if 0 not in c.shape:  # nothing to compute for an empty output
        _launch(plan, "add", c.dtype, (c,), (a, b), {})
    return c


def argmax(max_idx: Tensor, max_val: Tensor, vals: Tensor, *, plan: Plan | None = None) -> tuple[Tensor, Tensor]:
    """Index (I64) and value of the maximum over the last dimension of ``vals`` (..., n).

    Outputs have shape vals.shape[:-1], or (1,) when vals is 1-D. Ties give the first index.
    """
    tensors_match("argmax", ("vals", "max_val", "max_idx"), (vals, max_val, max_idx), dtypes=2)
    dtype_in("argmax", "vals", vals, FLOAT_TYPES)
    dtype_in("argmax", "max_idx", max_idx, INDEX_TYPES)
    if vals.ndim == 0 or vals.shape[-1] == 0:
        raise ValueError(f"argmax: vals must have a non-empty last dimension; got shape {vals.shape}")
    out_shape = vals.shape[:-1] if vals.ndim > 1 else (1,)
    shape_is("argmax", "max_idx", max_idx, out_shape)
    shape_is("argmax", "max_val", max_val, out_shape)
    if 0 not in max_idx.shape:
        _launch(plan, "argmax", vals.dtype, (max_idx, max_val), (vals,), {})
    return max_idx, max_val


def embedding(out: Tensor, index: Tensor, weight: Tensor, *, plan: Plan | None = None) -> Tensor:
    """out[i] = weight[index[i]]: index (S,) I64, weight (V, D), out (S, D). Returns out.

    weight is of out's float type, block-quantized (its rows are dequantized) or, with F32 out,
    F16/BF16 (its rows widened). Raises ValueError when an index is outside [0, V).
    """
    tensors_match("embedding", ("out", "index", "weight"), (out, index, weight), dtypes=1)
    dtype_in("embedding", "out", out, FLOAT_TYPES)
    if weight.dtype is not out.dtype:
        weight_type_fits("embedding", "out", out, weight, mixed=True)
    dtype_in("embedding", "index", index, INDEX_TYPES)
    ndim_is("embedding", "index", index, 1, "(S,) token ids")
    ndim_is("embedding", "weight", weight, 2, "(V, D) table")
    shape_is("embedding", "out", out, (index.shape[0], weight.shape[1]))
    if 0 not in out.shape:
        _launch(plan, "embedding", out.dtype, (out,), (index, weight), {}, weight.dtype)
    return out


def linear(out: Tensor, inp: Tensor, weight: Tensor, bias: Tensor | None = None, *, plan: Plan | None = None) -> Tensor:
    """out = inp @ weight^T + bias: inp (..., K), weight (N, K) (not transposed), bias (N,)
    or None, out (..., N). Returns out.

    out, inp and bias share one float type; weight has it too, or is block-quantized
    (computed on the stored blocks, in float32), or is F16/BF16 with F32 activations.
    """
    tensors_match("linear", ("out", "in", "bias", "weight"), (out, inp, bias, weight), dtypes=3)
    dtype_in("linear", "out", out, FLOAT_TYPES)
    if weight.dtype is not out.dtype:
        weight_type_fits("linear", "out", out, weight, mixed=True)
    ndim_is("linear", "weight", weight, 2, "(N, K) matrix")
    if inp.ndim < 1 or inp.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: in has shape {inp.shape} but weight {weight.shape} expects "
                         f"K={weight.shape[1]} in features in the last dimension")
    shape_is("linear", "out", out, inp.shape[:-1] + (weight.shape[0],))
    if bias is not None:
        shape_is("linear", "bias", bias, (weight.shape[0],))
    if 0 not in out.shape:
        _launch(plan, "linear", out.dtype, (out,), (inp, weight, bias), {}, weight.dtype)
    return out


def rearrange(out: Tensor, inp: Tensor, *, plan: Plan | None = None) -> Tensor:
    """Copy ``inp`` into ``out`` (same shape and dtype, any strides of either). Returns out."""
    tensors_match("rearrange", ("out", "in"), (out, inp))
    shape_is("rearrange", "in", inp, out.shape)
    if 0 not in out.shape:  # nothing to copy
        _launch(plan, "rearrange", out.dtype, (out,), (inp,), {})
    return out


def rms_norm(out: Tensor, inp: Tensor, weight: Tensor, eps: float, *, plan: Plan | None = None) -> Tensor:
    """out = inp / sqrt(mean(inp^2 over the last dim) + eps) * weight: inp, out (..., D),
    weight (D,). Returns out."""
    tensors_match("rms_norm", ("out", "in", "weight"), (out, inp, weight))
    dtype_in("rms_norm", "out", out, FLOAT_TYPES)
    if inp.ndim < 1:
        raise ValueError("rms_norm: in must have at least one dimension; got a scalar")
    shape_is("rms_norm", "out", out, inp.shape)
    shape_is("rms_norm", "weight", weight, inp.shape[-1:])
    eps = number("rms_norm", "eps", eps, ">= 0")
    if 0 not in out.shape:
        _launch(plan, "rms_norm", out.dtype, (out,), (inp, weight), {"eps": eps})
    return out


def layer_norm(out: Tensor, inp: Tensor, weight: Tensor, bias: Tensor | None, eps: float, *,
               plan: Plan | None = None) -> Tensor:
    """out = (inp - mean) / sqrt(var + eps) * weight + bias over the last dim (torch's
    LayerNorm: the biased variance): inp, out (..., D), weight (D,), bias (D,) or None; one
    float type, inp and out of any strides. Computed in F32, F16/BF16 rounded once. Returns out."""
    tensors_match("layer_norm", ("out", "in", "weight", "bias"), (out, inp, weight, bias))
    dtype_in("layer_norm", "out", out, FLOAT_TYPES)
    if inp.ndim < 1:
        raise ValueError("layer_norm: in must have at least one dimension; got a scalar")
    shape_is("layer_norm", "out", out, inp.shape)
    shape_is("layer_norm", "weight", weight, inp.shape[-1:])
    if bias is not None:
        shape_is("layer_norm", "bias", bias, inp.shape[-1:])
    eps = number("layer_norm", "eps", eps, ">= 0")
    if 0 not in out.shape:
        _launch(plan, "layer_norm", out.dtype, (out,), (inp, weight, bias), {"eps": eps})
    return out


def add_rms_norm(out: Tensor, total: Tensor, a: Tensor, b: Tensor, weight: Tensor, eps: float, *,
                 plan: Plan | None = None) -> tuple[Tensor, Tensor]:
    """total = a + b, then out = rms_norm(total, weight, eps), in one call (a residual add and
    the next block's norm): a, b, total, out (..., D), weight (D,). ``total`` may be ``a``.
    Equal to ``add`` then ``rms_norm``. Returns (out, total)."""
    tensors_match("add_rms_norm", ("out", "total", "a", "b", "weight"), (out, total, a, b, weight))
    dtype_in("add_rms_norm", "out", out, FLOAT_TYPES)
    if out.ndim < 1:
        raise ValueError("add_rms_norm: out must have at least one dimension; got a scalar")
    for name, t in (("total", total), ("a", a), ("b", b)):
        shape_is("add_rms_norm", name, t, out.shape)
    shape_is("add_rms_norm", "weight", weight, out.shape[-1:])
    eps = number("add_rms_norm", "eps", eps, ">= 0")
    if 0 in out.shape:
        return out, total
    device = out.device
    if device.is_cpu or find_kernel("add_rms_norm", device.type.name, out.dtype) is not None:
        _launch(plan, "add_rms_norm", out.dtype, (out, total), (a, b, weight), {"eps": eps})
    else:  # a device without the fused kernel runs the two ops, with its own kernels where it has them
        _launch(plan, "add", out.dtype, (total,), (a, b), {})
        _launch(plan, "rms_norm", out.dtype, (out,), (total, weight), {"eps": eps})
    return out, total


def rope(out: Tensor, inp: Tensor, pos_ids: Tensor, theta: float, freqs: Tensor | None = None,
         attention_factor: float = 1.0, *, plan: Plan | None = None) -> Tensor:
    """Rotary position embedding on inp (S, H, D) at positions pos_ids (S,) I64.

    With a = x[..., :R/2], b = x[..., R/2:R] and phi_j = pos * f_j:
    out[..., :R/2] = a cos(phi) - b sin(phi); out[..., R/2:R] = b cos(phi) + a sin(phi);
    out[..., R:] = x[..., R:] (partial rotary). Without ``freqs``: R = D and f_j = theta^(-2j/D).
    ``freqs`` (R/2,) F32, R even and <= D: the inverse frequencies f_j (theta is then unused);
    ``attention_factor`` multiplies cos and sin (YaRN), and needs ``freqs``. Returns out.
    """
    tensors_match("rope", ("out", "in", "pos_ids", "freqs"), (out, inp, pos_ids, freqs), dtypes=2)
    dtype_in("rope", "out", out, FLOAT_TYPES)
    dtype_in("rope", "pos_ids", pos_ids, INDEX_TYPES)
    ndim_is("rope", "in", inp, 3, "(S, H, D)")
    shape_is("rope", "out", out, inp.shape)
    shape_is("rope", "pos_ids", pos_ids, inp.shape[:1])
    if inp.shape[2] % 2:
        raise ValueError(f"rope: head dim D must be even; got D={inp.shape[2]}")
    theta = number("rope", "theta", theta, "> 0")
    attention_factor = number("rope", "attention_factor", attention_factor, "> 0")
    if freqs is None:
        if attention_factor != 1.0:
            raise ValueError(f"rope: attention_factor={attention_factor} needs freqs, the inverse frequencies "
                             "(R/2,) F32; pass them too")
        if 0 not in out.shape:
            _launch(plan, "rope", out.dtype, (out,), (inp, pos_ids), {"theta": theta})
        return out
    dtype_in("rope", "freqs", freqs, frozenset({DataType.F32}))
    ndim_is("rope", "freqs", freqs, 1, "(R/2,) inverse frequencies")
    if not 0 < 2 * freqs.shape[0] <= inp.shape[2]:
        raise ValueError(f"rope: freqs has shape {freqs.shape}: R/2 values for R rotated dims, 0 < R <= D; "
                         f"in has D={inp.shape[2]}")
    if 0 not in out.shape:
        # Its own kernel name: a plugin's rope kernel takes theta only, so this call falls back to the CPU there.
        _launch(plan, "rope_freqs", out.dtype, (out,), (inp, pos_ids, freqs), {"attention_factor": attention_factor})
    return out


def self_attention(attn_val: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, *, window: int = 0,
                   causal: bool = True, plan: Plan | None = None) -> Tensor:
    """Attention: q (S, H, D), k (T, KH, D), v (T, KH, Dv), attn_val (S, H, Dv); query head h
    uses KV head h // (H / KH). attn_val = softmax(q k^T * scale + mask) v.

    Causal (the default, T >= S): query i sits at position T - S + i and sees keys
    0..T - S + i (with ``window`` > 0 only the last ``window`` of them, its own included: a
    sliding window). ``causal=False`` (a vision encoder's): every query sees every key, T
    needs no relation to S, and ``window`` must be 0. A windowed call dispatches as
    ``self_attention_window`` and a non-causal one as ``self_attention_full``, so a kernel that
    knows only the causal form is never handed another. Returns attn_val.
    """
    tensors_match("self_attention", ("q", "k", "v", "attn_val"), (q, k, v, attn_val))
    dtype_in("self_attention", "q", q, FLOAT_TYPES)
    ndim_is("self_attention", "q", q, 3, "(S, H, D)")
    ndim_is("self_attention", "k", k, 3, "(T, KH, D)")
    ndim_is("self_attention", "v", v, 3, "(T, KH, Dv)")
    s, h, d = q.shape
    t, kh, dk = k.shape
    if dk != d:
        raise ValueError(f"self_attention: k has head dim {dk} (shape {k.shape}) but q has {d} (shape {q.shape})")
    if v.shape[:2] != (t, kh):
        raise ValueError(f"self_attention: v has shape {v.shape}; expected ({t}, {kh}, Dv) to match k {k.shape}")
    if kh == 0 or h % kh:
        raise ValueError(f"self_attention: q has {h} heads, not a multiple of the {kh} key/value heads of k")
    if not isinstance(causal, bool):
        raise TypeError(f"self_attention: causal must be a bool, got {type(causal).__name__}")
    window = window_size("self_attention", window)
    if causal and t < s:
        raise ValueError(f"self_attention: k and v hold {t} positions, fewer than the {s} queries of q")
    if not causal and window:
        raise ValueError(f"self_attention: window={window} needs causal attention; a non-causal call "
                         "(causal=False) sees every key, so pass window=0")
    if not causal and t == 0 and s:
        raise ValueError(f"self_attention: k and v hold no positions for the {s} queries of q to attend to")
    shape_is("self_attention", "attn_val", attn_val, (s, h, v.shape[2]))
    scale = number("self_attention", "scale", scale)
    if 0 not in attn_val.shape:
        if not causal:
            _launch(plan, "self_attention_full", q.dtype, (attn_val,), (q, k, v), {"scale": scale})
        elif window:
            _launch(plan, "self_attention_window", q.dtype, (attn_val,), (q, k, v), {"scale": scale, "window": window})
        else:
            _launch(plan, "self_attention", q.dtype, (attn_val,), (q, k, v), {"scale": scale})
    return attn_val


def window_size(op: str, window: object) -> int:
    """``window`` checked as a sliding window's key count: an int >= 0 (0: no window)."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"{op}: window must be an integer >= 0 (0: no sliding window), got {window!r}")
    return window


def swiglu(out: Tensor, gate: Tensor, up: Tensor, *, plan: Plan | None = None) -> Tensor:
    """out = up * gate * sigmoid(gate), elementwise; all of one shape. Returns out."""
    return _gated("swiglu", out, gate, up, plan)


def _gated(op: str, out: Tensor, gate: Tensor, up: Tensor, plan: Plan | None) -> Tensor:
    """Check and run gated activation ``op`` (swiglu, geglu): out, gate and up of one shape
    and float dtype on one device. Returns out."""
    tensors_match(op, ("out", "gate", "up"), (out, gate, up))
    dtype_in(op, "out", out, FLOAT_TYPES)
    shape_is(op, "gate", gate, out.shape)
    shape_is(op, "up", up, out.shape)
    if 0 not in out.shape:
        _launch(plan, op, out.dtype, (out,), (gate, up), {})
    return out


def _launch(plan: Plan | None, name: str, dtype: DataType, outputs: tuple, inputs: tuple, attrs: dict,
            weight_dtype: DataType | None = None) -> None:
    """Run the kernel of op ``name`` now, or append the call to ``plan``."""
    kernel = resolve(name, dtype, outputs, weight_dtype)
    if plan is None:
        kernel(outputs, inputs, attrs)
    else:
        plan.append(kernel, outputs, inputs, attrs)


def geglu(out: Tensor, gate: Tensor, up: Tensor, *, plan: Plan | None = None) -> Tensor:
    """out = up * gelu_tanh(gate), elementwise, with gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi)
    (x + 0.044715 x^3))) (torch's ``gelu(approximate="tanh")``, Gemma's MLP); all of one shape
    and float dtype, any strides (gate and up are usually column halves of one (S, 2I) buffer).
    F16/BF16 are computed in F32 and rounded once. Returns out."""
    return _gated("geglu", out, gate, up, plan)


GELU_KERNELS = {"tanh": "gelu_tanh", "none": "gelu_erf"}  # approximate= -> kernel name


def gelu(out: Tensor, inp: Tensor, *, approximate: str = "tanh", plan: Plan | None = None) -> Tensor:
    """out = gelu(inp), elementwise, as torch's ``gelu(x, approximate=...)``: "tanh" is
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (``gelu_pytorch_tanh``, SigLIP's), dispatched
    as ``gelu_tanh``; "none" is x (1 + erf(x / sqrt(2))) / 2, dispatched as ``gelu_erf``. out and
    inp of one shape and float type, any strides; out may be inp. Computed in F32, F16/BF16
    rounded once. Returns out."""
    kernel = GELU_KERNELS.get(approximate) if isinstance(approximate, str) else None
    if kernel is None:
        raise ValueError(f"gelu: approximate must be one of {', '.join(map(repr, GELU_KERNELS))}, got {approximate!r}")
    tensors_match("gelu", ("out", "in"), (out, inp))
    dtype_in("gelu", "out", out, FLOAT_TYPES)
    shape_is("gelu", "in", inp, out.shape)
    if 0 not in out.shape:
        _launch(plan, kernel, out.dtype, (out,), (inp,), {})
    return out


def scale(out: Tensor, inp: Tensor, factor: float, *, plan: Plan | None = None) -> Tensor:
    """out = inp * factor, elementwise; out and inp of one shape and float dtype, any strides;
    out may be inp (in place). The product of inp and float32(factor) is computed in F32 and
    rounded once to the dtype: a caller that wants the factor rounded to the activations' type
    first (Gemma scales its embeddings by sqrt(hidden_size) in their dtype) passes it rounded.
    Returns out."""
    tensors_match("scale", ("out", "in"), (out, inp))
    dtype_in("scale", "out", out, FLOAT_TYPES)
    shape_is("scale", "in", inp, out.shape)
    factor = number("scale", "factor", factor)
    if 0 not in out.shape:
        _launch(plan, "scale", out.dtype, (out,), (inp,), {"factor": factor})
    return out
