"""A recorded sequence of op calls, replayed without their argument checks.

Every op takes ``plan=``: given a Plan, the op checks its arguments and resolves its kernel
as usual, then appends the call to the plan instead of running it. ``Plan.run`` replays the
calls in order on the same tensors, so a model's decoding step pays for its checks, kernel
lookups and view creation once. Tensors whose place changes between replays (the rows of a
KV cache a step writes and reads) are swapped in with ``rebind``, which must keep what the
recorded checks saw true (device, dtype, rank; shapes that still fit the op).

Kernels that can be called as a C function on an argument block (``native_call``; see
``kernels.cpu.native_calls``) are replayed a stretch at a time, in one native call each, with
no Python between them; the others are called one by one as recorded. On a plugin's device
that covers the plugin's own kernels (one C signature, ``kernel_ext.h``) and the CPU fallback
of an op it lacks whose CPU kernel has a native form (the host copies through the plugin's
copy functions, then the CPU kernel).
"""
from __future__ import annotations

import ctypes
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..kernels.cpu import native_calls

if TYPE_CHECKING:
    from ..tensor import Tensor

Call = list  # [kernel, outputs tuple, inputs tuple, attrs dict]


@dataclass(frozen=True)
class ReplayStats:
    """How a plan replays: its recorded ``calls``, how many of them run inside native
    stretches (``native``) in how many ``stretches``, and how many are called from Python."""

    calls: int
    native: int
    stretches: int
    python: int


@dataclass(frozen=True)
class ReplayProfile:
    """Seconds per replay, median of the runs: ``total``, and the part spent inside kernels
    (``kernels``: the calls of native stretches, each timed in C, less the copies of a native
    CPU fallback). ``dispatch`` = total - kernels: Python, crossings into C, refreshes, the
    fallback's copies, and the whole of every call made from Python (its kernel time cannot
    be told apart from the wrapper around it)."""

    total: float
    kernels: float

    @property
    def dispatch(self) -> float:
        """Seconds per replay outside the kernels."""
        return max(self.total - self.kernels, 0.0)


class Plan:
    """Checked op calls, each ``[kernel, outputs, inputs, attrs]``, run in recording order."""

    __slots__ = ("calls", "_native", "_program")

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._native: list[Any] = []  # per call: its NativeCall, False (none), or None (not asked yet)
        self._program: list[Callable[[], None]] | None = None  # the steps of a replay, made at the first

    def append(self, kernel: Callable[[tuple, tuple, dict], None], outputs: tuple, inputs: tuple,
               attrs: dict[str, Any]) -> None:
        """Record one resolved kernel call (the ops do this when given ``plan=``)."""
        self.calls.append([kernel, tuple(outputs), tuple(inputs), attrs])
        self._native.append(None)
        self._program = None

    def __len__(self) -> int:
        return len(self.calls)

    def rebind(self, index: int, outputs: "tuple[Tensor, ...] | None" = None,
               inputs: "tuple[Tensor | None, ...] | None" = None) -> None:
        """Replace the outputs and/or inputs of call ``index`` for the next replays."""
        call = self.calls[index]
        if outputs is not None:
            call[1] = outputs
        if inputs is not None:
            call[2] = inputs
        native = self._native[index]
        if native and not (native.rebind is not None and native.rebind(call[1], call[2])):
            self._native[index] = None  # made anew, with the stretch it belongs to, at the next run
            self._program = None

    def native(self, index: int) -> Any:
        """The native call (``kernels.cpu.native_calls.NativeCall``) call ``index`` runs as in
        the compiled replay, or None (not compiled yet, or run from Python)."""
        return self._native[index] or None if self._program is not None else None

    @property
    def compiled(self) -> "list[Callable[[], None]] | None":
        """The replay's steps as compiled now (None until the next run compiles them); a new
        list after anything made the plan compile again."""
        return self._program

    def run(self) -> None:
        """Run every recorded call in order."""
        for step in self._program if self._program is not None else self._compile():
            step()

    def stats(self) -> ReplayStats:
        """How the replay runs (compiles it first if needed)."""
        program = self._program if self._program is not None else self._compile()
        stretches = [step for step in program if isinstance(step, native_calls.Stretch)]
        native = sum(1 for n in self._native if n)
        return ReplayStats(len(self.calls), native, len(stretches), len(self.calls) - native)

    def profile(self, runs: int = 5) -> ReplayProfile:
        """Replay ``runs`` times (the plan's effects happen each time) timing each replay and,
        in C, each call of its native stretches; the medians."""
        program = self._program if self._program is not None else self._compile()
        stretches = [step for step in program if isinstance(step, native_calls.Stretch)]
        totals, kernels = [], []
        try:
            for _ in range(max(runs, 1)):
                for st in stretches:
                    st.profile = (ctypes.c_int64 * len(st))()
                start = time.perf_counter()
                for step in program:
                    step()
                totals.append(time.perf_counter() - start)
                kernels.append(sum(ns for st in stretches for call, ns in zip(st.calls, st.profile) if call.kernel)
                               / 1e9)
        finally:
            for st in stretches:
                st.profile = None
        return ReplayProfile(statistics.median(totals), statistics.median(kernels))

    def _compile(self) -> list[Callable[[], None]]:
        """The replay's steps: each stretch of calls with native forms as one native call, each
        other call on its own (reading its entry in ``calls``, so a rebind needs nothing here)."""
        program: list[Callable[[], None]] = []
        stretch: list[Any] = []
        for i, call in enumerate(self.calls):
            if self._native[i] is None:
                self._native[i] = native_calls.native_call_of(call[0], call[1], call[2], call[3]) or False
            native = self._native[i]
            if native and (not stretch or native.runner is stretch[0].runner):
                stretch.append(native)
                continue
            if stretch:
                program.append(stretch[0].runner(stretch))
                stretch = []
            if native:
                stretch.append(native)
            else:
                program.append(lambda call=call: call[0](call[1], call[2], call[3]))
        if stretch:
            program.append(stretch[0].runner(stretch))
        self._program = program
        return program
