"""argmax and embedding on NVIDIA GPUs, in Triton. An embedding table in a block format is
dequantized once (``quant.dequantized``) and gathered like a float one."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

from ...runtime.dtypes import QUANTIZED_TYPES
from ..registry import register_kernel
from ._common import FLOATS, checks_enabled, launch, next_pow2, rows, tv
from .quant import dequantized

if TYPE_CHECKING:
    from ...tensor import Tensor

ARGMAX_BLOCK = 1024
EMBED_BLOCK = 1024


@triton.jit
def _argmax(idx_out, val_out, vals, n, v_s, BLOCK: tl.constexpr):
    """Row r: the first index of the maximum of vals[r, :n] and that value."""
    row = tl.program_id(0).to(tl.int64)
    best = tl.load(vals + row * v_s).to(tl.float32)
    best_i = tl.zeros([], tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(vals + row * v_s + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
        m, i = tl.max(v, 0, return_indices=True, return_indices_tie_break_left=True)
        better = m > best
        best_i = tl.where(better, start + i.to(tl.int64), best_i)
        best = tl.where(better, m, best)
    tl.store(idx_out + row, best_i)
    tl.store(val_out + row, tl.load(vals + row * v_s + best_i))


@register_kernel("argmax", "nvidia", dtypes=FLOATS)
def argmax(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """outputs (max_idx I64, max_val) = index and value of the maximum over the last dim of vals (..., n)."""
    vals = inputs[0]
    n = vals.shape[-1]
    v2 = rows(tv(vals), n)  # (M, n)
    idx, val = tv(outputs[0]).reshape(-1), tv(outputs[1]).reshape(-1)  # (M,): dense, as the op makes them
    launch(_argmax, (v2.shape[0],), (idx, val, v2, n, v2.stride(0)), {"BLOCK": min(ARGMAX_BLOCK, next_pow2(n))})
    if not outputs[0].is_contiguous() or not outputs[1].is_contiguous():
        tv(outputs[0]).copy_(idx.view(tv(outputs[0]).shape))
        tv(outputs[1]).copy_(val.view(tv(outputs[1]).shape))


@triton.jit
def _embedding(out, index, w, V, D, o_s, w_s, BLOCK: tl.constexpr):
    """out[s, cols] = w[index[s], cols] (an index outside [0, V) reads nothing: zeros)."""
    s = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    i = tl.load(index + s) + tl.zeros([BLOCK], tl.int64)  # as a vector: masks are built of vectors
    ok = (cols < D) & (i >= 0) & (i < V)
    row = tl.load(w + i * w_s + cols, mask=ok, other=0.0)
    tl.store(out + s * o_s + cols, row.to(out.dtype.element_ty), mask=cols < D)


def check_index(op: str, index_t: "Tensor", rows_: int) -> None:
    """ValueError, as the CPU kernel words it, for an index outside [0, rows_) (index values
    are read on the host: only when ``checks_enabled``)."""
    if not checks_enabled(index_t):
        return
    index = index_t.numpy()
    bad = index[(index < 0) | (index >= rows_)]
    if bad.size:
        raise ValueError(f"{op}: index {int(bad[0])} is out of range for a table of {rows_} rows")


def embedding(outputs: tuple["Tensor", ...], inputs: tuple["Tensor | None", ...], attrs: dict[str, Any]) -> None:
    """out (S, D) = weight (V, D) rows at index (S,) I64 (a block-format weight dequantized
    once); ValueError for an index outside [0, V) when checks are on."""
    out_t, index_t, w_t = outputs[0], inputs[0], inputs[1]
    v, d = w_t.shape
    check_index("embedding", index_t, v)
    out, index = tv(out_t), tv(index_t)
    w = dequantized(w_t, out_t.dtype) if w_t.dtype.is_quantized else tv(w_t)
    if w.stride(1) != 1:
        w = w.contiguous()
    block = min(EMBED_BLOCK, next_pow2(d))

    def run(out2) -> None:
        launch(_embedding, (out2.shape[0], triton.cdiv(d, block)), (out2, index, w, v, d, out2.stride(0), w.stride(0)),
               {"BLOCK": block})

    if out.stride(1) == 1:
        run(out)
    else:
        tmp = out.new_empty(out.shape)
        run(tmp)
        out.copy_(tmp)


register_kernel("embedding", "nvidia", dtypes=FLOATS, kernel=embedding)
register_kernel("embedding", "nvidia", dtypes=FLOATS, weight_dtypes=QUANTIZED_TYPES, kernel=embedding)
