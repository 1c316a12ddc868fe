"""moe_mlp on the CPU: routing in NumPy, then the tokens grouped by expert, so each chosen
expert's weights are read once per call: its rows (views of the stacked matrices) multiplied
with the rows of its tokens by the CPU ``linear`` kernel of the weight's type (the native
kernels for block-quantized and F16/BF16 experts, BLAS for F32 ones), the native ``swiglu``
between. The experts run in ascending order and each adds its weighted output to its tokens'
rows, so every token sums its experts in ascending order (as transformers does), whatever the
other tokens are: a token's result depends on the rest of the batch only as far as
``linear``'s does (not at all for block-quantized and F16/BF16 weights; BLAS may round an F32
product differently for another number of rows).

Activations are float32 throughout (F16/BF16 ones widened), the output rounded once. Buffers
of small groups are kept with the output tensor, so a decoding step reuses them and the
native calls bound to them. Other devices run this kernel through the registry's CPU fallback.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...runtime.dtypes import QUANTIZED_TYPES, DataType
from ...tensor import Storage, Tensor
from ..registry import find_kernel, register_kernel
from ._common import FLOATS, f32

if TYPE_CHECKING:
    from ..registry import Kernel


def route(logits: np.ndarray, top_k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """The experts (N, k) int64 of each token, in ascending order, and their weights (N, k)
    float32: the top_k of softmax(logits (N, E)) in float32, divided by their sum when ``norm``."""
    x = f32(logits)
    probs = np.exp(x - x.max(axis=-1, keepdims=True))  # (N, E)
    probs /= probs.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # (N, k) largest first, ties by index
    chosen.sort(axis=-1)  # (N, k) ascending: the order the outputs are added in
    weights = probs[np.arange(len(probs))[:, None], chosen]  # (N, k)
    if norm:
        weights /= weights.sum(axis=-1, keepdims=True)
    return chosen, weights


_KEPT_ROWS = 16  # buffers of groups up to this many tokens are kept with the output (decoding)


def _host(shape: tuple[int, ...]) -> Tensor:
    """A new float32 CPU tensor over a NumPy buffer (outside the caching allocator)."""
    storage = Storage.host_scratch(4 * int(np.prod(shape)))
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return Tensor(storage, 0, shape, strides, DataType.F32)


def _buffers(out_t: Tensor, m: int, d: int, inter: int) -> tuple[Tensor, ...]:
    """(x (M, D), gate (M, I), up (M, I), act (M, I), y (M, D)) float32 host tensors for a group
    of M tokens; for small M kept with the output tensor, so the linear kernels' calls bound to
    them (the quantized kernels bind their native call to the tensors) serve every decoding step."""
    make = lambda: (_host((m, d)), _host((m, inter)), _host((m, inter)), _host((m, inter)), _host((m, d)))  # noqa: E731
    if m > _KEPT_ROWS:
        return make()
    kept = out_t.derived("moe.buffers", lambda t: {})
    if (m, d, inter) not in kept:
        kept[(m, d, inter)] = make()
    return kept[(m, d, inter)]


def _experts(w: Tensor, experts: int) -> list[Tensor]:
    """The E row ranges of a stacked matrix (E*R, C), views, made once per weight."""
    rows = w.shape[0] // experts
    return w.derived(f"moe.experts.{experts}", lambda t: [t.slice(0, e * rows, (e + 1) * rows)
                                                         for e in range(experts)])


def _linear(weight_dtype: DataType) -> "Kernel":
    """The CPU linear kernel for float32 activations and weights of ``weight_dtype``."""
    kernel = find_kernel("linear", "cpu", DataType.F32, weight_dtype=weight_dtype)
    assert kernel is not None, f"no CPU linear kernel for F32 activations with {weight_dtype.name} weights"
    return kernel


def moe_mlp(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out (N, D) = the routed SwiGLU experts of h (N, D) for inputs (h, router_logits (N, E),
    gate (E*I, D), up (E*I, D), down (E*D, I)); attrs top_k, norm_topk_prob."""
    out_t = outputs[0]
    out = out_t.host_array()  # (N, D)
    h_t, logits_t, gate_t, up_t, down_t = inputs
    n_experts = logits_t.shape[1]
    inter = gate_t.shape[0] // n_experts
    chosen, weights = route(logits_t.host_array(), attrs["top_k"], attrs["norm_topk_prob"])  # (N, k) x2
    h = h_t.host_array()  # (N, D)
    gates, ups, downs = (_experts(w, n_experts) for w in (gate_t, up_t, down_t))
    gate_mm, up_mm, down_mm = (_linear(w.dtype) for w in (gate_t, up_t, down_t))
    swiglu = find_kernel("swiglu", "cpu", DataType.F32)
    n, k = chosen.shape
    d = out.shape[1]
    # Experts run in ascending order, so each token's outputs are added in ascending expert
    # order (transformers' order), whatever the other tokens are: 0 + y_a*w_a + y_b*w_b ...
    total = np.zeros((n, d), np.float32)  # (N, D)
    if n == 1:  # one token (decoding): its experts in order, the same calls as a group of one
        x_t, g_t, u_t, act_t, y_t = _buffers(out_t, 1, d, inter)
        x_t.host_array()[...] = h
        for e, w in zip(chosen[0].tolist(), weights[0]):
            gate_mm((g_t,), (x_t, gates[e], None), {})  # (1, I)
            up_mm((u_t,), (x_t, ups[e], None), {})  # (1, I)
            swiglu((act_t,), (g_t, u_t), {})  # (1, I)
            down_mm((y_t,), (act_t, downs[e], None), {})  # (1, D)
            total += y_t.host_array() * w
        out[...] = total
        return
    flat = chosen.reshape(-1)  # (N*k,) slot t*k + j: token t's j-th expert
    order = np.argsort(flat, kind="stable")  # slots grouped by expert, tokens ascending
    counts = np.bincount(flat, minlength=n_experts)  # (E,) tokens per expert
    starts = np.cumsum(counts) - counts  # (E,) where each expert's run begins in order
    for e in np.flatnonzero(counts).tolist():
        slots = order[starts[e]:starts[e] + counts[e]]  # (M,) the slots routed to expert e
        tokens = slots // k  # (M,) distinct: a token chooses an expert once
        x_t, g_t, u_t, act_t, y_t = _buffers(out_t, len(slots), d, inter)
        x = x_t.host_array()  # (M, D)
        x[...] = h[tokens]
        gate_mm((g_t,), (x_t, gates[e], None), {})  # (M, I)
        up_mm((u_t,), (x_t, ups[e], None), {})  # (M, I)
        swiglu((act_t,), (g_t, u_t), {})  # (M, I) silu(gate) * up
        down_mm((y_t,), (act_t, downs[e], None), {})  # (M, D)
        total[tokens] += y_t.host_array() * weights.reshape(-1)[slots, None]
    out[...] = total  # rounded once, to the output type


register_kernel("moe_mlp", "cpu", dtypes=FLOATS, weight_dtypes=(*FLOATS, *QUANTIZED_TYPES), kernel=moe_mlp)
