"""Kernel calls as C functions with argument blocks, so that a replayed ``ops.Plan`` runs a
whole stretch of them in one native call (``llaisys_ops_run`` in csrc/ops), with no Python
between one kernel and the next.

A CPU kernel that can run this way offers ``native_call(outputs, inputs, attrs)``, which checks
what its ordinary call checks and returns a ``NativeCall`` (or None: the ordinary call must
run). The block holds every pointer the C function needs; what changes between replays is
set in place: ``refresh`` runs before each replay (rope picks the table of this step's
positions), ``rebind`` when the plan swaps a call's tensors (a KV cache's rows of a new
position) and says whether the block could follow (False: make the call anew).

A call may be made of ``parts`` (a plugin device's CPU fallback: copies to the host, the CPU
kernel, copies back), which run as consecutive calls of the stretch. A call's ``fail(status)``
handles a nonzero status (raise, or return to go on with the next call: a plugin's
C_WARNING); without one a nonzero status raises RuntimeError naming the kernel.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any, Callable, Sequence

from ... import _native
from ..._native import structs
from .. import registry

log = logging.getLogger(__name__)


class NativeCall:
    """One kernel call: the C function ``fn`` (an address) of the argument block ``block`` (a
    ctypes Structure), ``name`` for errors, and what the block points into (``keep``); or,
    with ``parts``, the calls it is made of, run in order (``fn`` and ``block`` unused).
    ``kernel`` is False for a part that moves data rather than computing (a fallback's copy),
    which profiling counts as dispatch. ``fields``, where the block holds tensor descriptors
    of its own, gives the addresses a descriptor's data pointer and first dimension live at:
    ``fields("outputs" or "inputs", i)`` -> (data address, dim-0 address), for rewriting
    them from C (``ops.Plan`` callers that move rows every replay)."""

    __slots__ = ("name", "fn", "block", "refresh", "rebind", "keep", "runner", "fail", "parts", "kernel", "fields")

    def __init__(self, name: str, fn: int, block: "ctypes.Structure | None", keep: Any = None,
                 refresh: "Callable[[], None] | None" = None,
                 rebind: "Callable[[tuple, tuple], bool] | None" = None,
                 fail: "Callable[[int], None] | None" = None,
                 parts: "Sequence[NativeCall] | None" = None, kernel: bool = True,
                 fields: "Callable[[str, int], tuple[int, int] | None] | None" = None):
        self.name, self.fn, self.block, self.keep, self.fields = name, fn, block, keep, fields
        self.refresh, self.rebind, self.fail, self.kernel = refresh, rebind, fail, kernel
        self.parts = None if parts is None else tuple(parts)
        self.runner = batch  # how a stretch of such calls runs (``ops.Plan`` groups by it)

    def flat(self) -> "tuple[NativeCall, ...]":
        """The single calls this one runs as: itself, or its parts."""
        return (self,) if self.parts is None else self.parts


_Call = structs.Call  # lo_call of csrc/ops/ops.h
_run: "Any | None | bool" = None  # llaisys_ops_run once looked up; False when the library is missing
_run_timed: Any = None  # llaisys_ops_run_timed, for profiling
_CALL_SIZE = ctypes.sizeof(_Call)


def _runner() -> Any:
    """``llaisys_ops_run`` (its signature declared by ``_native``), or False when the ops
    library is not built; looked up once."""
    global _run, _run_timed
    if _run is None:
        lib = _native.load("ops")
        if lib is None:
            _run = False
        else:
            _run_timed = getattr(lib, "llaisys_ops_run_timed", None)  # absent from a library built before it
            _run = lib.llaisys_ops_run
    return _run


def available() -> bool:
    """Whether calls can be replayed natively (the ops library is built)."""
    return bool(_runner())


@functools.lru_cache(maxsize=None)
def address(lib: Any, function: str) -> int:
    """The address of ``function`` in ``lib`` (a library ``_native`` loaded), looked up once."""
    return _native.address(lib, function)


class Stretch:
    """Calls run in order in one native call (after their refreshes); calling it replays them.
    A nonzero status goes to the failing call's ``fail`` (which raises, or returns to go on
    with the next call), else raises RuntimeError naming the kernel. The blocks are read at
    each run, so a rebound block takes effect at the next. ``profile`` (a list of nanosecond
    counts, one per single call) makes each run add every call's time to it."""

    __slots__ = ("calls", "table", "refreshes", "failed", "base", "profile")

    def __init__(self, calls: Sequence[NativeCall]):
        _runner()
        self.calls = [part for c in calls for part in c.flat()]
        self.table = (_Call * len(self.calls))(*[(c.fn, ctypes.addressof(c.block)) for c in self.calls])
        self.base = ctypes.addressof(self.table)
        # a shared call refreshes once; a call of parts refreshes for them
        self.refreshes = list(dict.fromkeys(c.refresh for c in calls if c.refresh is not None))
        self.failed = ctypes.c_int64()
        self.profile: "ctypes.Array | None" = None

    def __len__(self) -> int:
        return len(self.calls)

    def __call__(self) -> None:
        for refresh in self.refreshes:
            refresh()
        count, profile = len(self.calls), self.profile if _run_timed is not None else None
        if profile is None:
            status = _run(self.table, count, ctypes.byref(self.failed))
        else:
            status = _run_timed(self.table, count, ctypes.byref(self.failed), ctypes.addressof(profile))
        start = 0
        while status:
            at = start + self.failed.value
            self._failed(at, status)  # returned: go on after it
            start = at + 1
            if start == count:
                return
            if profile is None:
                status = _run(self.base + start * _CALL_SIZE, count - start, ctypes.byref(self.failed))
            else:
                status = _run_timed(self.base + start * _CALL_SIZE, count - start, ctypes.byref(self.failed),
                                    ctypes.addressof(profile) + 8 * start)

    def _failed(self, at: int, status: int) -> None:
        call = self.calls[at]
        if call.fail is not None:
            call.fail(status)
            return
        # the arguments were checked when recorded: a bug, not bad input
        raise RuntimeError(f"{call.name} failed with status {status} in a replayed plan")


def batch(calls: Sequence[NativeCall]) -> Stretch:
    """A function (a ``Stretch``) that runs ``calls`` (their parts, for calls made of parts) in
    order in one native call, after their refreshes."""
    return Stretch(calls)


# ---- the CPU fallback of a plugin device, as native calls ------------------------------------
_CopyCall = structs.PluginCopyCall  # lo_plugin_copy_call of csrc/ops/plugin_calls.h


def _fallback_of(kernel: Any) -> "tuple[Any, str, Any] | None":
    """(CPU kernel, op name, device) when ``kernel`` is the registry's CPU fallback of an op on
    a device without it, else None."""
    if isinstance(kernel, functools.partial) and kernel.func is registry._run_on_host and len(kernel.args) == 3:
        return kernel.args
    return None


def native_call_of(kernel: Any, outputs: tuple, inputs: tuple, attrs: dict[str, Any]) -> "NativeCall | None":
    """The native form of a recorded call: the kernel's own ``native_call``, or, for the CPU
    fallback on a device whose backend offers native copies (a plugin's synchronous copy
    functions), the host copies and the CPU kernel's native call as one call of parts. None
    where the call must run from Python."""
    make = getattr(kernel, "native_call", None)
    if make is not None:
        return make(outputs, inputs, attrs)
    fallback = _fallback_of(kernel)
    if fallback is None or not available() or not hasattr(_native.load("ops"), "llaisys_ops_plugin_copy_call"):
        return None
    return host_fallback_call(*fallback, outputs, inputs, attrs)


class _Staging:
    """The host copy of one device tensor in a native fallback: a CPU tensor with its shape
    and strides over a buffer of at least its span, which grows (doubling) when a rebind needs
    more, and the copy calls that fill it from the device (``load``) or store it (``store``)."""

    __slots__ = ("storage", "host", "load", "store")

    def __init__(self, t: Any, copy_in: "tuple | None", copy_out: "tuple | None"):
        Storage, Tensor = _tensor_types()
        self.storage = Storage.host_scratch(t._span_nbytes())
        self.host = Tensor(self.storage, 0, t.shape, t.strides, t.dtype)
        self.load = self._copy(copy_in, self.storage.ptr, t.data_ptr, "D2H copy") if copy_in else None
        self.store = self._copy(copy_out, t.data_ptr, self.storage.ptr, "H2D copy") if copy_out else None

    def _copy(self, copy: tuple, dst: int, src: int, kind: str) -> NativeCall:
        fn, device, check = copy
        block = _CopyCall(fn, device, dst, src, self.storage.nbytes)
        return NativeCall(kind, _copy_address(), block, fail=check, kernel=False)

    def follow(self, t: Any) -> bool:
        """Point at device tensor ``t`` (same dtype and rank); True when the host tensor is
        unchanged (the CPU call needs no rebind)."""
        Storage, Tensor = _tensor_types()
        n = t._span_nbytes()
        same = (t.shape, t.strides) == (self.host.shape, self.host.strides)
        if n > self.storage.nbytes:
            self.storage = Storage.host_scratch(max(n, 2 * self.storage.nbytes))
            same = False
        if not same:
            self.host = Tensor(self.storage, 0, t.shape, t.strides, t.dtype)
        if self.load is not None:
            self.load.block.dst, self.load.block.src, self.load.block.nbytes = self.storage.ptr, t.data_ptr, n
        if self.store is not None:
            self.store.block.dst, self.store.block.src, self.store.block.nbytes = t.data_ptr, self.storage.ptr, n
        return same


@functools.lru_cache(maxsize=1)
def _copy_address() -> int:
    return address(_native.load("ops"), "llaisys_ops_plugin_copy_call")


@functools.lru_cache(maxsize=1)
def _tensor_types() -> tuple:
    """(Storage, Tensor), imported on first use (the tensor layer imports kernels lazily too)."""
    from ...tensor import Storage, Tensor

    return Storage, Tensor


_fallback_logged: set[tuple[str, str]] = set()


def host_fallback_call(cpu_kernel: Any, name: str, device: Any, outputs: tuple, inputs: tuple,
                       attrs: dict[str, Any]) -> "NativeCall | None":
    """The registry's CPU fallback of op ``name`` on ``device`` as native calls: each input's
    span copied to a host buffer (a frozen input, a weight, is read from its storage's host
    copy instead, made once), each strided output's too, the CPU kernel's native call on those
    host tensors, then each output's span copied back: what ``registry._run_on_host`` does,
    with the buffers made once. None when the CPU kernel has no native form or the device's
    backend offers no native copies (``native_copy``: the copy function, the device handle
    and the check of a copy's status)."""
    make = getattr(cpu_kernel, "native_call", None)
    native_copy = getattr(outputs[0].storage.runtime.backend, "native_copy", None)
    if make is None or native_copy is None:
        return None
    index = device.index
    d2h, h2d = native_copy(index, "d2h"), native_copy(index, "h2d")
    if d2h is None or h2d is None:
        return None
    if any(t is not None and t.storage.runtime.device != device and not t.frozen for t in inputs):
        return None  # an input on another device: the Python fallback copies it the general way
    ins = [None if t is None else t.host_span() if t.frozen else _Staging(t, d2h, None) for t in inputs]
    outs = [_Staging(t, None if t.is_contiguous() else d2h, h2d) for t in outputs]
    host_in = tuple(s if s is None or not isinstance(s, _Staging) else s.host for s in ins)
    inner = make(tuple(s.host for s in outs), host_in, attrs)
    if inner is None:
        return None
    if (name, device.type.name) not in _fallback_logged:
        _fallback_logged.add((name, device.type.name))
        log.info("op %s has no kernel on %s; replaying the CPU kernel with copies in native calls", name,
                 device.type.name)
    staged = [s for s in ins if isinstance(s, _Staging)]
    loads = [s.load for s in staged] + [s.load for s in outs if s.load is not None]
    parts = [*loads, *inner.flat(), *(s.store for s in outs)]
    frozen = [t for t in inputs if t is not None and t.frozen]

    def refresh() -> None:
        # The CPU call's refresh (rope's table of positions) reads its host inputs before the
        # stretch runs, so they are filled first, as the stretch itself will fill them again.
        for s in staged:
            _copy_now(s.load)
        inner.refresh()

    def rebind(outputs2: tuple, inputs2: tuple) -> bool:
        kept = [t for t in inputs2 if t is not None and t.frozen]
        if (len(outputs2) != len(outs) or len(inputs2) != len(ins) or len(kept) != len(frozen)
                or any(a is not b for a, b in zip(kept, frozen))):
            return False
        if any((a is None) != (b is None) or (a is not None and (a.dtype, len(a.shape)) != (b.dtype, len(b.shape)))
               for a, b in zip(inputs2 + outputs2, inputs + outputs)):
            return False
        if any(s.load is None and not t.is_contiguous() for s, t in zip(outs, outputs2)):
            return False  # a strided output needs its span copied in
        moved = [t for t in inputs2 if t is not None and not t.frozen] + list(outputs2)
        if all([s.follow(t) for s, t in zip(staged + outs, moved)]):
            return True
        new_in = tuple(s.host if isinstance(s, _Staging) else s for s in ins)
        return inner.rebind is not None and inner.rebind(tuple(s.host for s in outs), new_in)

    return NativeCall(f"{name} (CPU fallback on {device.type.name}:{index})", 0, None, keep=(ins, outs, inner),
                      refresh=refresh if inner.refresh is not None else None, rebind=rebind, parts=parts)


_CallFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)  # lo_call_fn


@functools.lru_cache(maxsize=None)
def _callable(fn: int) -> Any:
    return _CallFn(fn)


def _copy_now(call: NativeCall) -> None:
    """Run one native call now, from Python (a fallback's copy, before a refresh)."""
    status = _callable(call.fn)(ctypes.addressof(call.block))
    if status and call.fail is None:
        raise RuntimeError(f"{call.name} failed with status {status}")
    if status:
        call.fail(status)
