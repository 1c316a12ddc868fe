"""Kernel calls as C functions with argument blocks, so that a replayed ``ops.Plan`` runs a
whole stretch of them in one native call (``llaisys_ops_run`` in csrc/ops), with no Python
between one kernel and the next.

A CPU kernel that can run this way offers ``native_call(outputs, inputs, attrs)``, which checks
what its ordinary call checks and returns a ``NativeCall`` (or None: the ordinary call must
run). The block holds every pointer the C function needs; what changes between replays is
set in place: ``refresh`` runs before each replay (rope picks the table of this step's
positions), ``rebind`` when the plan swaps a call's tensors (a KV cache's rows of a new
position) and says whether the block could follow (False: make the call anew).
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Sequence

from ... import _native


class NativeCall:
    """One kernel call: the C function ``fn`` (an address) of the argument block ``block`` (a
    ctypes Structure), ``name`` for errors, and what the block points into (``keep``)."""

    __slots__ = ("name", "fn", "block", "refresh", "rebind", "keep", "runner")

    def __init__(self, name: str, fn: int, block: ctypes.Structure, keep: Any = None,
                 refresh: "Callable[[], None] | None" = None,
                 rebind: "Callable[[tuple, tuple], bool] | None" = None):
        self.name, self.fn, self.block, self.keep = name, fn, block, keep
        self.refresh, self.rebind = refresh, rebind
        self.runner = batch  # how a stretch of such calls runs (``ops.Plan`` groups by it)


class _Call(ctypes.Structure):
    """``lo_call`` of csrc/ops/ops.h."""

    _fields_ = [("fn", ctypes.c_void_p), ("block", ctypes.c_void_p)]


_run: "Any | None | bool" = None  # llaisys_ops_run once looked up; False when the library is missing


def _runner() -> Any:
    global _run
    if _run is None:
        lib = _native.load("ops")
        if lib is None:
            _run = False
        else:
            _run = lib.llaisys_ops_run
            _run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
            _run.restype = ctypes.c_int
    return _run


def available() -> bool:
    """Whether calls can be replayed natively (the ops library is built)."""
    return bool(_runner())


def address(lib: ctypes.CDLL, function: str) -> int:
    """The address of ``function`` in ``lib``."""
    return ctypes.cast(getattr(lib, function), ctypes.c_void_p).value


def batch(calls: Sequence[NativeCall]) -> Callable[[], None]:
    """A function that runs ``calls`` in order in one native call (after their refreshes),
    raising RuntimeError, naming the kernel, for a nonzero status. The blocks are read at each
    run, so a rebound block takes effect at the next."""
    run = _runner()
    table = (_Call * len(calls))(*[(c.fn, ctypes.addressof(c.block)) for c in calls])
    refreshes = list(dict.fromkeys(c.refresh for c in calls if c.refresh is not None))  # a shared call refreshes once
    failed = ctypes.c_int64()
    count = len(calls)

    def replay() -> None:
        for refresh in refreshes:
            refresh()
        status = run(table, count, ctypes.byref(failed))
        if status:  # the arguments were checked when recorded: a bug, not bad input
            raise RuntimeError(f"{calls[failed.value].name} failed with status {status} in a replayed plan")

    return replay
