"""moe_mlp on the CPU, two ways with the same bits.

The C call (``llaisys_moe_mlp`` of csrc/kernels/moe.c), for F32 activations with
block-quantized or F16/BF16/F32 experts where the native libraries are built: routing,
grouping, the experts' products through the quantized kernels, SwiGLU (the native ``swiglu``'s
function) and the weighted sums in one call, with no Python between the products. Its argument
block is made once per set of tensors and kept with the output tensor, and a recorded plan
replays it inside its native stretch (``native_call``).

The NumPy path (``moe_mlp_numpy``), for everything else and the reference the C call is tested
against: routing in NumPy, then the tokens grouped by expert, so each chosen expert's weights
are read once per call: its rows (views of the stacked matrices) multiplied with the rows of
its tokens by the CPU ``linear`` kernel of the weight's type (the native kernels for
block-quantized and F16/BF16 experts, BLAS for F32 ones), the native ``swiglu`` between.
Activations are float32 throughout (F16/BF16 ones widened), the output rounded once. Buffers of
small groups are kept with the output tensor, so a decoding step reuses them and the native
calls bound to them.

Both run the experts in ascending order, each adding its weighted output to its tokens' rows,
so every token sums its experts in ascending order (as transformers does), whatever the other
tokens are: a token's result does not depend on the rest of the batch (the NumPy path with F32
experts aside: BLAS may round a product differently for another number of rows, where the C
call's F32 products do not). Other devices run this kernel through the registry's CPU fallback.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import _native
from ..._native import structs
from ...runtime.dtypes import QUANTIZED_TYPES, DataType
from ...tensor import Storage, Tensor
from ..quant import native
from ..registry import find_kernel, register_kernel
from . import native_calls, native_ops
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


@dataclass(slots=True)
class _Buffers:
    """The float32 host tensors of a group of M tokens' expert MLP."""

    x: Tensor  # (M, D) the group's rows of h
    gate: Tensor  # (M, I)
    up: Tensor  # (M, I)
    act: Tensor  # (M, I) silu(gate) * up
    y: Tensor  # (M, D)

    @classmethod
    def make(cls, m: int, d: int, inter: int) -> "_Buffers":
        return cls(_host((m, d)), _host((m, inter)), _host((m, inter)), _host((m, inter)), _host((m, d)))


def _buffers(out_t: Tensor, m: int, d: int, inter: int) -> _Buffers:
    """The buffers of a group of M tokens; for small M kept with the output tensor (by shape),
    so the linear kernels' calls bound to them (the quantized kernels bind their native call to
    the tensors) serve every decoding step."""
    if m > _KEPT_ROWS:
        return _Buffers.make(m, d, inter)
    kept = out_t.derived("moe.buffers", lambda t: {})  # (M, D, I) -> _Buffers
    if (m, d, inter) not in kept:
        kept[(m, d, inter)] = _Buffers.make(m, d, inter)
    return kept[(m, d, inter)]


def _experts(w: Tensor, experts: int) -> list[Tensor]:
    """The E row ranges of a stacked matrix (E*R, C), views, made once per weight."""
    rows = w.shape[0] // experts
    return w.derived(f"moe.experts.{experts}", lambda t: [t.slice(0, e * rows, (e + 1) * rows)
                                                         for e in range(experts)])


def _linear(weight_dtype: DataType) -> "Kernel":
    """The CPU linear for float32 activations and weights of ``weight_dtype``: for block-format
    and F16/BF16 weights the native kernels in the f32 arithmetic (the experts' arithmetic in
    both forms of this kernel, whichever the dense layers use), else the registered kernel."""
    if weight_dtype in _NATIVE_WEIGHTS and weight_dtype is not DataType.F32 and native.available():
        return _f32_native_linear
    kernel = find_kernel("linear", "cpu", DataType.F32, weight_dtype=weight_dtype)
    assert kernel is not None, f"no CPU linear kernel for F32 activations with {weight_dtype.name} weights"
    return kernel


def _f32_native_linear(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out (M, N) = x (M, K) @ w (N, K)^T for the NumPy form's buffers (contiguous, no bias)."""
    x_t, w_t, _ = inputs
    weight = native.QuantWeight(_NATIVE_WEIGHTS[w_t.dtype], np.ascontiguousarray(w_t.host_array()), pack=False)
    weight.linear_f32(x_t.host_array(), None, outputs[0].host_array())


# ---- the native form ---------------------------------------------------------------------
_NATIVE_WEIGHTS = {t: t.name for t in QUANTIZED_TYPES} | {t: t.name for t in (DataType.F32, DataType.F16,
                                                                              DataType.BF16)}
_lib: "_native.Library | bool | None" = None  # None until first use; False when the native form cannot run


def _library() -> "_native.Library | bool":
    """The kernels library (signatures declared by ``_native``), or False: not built (the NumPy
    path has said so where it matters), or built before ``llaisys_moe_mlp`` existed."""
    global _lib
    if _lib is None:
        lib = _native.load("kernels")
        _lib = lib if lib is not None and hasattr(lib, "llaisys_moe_mlp") else False
    return _lib


@dataclass(slots=True)
class _MoeEntry:
    """A ``moe_mlp`` call kept with its output: the argument block (None: the NumPy path runs
    for these tensors) and what it points into, the tensors included (so their ids stay theirs)."""

    args: "structs.MoeArgs | None"
    keep: tuple


def _native_weight(w_t: Tensor) -> "native.QuantWeight":
    """The stacked expert matrix checked once for the native kernels (a copy only where the
    tensor is not C-contiguous, kept with it)."""
    return native.QuantWeight(_NATIVE_WEIGHTS[w_t.dtype], np.ascontiguousarray(w_t.host_array()), pack=False)


def _row_stride(t: Tensor) -> int | None:
    """The row stride in elements of a 2-D tensor whose rows are contiguous, else None."""
    return t.strides[0] if t.strides[1] == 1 or t.shape[1] == 1 else None


def _native_args(out_t: Tensor, inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> "_MoeEntry | None":
    """The argument block of ``llaisys_moe_mlp`` for this call, with what it points into, or None where
    the NumPy path must run: a library or the native swiglu missing (its function is the one
    the block calls), activations other than F32, rows that are not contiguous."""
    h_t, logits_t, gate_t, up_t, down_t = inputs
    if (not _library() or not native_ops.available()
            or find_kernel("swiglu", "cpu", DataType.F32) is not native_ops.swiglu):
        return None
    if any(t.dtype is not DataType.F32 for t in (out_t, h_t, logits_t)):
        return None
    if any(w.dtype not in _NATIVE_WEIGHTS for w in (gate_t, up_t, down_t)):
        return None
    strides = [_row_stride(t) for t in (out_t, h_t, logits_t)]
    if None in strides:
        return None
    weights = [w.derived("moe.native", _native_weight) for w in (gate_t, up_t, down_t)]
    n, d = out_t.shape
    e = logits_t.shape[1]
    args = structs.MoeArgs(out_t.data_ptr, strides[0], h_t.data_ptr, strides[1], logits_t.data_ptr, strides[2],
                           *(w.raw.ctypes.data for w in weights), *(w.fmt.type_id for w in weights),
                           n, d, e, gate_t.shape[0] // e, attrs["top_k"], int(attrs["norm_topk_prob"]),
                           native_calls.address(native_ops._library(), "llaisys_ops_swiglu"))
    return _MoeEntry(args, (out_t, *inputs, weights))


def _failed(status: int) -> None:
    raise RuntimeError(f"llaisys_moe_mlp failed with status {status}")  # arguments were checked: a bug


def native_moe_mlp(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                   attrs: dict[str, Any]) -> "native_calls.NativeCall | None":
    """``moe_mlp`` as a C function and its argument block, for a replayed plan (None: the
    ordinary call must run)."""
    made = _native_args(outputs[0], inputs, attrs)
    if made is None or not native_calls.available():
        return None
    return native_calls.NativeCall("moe_mlp", native_calls.address(_library(), "llaisys_moe_mlp_call"), made.args,
                                   keep=made.keep)


def _no_calls(out_t: Tensor) -> dict:
    return {}


def moe_mlp(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """out (N, D) = the routed SwiGLU experts of h (N, D) for inputs (h, router_logits (N, E),
    gate (E*I, D), up (E*I, D), down (E*D, I)); attrs top_k, norm_topk_prob.

    One C call where it applies (``llaisys_moe_mlp``), its block made on the first call with
    these tensors and kept with the output; else the NumPy path (``moe_mlp_numpy``)."""
    out_t = outputs[0]
    bound = out_t.derived("moe.native_args", _no_calls)
    key = (*(id(t) for t in inputs), attrs["top_k"], attrs["norm_topk_prob"])
    entry = bound.get(key)  # the entry keeps the tensors, so their ids stay theirs
    if entry is None:
        entry = bound[key] = _native_args(out_t, inputs, attrs) or _MoeEntry(None, inputs)
    if entry.args is not None:
        status = _lib.llaisys_moe_mlp(ctypes.addressof(entry.args))
        if status:
            _failed(status)
        return
    moe_mlp_numpy(outputs, inputs, attrs)


def moe_mlp_numpy(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """``moe_mlp`` through NumPy routing and the CPU linear kernels (the reference the native
    form is tested against, and the path for what it does not take)."""
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
        b = _buffers(out_t, 1, d, inter)
        x_t, g_t, u_t, act_t, y_t = b.x, b.gate, b.up, b.act, b.y
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
        b = _buffers(out_t, len(slots), d, inter)
        x_t, g_t, u_t, act_t, y_t = b.x, b.gate, b.up, b.act, b.y
        x = x_t.host_array()  # (M, D)
        x[...] = h[tokens]
        gate_mm((g_t,), (x_t, gates[e], None), {})  # (M, I)
        up_mm((u_t,), (x_t, ups[e], None), {})  # (M, I)
        swiglu((act_t,), (g_t, u_t), {})  # (M, I) silu(gate) * up
        down_mm((y_t,), (act_t, downs[e], None), {})  # (M, D)
        total[tokens] += y_t.host_array() * weights.reshape(-1)[slots, None]
    out[...] = total  # rounded once, to the output type


moe_mlp.native_call = native_moe_mlp  # type: ignore[attr-defined]
register_kernel("moe_mlp", "cpu", dtypes=FLOATS, weight_dtypes=(*FLOATS, *QUANTIZED_TYPES), kernel=moe_mlp)
