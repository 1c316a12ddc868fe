"""rms_norm, add_rms_norm, rope, swiglu, geglu, scale and self_attention (causal, or full: every
query sees every key, as in a vision encoder) for F32 on the CPU through the native library
``csrc/ops`` (``llaisys._native._ops``), registered over the NumPy kernels; and ``add``, which
runs as NumPy's when called but offers a native call to a replayed plan for dense F32 tensors
(the same IEEE sums), so a plugin device's fallback of ``add`` stays in the stretch.

The NumPy kernels (``norm_rope``, ``elementwise``, ``attention``) stay the readable reference
and run instead where the library was not built, for F16/BF16, and for layouts the native code
does not take: a tensor whose last dimension is strided, rows that do not share one stride, or
an output that overlaps an input other than by being the very same view. Each row of a result
is computed the same way whatever the number of rows (batch invariance; see ``csrc/ops/ops.h``);
rope uses the NumPy kernel's own cos/sin tables, so it gives the same bits.

A decoding step makes about five of these calls per layer, each on a few kilobytes, so the
Python around a call is most of its cost: the ctypes argument block of a call is built once
and kept with the output tensor (``Tensor.derived``, a ``KeptBlock``),
reused while the same tensors come back (as a replayed ``ops.Plan`` passes them); what changes
from call to call at one output (the norm weight, the rope positions' table, a layer's K/V
rows) is passed beside it. The blocks are the mirrors of ``llaisys._native.structs``.
``LLAISYS_NATIVE_OPS=0`` leaves the NumPy kernels registered.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ... import _native
from ..._native import structs
from ...runtime.dtypes import DataType
from ..registry import register_kernel
from . import attention, elementwise, native_calls, norm_rope

if TYPE_CHECKING:
    from ...tensor import Tensor


SIMD_LEVELS = ("scalar", "avx2", "avx512")

_lib: "_native.Library | bool | None" = None  # None until first use; False when not built


def _library() -> "_native.Library | bool":
    """The native library (signatures declared by ``_native``), or False when it is not built."""
    global _lib
    if _lib is None:  # loading twice in a race is harmless
        lib = _native.optional("ops", "the native ops (llaisys._native._ops) are not built: rms_norm, rope, "
                               "swiglu and self_attention run on the slower NumPy kernels; reinstall llaisys with a "
                               "C compiler")
        if lib:
            _share_pool(lib)
        _lib = lib or False
    return _lib


def _share_pool(lib: _native.Library) -> None:
    """Lend ``lib`` the thread pool of the quantized kernels' library (``csrc/kernels``), so
    attention runs on the same workers as linear; without that library it runs on the
    calling thread."""
    kernels = _native.load("kernels")
    if kernels is None:
        return
    lib.llaisys_ops_use_pool(_native.address(kernels, "llaisys_quant_pool_run"),
                             _native.address(kernels, "llaisys_quant_threads"))


def available() -> bool:
    """Whether the native library is built."""
    return bool(_library())


def simd_level() -> str:
    """The SIMD level in use ("scalar", "avx2" or "avx512"); every level gives the same bits."""
    return _library().llaisys_ops_simd_level().decode()


def simd_levels() -> list[str]:
    """The SIMD levels this CPU runs."""
    mask = _library().llaisys_ops_simd_available()
    return [name for i, name in enumerate(SIMD_LEVELS) if mask >> i & 1]


def set_simd_level(name: str) -> None:
    """Use SIMD level ``name`` from now on (tests, benchmarks); ValueError when this CPU lacks it."""
    if _library().llaisys_ops_set_simd_level(name.encode()) != 0:
        raise ValueError(f"SIMD level {name!r} does not run on this CPU; it runs {', '.join(simd_levels())}")


def _failed(op: str, status: int) -> None:
    """A nonzero status: the arguments were checked here and by the op, so a bug, not bad input."""
    raise RuntimeError(f"llaisys_ops_{op} failed with status {status}")


# ---- layouts ----------------------------------------------------------------------------------
def _rows(t: Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of ``t`` seen as rows of its last dimension, or None when its last
    dimension is strided or its leading dimensions do not fold into one stride."""
    shape, strides = t.shape, t.strides
    if shape[-1] != 1 and strides[-1] != 1:
        return None
    rows, stride = 1, shape[-1]
    for n, s in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if n == 1:
            continue
        if rows == 1:
            stride = s
        elif s != stride * rows:
            return None
        rows *= n
    return rows, stride


def _heads(t: Tensor) -> tuple[int, int] | None:
    """The two leading strides of a 3-D ``t`` whose last dimension is contiguous, else None."""
    if t.shape[2] != 1 and t.strides[2] != 1:
        return None
    return t.strides[0], t.strides[1]


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes [start, end) of storage that ``t``'s elements occupy."""
    lo = hi = t.offset
    for n, s in zip(t.shape, t.strides):
        if n > 1:
            step = (n - 1) * s * t.dtype.itemsize
            lo, hi = (lo + step, hi) if step < 0 else (lo, hi + step)
    return lo, hi + t.dtype.itemsize


def _same_view(a: Tensor, b: Tensor) -> bool:
    return (a.storage is b.storage and a.offset == b.offset and a.shape == b.shape and a.strides == b.strides)


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` share bytes of one storage."""
    if a.storage is not b.storage:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _writes_safely(outputs: tuple, others: tuple, same_view_ok: bool = True) -> bool:
    """Whether each output overlaps no other tensor, or (``same_view_ok``: kernels that read an
    element before writing it) only as the very same view."""
    for i, o in enumerate(outputs):
        for t in outputs[i + 1:] + others:
            if t is not None and _overlap(o, t) and not (same_view_ok and _same_view(o, t)):
                return False
    return True


# ---- what a call keeps with its output tensor (``Tensor.derived``) ------------------------------
@dataclass(slots=True)
class KeptBlock:
    """An argument block kept with its output tensor until a call with other inputs replaces it:
    ``key``, the tensors (compared by identity: Tensor has no ``__eq__``) and attributes it was
    made for; ``args``, the block (None: the NumPy kernel runs for them); ``address``, its address."""

    key: tuple = ()
    args: Any = None
    address: int | None = None

    @staticmethod
    def fresh(_: Tensor) -> "KeptBlock":
        return KeptBlock()

    def keep(self, key: tuple, args: Any) -> None:
        """Hold ``args``, the block made for ``key`` (callers compare ``key`` first), and its address."""
        self.key, self.args = key, args
        self.address = None if args is None else ctypes.addressof(args)


@dataclass(slots=True)
class _RopeCallEntry:
    """The native call that every layer's rope of a pass shares (same buffers, same positions)."""

    x: "Tensor | None" = None
    pos: "Tensor | None" = None
    freqs: "Tensor | None" = None
    scalar: float | None = None  # theta, or the attention factor with freqs
    call: "native_calls.NativeCall | None" = None

    @staticmethod
    def fresh(_: Tensor) -> "_RopeCallEntry":
        return _RopeCallEntry()


@dataclass(slots=True)
class _RopeKept:
    """What a rope call's block points into: its arguments and the cos/sin table in use."""

    args: "structs.RopeArgs"
    table: "_RopeTable | None"
    freqs: "Tensor | None"


def _ptr(t: Tensor) -> int:
    return t.storage.ptr + t.offset


# ---- rms_norm, add_rms_norm ---------------------------------------------------------------------
def _norm_args(out: Tensor, total: Tensor | None, a: Tensor, b: Tensor | None,
               eps: float) -> structs.NormArgs | None:
    outputs, inputs = ((out,), (a,)) if total is None else ((out, total), (a, b))
    geometry = [_rows(t) for t in outputs + inputs]
    if None in geometry or not _writes_safely(outputs, inputs) or not _library():
        return None
    (rows, out_s), a_s = geometry[0], geometry[len(outputs)][1]
    args = structs.NormArgs(out=_ptr(out), out_s=out_s, a=_ptr(a), a_s=a_s, rows=rows, d=out.shape[-1], eps=eps)
    if total is not None:
        args.total, args.total_s = _ptr(total), geometry[1][1]
        args.b, args.b_s = _ptr(b), geometry[3][1]
    return args


def _weight_ok(w: Tensor, outputs: tuple) -> bool:
    """Whether the native kernel may read the norm weight ``w``: contiguous, overlapping no
    output (checked in full only when the cheap test in the kernels is not conclusive)."""
    return (w.strides[0] == 1 or w.shape[0] == 1) and not any(_overlap(w, o) for o in outputs)


def _norm_kernel(op: str) -> Callable[..., None]:
    """The F32 kernel ``op``, rms_norm (outputs (out,), inputs (x, w)) or add_rms_norm (outputs
    (out, total), inputs (a, b, w)): ``llaisys_ops_rms_norm`` on the block kept with the output
    where it applies, else the NumPy kernel ``norm_rope.<op>``; its ``native_call`` gives the
    block in a NormCall for a replayed plan."""
    entry, add = "native_ops." + op, op == "add_rms_norm"

    def kernel(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
        eps = attrs["eps"]
        if add:
            (out, total), (a, b, w) = outputs, inputs
            key = (total, a, b, eps)
        else:
            (out,), (a, w) = outputs, inputs
            total = b = None
            key = (a, eps)
        e = out.derived(entry, KeptBlock.fresh)
        if e.key != key:
            e.keep(key, _norm_args(out, total, a, b, eps))
        if e.address is None or ((w.storage is out.storage or (add and w.storage is total.storage) or w.strides[0] != 1)
                                 and not _weight_ok(w, outputs)):
            getattr(norm_rope, op)(outputs, inputs, attrs)
            return
        status = _lib.llaisys_ops_rms_norm(e.address, w.storage.ptr + w.offset)
        if status:
            _failed("rms_norm", status)

    def native_call(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                    attrs: dict[str, Any]) -> native_calls.NativeCall | None:
        w = inputs[-1]
        args = _norm_args(outputs[0], outputs[1] if add else None, inputs[0], inputs[1] if add else None, attrs["eps"])
        if args is None or not native_calls.available() or not _weight_ok(w, outputs):
            return None
        return _call_of(op, "llaisys_ops_rms_norm_call", structs.NormCall(ctypes.addressof(args), _ptr(w)), (args, w))

    kernel.__name__ = kernel.__qualname__ = op
    kernel.__doc__ = f"The F32 ``{op}`` kernel: native where it applies, else ``norm_rope.{op}``."
    native_call.__doc__ = f"``{op}`` as an argument block (None where the NumPy kernel would run)."
    kernel.native_call = native_call  # type: ignore[attr-defined]
    return kernel


rms_norm = _norm_kernel("rms_norm")
add_rms_norm = _norm_kernel("add_rms_norm")


# ---- swiglu -------------------------------------------------------------------------------------
def _swiglu_args(out: Tensor, gate: Tensor, up: Tensor) -> structs.SwigluArgs | None:
    geometry = [_rows(t) for t in (out, gate, up)]
    if None in geometry or not _writes_safely((out,), (gate, up)) or not _library():
        return None
    (rows, out_s), (_, gate_s), (_, up_s) = geometry
    return structs.SwigluArgs(_ptr(out), out_s, _ptr(gate), gate_s, _ptr(up), up_s, rows, out.shape[-1])


def _block_kernel(op: str, make: Callable[..., Any], block: type, attr: str | None = None) -> Callable[..., None]:
    """The F32 kernel ``op`` (swiglu, geglu, scale) of one argument block: ``llaisys_ops_<op>``
    on the block ``make(out, *inputs)`` (with ``attr``, a kernel of one input: ``make(out, x,
    attrs[attr])``) kept with the output, else the NumPy kernel ``elementwise.<op>``; its
    ``native_call`` gives the same block in a ``block`` (the ``*Call`` mirror) for a replayed plan."""
    entry, function = "native_ops." + op, "llaisys_ops_" + op
    run = None  # the C function, looked up when the first block runs (the library is loaded then)

    def kernel(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
        nonlocal run
        key = inputs if attr is None else (inputs[0], attrs[attr])
        e = outputs[0].derived(entry, KeptBlock.fresh)
        if e.key != key:
            e.keep(key, make(outputs[0], *key))
        if e.address is None:
            getattr(elementwise, op)(outputs, inputs, attrs)
            return
        if run is None:
            run = getattr(_lib, function)
        status = run(e.address)
        if status:
            _failed(op, status)

    def native_call(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                    attrs: dict[str, Any]) -> native_calls.NativeCall | None:
        args = make(outputs[0], *(inputs if attr is None else (inputs[0], attrs[attr])))
        if args is None or not native_calls.available():
            return None
        return _call_of(op, function + "_call", block(ctypes.addressof(args)), args)

    kernel.__name__ = kernel.__qualname__ = op
    kernel.__doc__ = f"The F32 ``{op}`` kernel: native where it applies, else ``elementwise.{op}``."
    native_call.__doc__ = f"``{op}`` as an argument block (None where the NumPy kernel would run)."
    kernel.native_call = native_call  # type: ignore[attr-defined]
    return kernel


swiglu = _block_kernel("swiglu", _swiglu_args, structs.SwigluCall)


# ---- rope ---------------------------------------------------------------------------------------
_TABLES_KEPT = 16


@dataclass(slots=True)
class _RopeTable:
    """The NumPy kernel's cos and sin (S, 1, R/2) float32 of a set of positions, and their addresses."""

    cos: Any
    sin: Any
    cos_address: int
    sin_address: int


# (positions, D, theta) or (positions, freqs, attention factor) -> its table
_tables: dict[tuple, _RopeTable] = {}


def _table(key: tuple) -> _RopeTable:
    """The NumPy kernel's cos and sin (S, 1, R/2) for ``key`` (3 values: ``_cos_sin``'s
    arguments; with bytes second: ``_cos_sin_freqs``'s), with their addresses; every layer of
    a pass rotates at the same positions, so the last few sets are kept."""
    make = norm_rope._cos_sin_freqs if isinstance(key[1], bytes) else norm_rope._cos_sin
    cos, sin = make(*key)  # C-contiguous float32
    table = _RopeTable(cos, sin, cos.ctypes.data, sin.ctypes.data)
    if len(_tables) >= _TABLES_KEPT:
        _tables.clear()
    _tables[key] = table
    return table


def _rope_args(out: Tensor, x: Tensor, r: int) -> structs.RopeArgs | None:
    heads = (_heads(out), _heads(x))
    if None in heads or not _writes_safely((out,), (x,)) or not _library():
        return None
    s, h, d = x.shape
    return structs.RopeArgs(_ptr(out), *heads[0], _ptr(x), *heads[1], s, h, d, r)


class _PositionTable:
    """cos and sin (P, 1, R/2) float32 of positions 0 .. P-1 for one rotation (D and theta, or
    inverse frequencies and the attention factor), computed as the NumPy kernel computes any
    set of positions and grown (doubled) when a pass reaches past it: a pass at consecutive
    positions (a decoding step, a prompt's chunk) reads its rows in place."""

    __slots__ = ("rotation", "cos", "sin", "row_bytes", "cos_address", "sin_address")

    def __init__(self, rotation: tuple) -> None:
        self.rotation = rotation
        self.cos = self.sin = None
        self.row_bytes = self.cos_address = self.sin_address = 0

    def rows(self, start: int, count: int) -> _RopeTable:
        """The rows of positions ``start`` .. ``start + count - 1``."""
        end = start + count
        if self.cos is None or end > self.cos.shape[0]:
            size = max(end, 2 * (0 if self.cos is None else self.cos.shape[0]), 256)
            make = norm_rope._cos_sin_freqs if isinstance(self.rotation[0], bytes) else norm_rope._cos_sin
            self.cos, self.sin = make.__wrapped__(np.arange(size, dtype=np.int64).tobytes(), *self.rotation)
            self.row_bytes, self.cos_address, self.sin_address = self.cos.strides[0], self.cos.ctypes.data, \
                self.sin.ctypes.data
        at = start * self.row_bytes
        return _RopeTable(self.cos, self.sin, self.cos_address + at, self.sin_address + at)


_position_tables: dict[tuple, _PositionTable] = {}  # rotation -> its table
# Positions past this go by their own tables (a table of every position up to them would be
# large; and a staging buffer read before its first copy may hold any value).
TABLE_POSITIONS = 1 << 17


def _rope_table(x: Tensor, pos: Tensor, freqs: "Tensor | None", attrs: dict[str, Any]) -> _RopeTable:
    """The cos and sin a call rotates with: rows of its rotation's ``_PositionTable`` when its
    positions are consecutive, else the table of its own positions (``_tables``)."""
    p = pos.host_array()  # (S,)
    rotation = (x.shape[2], attrs["theta"]) if freqs is None else (freqs.host_array().tobytes(),
                                                                   attrs["attention_factor"])
    first, last = (int(p[0]), int(p[-1])) if p.size else (-1, -1)
    if 0 <= first and last < TABLE_POSITIONS and (p.size == 1 or last - first == p.size - 1
                                                  and bool((np.diff(p) == 1).all())):
        table = _position_tables.get(rotation)
        if table is None:
            table = _position_tables[rotation] = _PositionTable(rotation)
        return table.rows(first, p.size)
    key = (p.tobytes(), *rotation)
    return _tables.get(key) or _table(key)


def rope(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """The F32 ``rope`` and ``rope_freqs`` kernel: native where it applies, else ``norm_rope``'s."""
    out = outputs[0]
    x, pos = inputs[:2]
    freqs = inputs[2] if len(inputs) > 2 else None
    r = x.shape[2] if freqs is None else 2 * freqs.shape[0]
    e = out.derived("native_ops.rope", KeptBlock.fresh)
    if e.key != (x, r):
        e.keep((x, r), _rope_args(out, x, r))
    if e.address is None:
        (norm_rope.rope if freqs is None else norm_rope.rope_freqs)(outputs, inputs, attrs)
        return
    table = _rope_table(x, pos, freqs, attrs)
    status = _lib.llaisys_ops_rope(e.address, table.cos_address, table.sin_address)
    if status:
        _failed("rope", status)


# ---- self_attention -----------------------------------------------------------------------------
def _attention_args(out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float) -> structs.AttentionArgs | None:
    heads = [_heads(t) for t in (out, q, k, v)]
    if None in heads or not _writes_safely((out,), (q,)) or not _library():
        return None
    s, h, d = q.shape
    return structs.AttentionArgs(_ptr(out), *heads[0], _ptr(q), *heads[1], *heads[2], *heads[3],
                                 s, h, d, k.shape[1], v.shape[2], scale)


def _attention_kernel(op: str) -> Callable[..., None]:
    """The F32 kernel ``op``: ``self_attention`` (causal) or ``self_attention_full`` (every query
    sees every key), ``llaisys_ops_<op>`` where it applies (and the library has it: one built
    before full attention lacks that), else the NumPy kernel ``attention.<op>``; its
    ``native_call`` gives the block in an AttentionCall for a replayed plan.

    The cached arguments hold q and out; k and v (a layer's cache rows, new views each step)
    are passed per call, checked against the cached strides and head count."""
    entry, function = "native_ops." + op, "llaisys_ops_" + op

    def kernel(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
        out = outputs[0]
        q, k, v = inputs
        scale = attrs["scale"]
        key = (q, scale, k.strides, v.strides, k.shape[1])
        e = out.derived(entry, KeptBlock.fresh)
        if e.key != key:
            e.keep(key, _attention_args(out, q, k, v, scale) if hasattr(_library(), function) else None)
        if e.address is None or ((k.storage is out.storage or v.storage is out.storage) and not
                                 _writes_safely((out,), (k, v), same_view_ok=False)):
            getattr(attention, op)(outputs, inputs, attrs)
            return
        status = getattr(_lib, function)(e.address, k.storage.ptr + k.offset, v.storage.ptr + v.offset, k.shape[0])
        if status:
            _failed(op, status)

    def native_call(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                    attrs: dict[str, Any]) -> native_calls.NativeCall | None:
        (out,), (q, k, v) = outputs, inputs
        if k.storage is out.storage or v.storage is out.storage or not native_calls.available():
            return None
        args = _attention_args(out, q, k, v, attrs["scale"])
        if args is None or not hasattr(_lib, function + "_call"):
            return None
        block = structs.AttentionCall(ctypes.addressof(args), _ptr(k), _ptr(v), k.shape[0])
        layout = (q, k.strides, v.strides, k.shape[1:], v.shape[1:])

        def rebind(outputs: tuple, inputs: tuple) -> bool:
            q2, k2, v2 = inputs
            if outputs[0] is not out or (q2, k2.strides, v2.strides, k2.shape[1:], v2.shape[1:]) != layout:
                return False
            if k2.storage is out.storage or v2.storage is out.storage:
                return False
            block.k, block.v, block.t = _ptr(k2), _ptr(v2), k2.shape[0]
            return True

        return _call_of(op, function + "_call", block, (args, k, v), rebind=rebind)

    kernel.__name__ = kernel.__qualname__ = op
    kernel.__doc__ = f"The F32 ``{op}`` kernel: native where it applies, else ``attention.{op}``."
    native_call.__doc__ = (f"``{op}`` as an argument block; rebinding it to other K/V rows of the same layout (a "
                           "cache one position on) only moves its pointers and key count.")
    kernel.native_call = native_call  # type: ignore[attr-defined]
    return kernel


self_attention = _attention_kernel("self_attention")
self_attention_full = _attention_kernel("self_attention_full")


# ---- the same calls as argument blocks, for a replayed plan (``native_calls``) ------------------
def _call_of(name: str, function: str, block: ctypes.Structure, keep: Any, **hooks: Any) -> native_calls.NativeCall:
    """A NativeCall of ``function`` of the ops library on argument block ``block``."""
    return native_calls.NativeCall(name, native_calls.address(_lib, function), block, keep=keep, **hooks)


def native_rope(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                attrs: dict[str, Any]) -> native_calls.NativeCall | None:
    """``rope`` (or ``rope_freqs``) as an argument block whose cos/sin tables are those of the
    positions ``pos`` holds at each replay (set by its refresh, before the replay's first kernel
    runs). Every layer of a pass rotates the same buffers at the same positions, so its calls
    share one block, kept with the output tensor, and one refresh."""
    (out,), (x, pos) = outputs, inputs[:2]
    freqs = inputs[2] if len(inputs) > 2 else None
    scalar = attrs["theta"] if freqs is None else attrs["attention_factor"]
    shared = out.derived("native_ops.rope_call", _RopeCallEntry.fresh)
    if (shared.call is not None and shared.x is x and shared.pos is pos and shared.freqs is freqs
            and shared.scalar == scalar):
        return shared.call
    args = _rope_args(out, x, x.shape[2] if freqs is None else 2 * freqs.shape[0])
    if args is None or not native_calls.available():
        return None
    block = structs.RopeCall(ctypes.addressof(args))
    kept = _RopeKept(args, None, freqs)

    def refresh() -> None:
        kept.table = table = _rope_table(x, pos, freqs, attrs)
        block.cos, block.sin = table.cos_address, table.sin_address

    refresh()
    call = _call_of("rope", "llaisys_ops_rope_call", block, kept, refresh=refresh)
    shared.x, shared.pos, shared.freqs, shared.scalar, shared.call = x, pos, freqs, scalar, call
    return call


def add(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """The F32 ``add`` kernel: ``elementwise.add`` (a replayed plan may run ``native_add``)."""
    elementwise.add(outputs, inputs, attrs)


def native_add(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
               attrs: dict[str, Any]) -> native_calls.NativeCall | None:
    """``add`` of three dense F32 tensors of one shape as an argument block (None otherwise, or
    when the output overlaps an input other than as the very same view)."""
    (out,), (a, b) = outputs, inputs
    if not (_library() and native_calls.available() and hasattr(_lib, "llaisys_ops_add_call")):
        return None
    if not all(t.is_contiguous() and t.shape == out.shape for t in (out, a, b)) or not _writes_safely((out,), (a, b)):
        return None
    block = structs.AddCall(_ptr(out), _ptr(a), _ptr(b), out.numel())
    return _call_of("add", "llaisys_ops_add_call", block, (out, a, b))


add.native_call = native_add  # type: ignore[attr-defined]
rope.native_call = native_rope  # type: ignore[attr-defined]

KERNELS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rope": rope, "rope_freqs": rope, "swiglu": swiglu,
           "self_attention": self_attention, "self_attention_full": self_attention_full, "add": add}
NUMPY_KERNELS = {"rms_norm": norm_rope.rms_norm, "add_rms_norm": norm_rope.add_rms_norm, "rope": norm_rope.rope,
                 "rope_freqs": norm_rope.rope_freqs, "swiglu": elementwise.swiglu,
                 "self_attention": attention.self_attention, "self_attention_full": attention.self_attention_full,
                 "add": elementwise.add}


def register(native: bool = True) -> None:
    """Register the native kernels (or, ``native=False``, the NumPy ones again) for F32 on the CPU.
    A plan recorded before keeps the kernels it recorded."""
    for name in KERNELS:
        kernel = KERNELS[name] if native else NUMPY_KERNELS[name]
        register_kernel(name, "cpu", dtypes=(DataType.F32,), kernel=kernel, replace=True)


if os.environ.get("LLAISYS_NATIVE_OPS", "1").lower() not in ("0", "false", "no", "off"):
    register()


# ---- geglu, scale (csrc/ops/geglu_scale.c) ------------------------------------------------------
_geglu_scale_ready: bool | None = None  # None until first use


def _has_geglu_scale() -> bool:
    """Whether the native library is built with geglu and scale (a library built before them lacks them)."""
    global _geglu_scale_ready
    if _geglu_scale_ready is None:
        lib = _library()
        _geglu_scale_ready = bool(lib) and all(hasattr(lib, f) for f in ("llaisys_ops_geglu", "llaisys_ops_scale"))
    return _geglu_scale_ready


def _geglu_args(out: Tensor, gate: Tensor, up: Tensor) -> structs.SwigluArgs | None:
    if out.ndim == 0 or not _has_geglu_scale():
        return None
    return _swiglu_args(out, gate, up)


def _scale_args(out: Tensor, x: Tensor, factor: float) -> structs.ScaleArgs | None:
    if out.ndim == 0 or not _has_geglu_scale():
        return None
    geometry = [_rows(t) for t in (out, x)]
    if None in geometry or not _writes_safely((out,), (x,)):
        return None
    (rows, out_s), (_, x_s) = geometry
    return structs.ScaleArgs(_ptr(out), out_s, _ptr(x), x_s, rows, out.shape[-1], factor)


geglu = _block_kernel("geglu", _geglu_args, structs.GegluCall)
scale = _block_kernel("scale", _scale_args, structs.ScaleCall, "factor")
KERNELS.update(geglu=geglu, scale=scale)
NUMPY_KERNELS.update(geglu=elementwise.geglu, scale=elementwise.scale)
if os.environ.get("LLAISYS_NATIVE_OPS", "1").lower() not in ("0", "false", "no", "off"):
    for _name in ("geglu", "scale"):  # register() above ran before these two were defined
        register_kernel(_name, "cpu", dtypes=(DataType.F32,), kernel=KERNELS[_name], replace=True)
