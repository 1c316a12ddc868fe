"""The paged KV cache through the native kernels (``csrc/kernels/paged_attention.c``), with
the NumPy kernels of ``paged`` where they do not apply.

``kv_cache_write`` (any float type) copies rows with memcpy; ``paged_attention`` (F32) splits
the work over tasks of (a few query tokens of one sequence, KV head), and for few tasks
(decoding) over fixed segments of the keys too, on the library's thread pool, and is batch
invariant: a row's result is computed by the same float32 operations whatever else is in the
call, whatever the thread count, and at every SIMD level (``set_simd``). Where the library
was not built, or a float tensor's last dimension is strided, the NumPy kernels run instead
(same results to float32 rounding, not bit for bit).

Over an 8-bit pool (``kv_cache_write_q8``, ``paged_attention_q8`` and its forms, F32 rows) the
same C functions take the scales too (their inputs last, or the write's last two outputs): the
write quantizes each head of each token into its slot, attention reads the int8 codes and
widens them in registers (never a dequantized copy of the cache), with the same tasks, so the
same batch invariance and the same bits at every SIMD level and thread count.

A decoding step calls these twice per layer, so the ctypes argument block of a call (a mirror
of ``llaisys._native.structs``) is built once and kept with the output tensor
(``Tensor.derived``, a ``native_ops.KeptBlock``), reused while the same tensors
come back: a direct call then costs a couple of microseconds on top of the C code. The entry
holds its tensors (so the block's pointers stay valid) until a call with other tensors
replaces it.

A replayed ``ops.Plan`` does not call them from Python at all: both kernels have a
``native_call`` (their own argument block, run by ``llaisys_paged_attention_call`` and
``llaisys_paged_kv_write_call`` inside the stretch of the layer around them), so a serving
step's batched pass crosses into C once. The block points at the pass's index tensors, which
the pass reloads in place before each replay; the C function checks them at every run, and a
bad index raises the same ValueError as a direct call.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ... import _native
from ..._native import structs
from ...runtime.dtypes import DataType
from ..registry import register_kernel
from . import native_calls, paged
from ._common import FLOATS
from .native_ops import KeptBlock

if TYPE_CHECKING:
    from ...tensor import Tensor


_lib: "_native.Library | bool | None" = None  # None until first use; False when not built


def _library() -> "_native.Library | bool":
    """The native library (signatures declared by ``_native``), or False when it is not built."""
    global _lib
    if _lib is None:  # loading twice in a race is harmless
        _lib = _native.optional("kernels", "the native kernels (llaisys._native._kernels) are not built: paged "
                                "attention runs on the slower NumPy path; reinstall llaisys with a C compiler on "
                                "PATH") or False
    return _lib


def available() -> bool:
    """Whether the native library is built."""
    return bool(_library())


SIMD_LEVELS = ("scalar", "avx2", "avx512")  # as LLAISYS_SIMD names them


def set_simd(level: int) -> int:
    """Run attention on SIMD level ``level`` (an index of ``SIMD_LEVELS``: 0 is the portable
    C), or the best one below it that this CPU has; -1 only asks. Returns the level in use.
    Every level gives the same bits (for tests and benchmarks); the default is the best one,
    unless the environment variable LLAISYS_SIMD names another."""
    return _library().llaisys_paged_simd(level)


def _row_dense(*tensors: Tensor) -> bool:
    """Whether each tensor's last dimension is contiguous (what the native kernels need)."""
    return all(t.strides[-1] == 1 or t.shape[-1] == 1 for t in tensors)


def _make_attention_args(out: Tensor, inputs: tuple, scale: float, window: int = 0,
                         q8: bool = False) -> structs.PagedAttentionArgs | None:
    """The block of a call; ``q8``: the last two inputs are an 8-bit pool's k_scale, v_scale."""
    base = inputs[:-2] if q8 else inputs
    q, kc, vc, bt, qs, cl = base[:6]
    if out.dtype is not DataType.F32 or not _row_dense(out, q, kc, vc) or not _library():
        return None
    n, h, d = q.shape
    nb, bs, kh, dv = vc.shape
    args = structs.PagedAttentionArgs(
        out.data_ptr, out.strides[0], out.strides[1], q.data_ptr, q.strides[0], q.strides[1],
        kc.data_ptr, *kc.strides[:3], vc.data_ptr, *vc.strides[:3], bt.data_ptr, *bt.strides,
        qs.data_ptr, qs.strides[0], cl.data_ptr, cl.strides[0],
        n, h, kh, d, dv, nb, bs, bt.shape[0], bt.shape[1], scale)
    args.window = window
    if len(base) > 6:  # the _ends kernels: each row's key end
        args.key_ends, args.ke_s0 = base[6].data_ptr, base[6].strides[0]
    if q8:
        ks, vs = inputs[-2:]  # (NB, BS, KH) each
        args.k_scale, (args.ks_s0, args.ks_s1, args.ks_s2) = ks.data_ptr, ks.strides
        args.v_scale, (args.vs_s0, args.vs_s1, args.vs_s2) = vs.data_ptr, vs.strides
    return args


@dataclass(slots=True)
class _Kept:
    """What a recorded call's block points into: the block and its tensors (rebinds replace them)."""

    args: Any
    outputs: tuple
    inputs: tuple


def _attention_args(out: Tensor, inputs: tuple, scale: float, window: int = 0, q8: bool = False) -> KeptBlock:
    """The entry of this call, kept with ``out`` while the same tensors come back; its args None
    when the native kernel does not apply."""
    entry, key = out.derived("paged_attention", KeptBlock.fresh), (inputs, scale, window, q8)
    if entry.key != key:
        entry.keep(key, _make_attention_args(out, inputs, scale, window, q8))
    return entry


def _run_attention(entry: KeptBlock, inputs: tuple) -> None:
    """The native kernel on ``entry``'s block; RuntimeError where there is none."""
    if entry.args is None:
        raise RuntimeError("the native paged_attention needs the native library, F32 tensors and contiguous last "
                           "dimensions")
    status = _lib.llaisys_paged_attention(entry.address)
    if status:
        bad = entry.args.bad
        raise paged.sequence_error(status, bad[0], bad[1], inputs)


def paged_attention(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """The F32 ``paged_attention`` kernel and its ``_window``, ``_ends`` and ``_window_ends``
    forms (attrs: scale, and window for the windowed ones; inputs: key_ends (N,) after
    context_lens for the ``_ends`` ones): native where it applies, else ``paged.paged_attention``."""
    entry = _attention_args(outputs[0], inputs, attrs["scale"], int(attrs.get("window", 0)))
    if entry.args is None:
        paged.paged_attention(outputs, inputs, attrs)
    else:
        _run_attention(entry, inputs)


def paged_attention_q8(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                       attrs: dict[str, Any]) -> None:
    """The F32 ``paged_attention_q8`` kernel and its ``_window``, ``_ends`` and ``_window_ends``
    forms (``paged_attention``'s inputs over int8 caches, then k_scale, v_scale): native where
    it applies, else ``paged.paged_attention_q8``."""
    entry = _attention_args(outputs[0], inputs, attrs["scale"], int(attrs.get("window", 0)), True)
    if entry.args is None:
        paged.paged_attention_q8(outputs, inputs, attrs)
    else:
        _run_attention(entry, inputs)


def native_paged_attention(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                           attrs: dict[str, Any], q8: bool = False) -> None:
    """``paged_attention`` (with ``attrs["window"]``, its windowed form; with a seventh input,
    key_ends, its ``_ends`` form; with ``q8``, over int8 caches, k_scale and v_scale the last
    inputs) on the native kernel only (tests, benchmarks); RuntimeError when the library is
    missing, the type is not F32 or a float tensor's last dimension is strided."""
    _run_attention(_attention_args(outputs[0], inputs, attrs["scale"], int(attrs.get("window", 0)), q8), inputs)


def _make_write_args(outputs: tuple, inputs: tuple) -> structs.PagedWriteArgs | None:
    """The block of a write; four outputs: an 8-bit pool (int8 caches, then their scales) fed F32 rows."""
    kc, vc = outputs[:2]
    k, v, slots = inputs
    q8 = len(outputs) == 4
    if not _row_dense(kc, vc, k, v) or not _library() or (q8 and k.dtype is not DataType.F32):
        return None
    nb, bs, kh, d = kc.shape
    args = structs.PagedWriteArgs(kc.data_ptr, *kc.strides[:3], vc.data_ptr, *vc.strides[:3],
                                  k.data_ptr, *k.strides[:2], v.data_ptr, *v.strides[:2],
                                  slots.data_ptr, slots.strides[0],
                                  k.shape[0], kh, d, vc.shape[3], nb, bs, k.dtype.itemsize)
    if q8:
        ks, vs = outputs[2:]  # (NB, BS, KH) each
        args.k_scale, (args.ksc_s0, args.ksc_s1, args.ksc_s2) = ks.data_ptr, ks.strides
        args.v_scale, (args.vsc_s0, args.vsc_s1, args.vsc_s2) = vs.data_ptr, vs.strides
    return args


def _write_args(outputs: tuple, inputs: tuple) -> KeptBlock:
    """The entry of this call, kept with k_cache (as ``_attention_args``)."""
    entry, key = outputs[0].derived("kv_cache_write", KeptBlock.fresh), (outputs[1:], inputs)
    if entry.key != key:
        entry.keep(key, _make_write_args(outputs, inputs))
    return entry


def _run_write(entry: KeptBlock, outputs: tuple) -> None:
    """The native kernel on ``entry``'s block; RuntimeError where there is none."""
    if entry.args is None:
        raise RuntimeError("the native kv_cache_write needs the native library and contiguous last dimensions")
    if _lib.llaisys_paged_kv_write(entry.address):
        bad, (nb, bs) = entry.args.bad, outputs[0].shape[:2]
        raise paged.slot_error(bad[0], bad[1], nb, bs)


def kv_cache_write(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], attrs: dict[str, Any]) -> None:
    """The ``kv_cache_write`` kernel: native where it applies, else ``paged.kv_cache_write``
    (and always under the CPU fallback, which passes the caches' contents as inputs too)."""
    if len(inputs) > 3:
        paged.kv_cache_write(outputs, inputs, attrs)
        return
    entry = _write_args(outputs, inputs)
    if entry.args is None:
        paged.kv_cache_write(outputs, inputs, attrs)
    else:
        _run_write(entry, outputs)


def kv_cache_write_q8(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                      attrs: dict[str, Any]) -> None:
    """The F32 ``kv_cache_write_q8`` kernel (outputs k_cache, v_cache I8, k_scale, v_scale F32):
    native where it applies, else ``paged.kv_cache_write_q8`` (and always under the CPU
    fallback, which passes the four stores' contents as inputs too)."""
    entry = None if len(inputs) > 3 else _write_args(outputs, inputs)
    if entry is None or entry.args is None:
        paged.kv_cache_write_q8(outputs, inputs, attrs)
    else:
        _run_write(entry, outputs)


def native_kv_cache_write(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                          attrs: dict[str, Any]) -> None:
    """``kv_cache_write`` (four outputs: ``kv_cache_write_q8``) on the native kernel only (tests,
    benchmarks); RuntimeError when the library is missing or a float tensor's last dimension is
    strided."""
    _run_write(_write_args(outputs, inputs), outputs)


# ---- the same calls as argument blocks, for a replayed plan (``native_calls``) ------------------
def _call_function(function: str) -> "int | None":
    """The address of ``function`` (a stretch call of paged_attention.c), None where the
    library is missing, older than it, or no stretch can run (the ops library is not built)."""
    lib = _library()
    if not lib or not hasattr(lib, function) or not native_calls.available():
        return None
    return native_calls.address(lib, function)


def native_paged_attention_call(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                                attrs: dict[str, Any], q8: bool = False) -> native_calls.NativeCall | None:
    """``paged_attention`` (``q8``: ``paged_attention_q8``) as an argument block run by
    ``llaisys_paged_attention_call``: the same C function as a direct call, the same block
    layout, so the same bits (the same tasks on the library's pool, batch invariant). None where
    the direct call would run NumPy. The index tensors are read at every run (a pass reloads
    them in place); a rebind to other tensors rewrites the block in place."""
    scale, window = attrs["scale"], int(attrs.get("window", 0))
    fn = _call_function("llaisys_paged_attention_call")
    args = None if fn is None else _make_attention_args(outputs[0], inputs, scale, window, q8)
    if args is None:
        return None
    kept = _Kept(args, outputs, inputs)

    def rebind(outputs2: tuple, inputs2: tuple) -> bool:
        new = _make_attention_args(outputs2[0], inputs2, scale, window, q8)
        if new is None:
            return False
        ctypes.pointer(args)[0] = new  # the stretch's table keeps the block's address
        kept.outputs, kept.inputs = outputs2, inputs2
        return True

    def fail(status: int) -> None:
        raise paged.sequence_error(status, args.bad[0], args.bad[1], kept.inputs)

    return native_calls.NativeCall("paged_attention", fn, args, keep=kept, rebind=rebind, fail=fail)


def native_paged_attention_q8_call(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                                   attrs: dict[str, Any]) -> native_calls.NativeCall | None:
    """``paged_attention_q8`` as an argument block (``native_paged_attention_call``)."""
    return native_paged_attention_call(outputs, inputs, attrs, q8=True)


def native_kv_cache_write_call(outputs: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...],
                               attrs: dict[str, Any]) -> native_calls.NativeCall | None:
    """``kv_cache_write`` (four outputs: ``kv_cache_write_q8``) as an argument block run by
    ``llaisys_paged_kv_write_call`` (the direct call's C function and block); None under the
    CPU fallback (the caches come in as inputs too) or where the direct call would run NumPy.
    Slots are read at every run."""
    fn = None if len(inputs) > 3 else _call_function("llaisys_paged_kv_write_call")
    args = None if fn is None else _make_write_args(outputs, inputs)
    if args is None:
        return None
    kept = _Kept(args, outputs, inputs)

    def rebind(outputs2: tuple, inputs2: tuple) -> bool:
        new = None if len(inputs2) > 3 else _make_write_args(outputs2, inputs2)
        if new is None:
            return False
        ctypes.pointer(args)[0] = new
        kept.outputs, kept.inputs = outputs2, inputs2
        return True

    def fail(status: int) -> None:
        nb, bs = kept.outputs[0].shape[:2]
        raise paged.slot_error(args.bad[0], args.bad[1], nb, bs)

    return native_calls.NativeCall("kv_cache_write", fn, args, keep=kept, rebind=rebind, fail=fail)


paged_attention.native_call = native_paged_attention_call  # type: ignore[attr-defined]
kv_cache_write.native_call = native_kv_cache_write_call  # type: ignore[attr-defined]
paged_attention_q8.native_call = native_paged_attention_q8_call  # type: ignore[attr-defined]
kv_cache_write_q8.native_call = native_kv_cache_write_call  # type: ignore[attr-defined]

for _name in ("paged_attention", "paged_attention_window", "paged_attention_ends", "paged_attention_window_ends"):
    register_kernel(_name, "cpu", dtypes=(DataType.F32,), kernel=paged_attention)
register_kernel("kv_cache_write", "cpu", dtypes=FLOATS, kernel=kv_cache_write)
for _name in paged.Q8_ATTENTION:
    register_kernel(_name, "cpu", dtypes=(DataType.F32,), kernel=paged_attention_q8)
register_kernel("kv_cache_write_q8", "cpu", dtypes=(DataType.F32,), kernel=kv_cache_write_q8)
