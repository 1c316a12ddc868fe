"""The routed mixture-of-experts MLP (Qwen3-MoE's sparse layers), output first like the other ops.

Shapes: N tokens, D hidden, E experts, I an expert's MLP width, k experts per token.
"""
from __future__ import annotations

from ..tensor import Tensor
from ..runtime.dtypes import DataType
from ._checks import (FLOAT_TYPES, MIXED_WEIGHT_TYPES, QUANTIZED_TYPES, dtype_in, ndim_is, shape_is,
                      tensors_match)
from .core import _launch
from .plan import Plan


def moe_mlp(out: Tensor, h: Tensor, router_logits: Tensor, gate: Tensor, up: Tensor, down: Tensor, top_k: int,
            norm_topk_prob: bool, *, plan: Plan | None = None) -> Tensor:
    """out (N, D) = sum over the k chosen experts e of w_e * down_e(silu(gate_e h) * up_e h).

    Each token's experts are the ``top_k`` largest of softmax(router_logits) (N, E), computed in
    float32; their probabilities are the weights w_e, divided by their sum when
    ``norm_topk_prob``. The experts are stacked along dim 0: gate and up (E*I, D), down (E*D, I),
    expert e's rows e*I:(e+1)*I (and e*D:(e+1)*D of down). out, h and router_logits share a
    float type; each weight has it too, or is block-quantized, or F16/BF16 with F32
    activations. A token's result does not depend on the other tokens of the call wherever
    ``linear``'s does not (block-quantized and F16/BF16 weights). Returns out.
    """
    tensors_match("moe_mlp", ("out", "h", "router_logits", "gate", "up", "down"),
                  (out, h, router_logits, gate, up, down), dtypes=3)
    dtype_in("moe_mlp", "out", out, FLOAT_TYPES)
    ndim_is("moe_mlp", "out", out, 2, "(N, D) tokens")
    ndim_is("moe_mlp", "router_logits", router_logits, 2, "(N, E) router logits")
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        ndim_is("moe_mlp", name, w, 2, "matrix of stacked experts")
        if w.dtype is not out.dtype and w.dtype not in QUANTIZED_TYPES and not (
                w.dtype in MIXED_WEIGHT_TYPES and out.dtype is DataType.F32):
            raise TypeError(f"moe_mlp: {name} has data type {w.dtype.name}; expected out's {out.dtype.name}, a "
                            f"block-quantized type, or F16/BF16 with F32 activations")
    n, d = out.shape
    e = router_logits.shape[1]
    shape_is("moe_mlp", "h", h, (n, d))
    shape_is("moe_mlp", "router_logits", router_logits, (n, e))
    if e == 0 or gate.shape[0] % e or gate.shape[1] != d:
        raise ValueError(f"moe_mlp: gate has shape {gate.shape}; expected (E*I, D) with E={e} experts (the "
                         f"router's columns) and D={d}")
    inter = gate.shape[0] // e
    shape_is("moe_mlp", "up", up, gate.shape)
    shape_is("moe_mlp", "down", down, (e * d, inter))
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= e:
        raise ValueError(f"moe_mlp: top_k must be an integer in [1, {e}] (the number of experts), got {top_k!r}")
    if not isinstance(norm_topk_prob, bool):
        raise TypeError(f"moe_mlp: norm_topk_prob must be true or false, got {norm_topk_prob!r}")
    if n:
        _launch(plan, "moe_mlp", out.dtype, (out,), (h, router_logits, gate, up, down),
                {"top_k": top_k, "norm_topk_prob": norm_topk_prob}, gate.dtype)
    return out
