"""A recorded sequence of op calls, replayed without their argument checks.

Every op takes ``plan=``: given a Plan, the op checks its arguments and resolves its kernel
as usual, then appends the call to the plan instead of running it. ``Plan.run`` replays the
calls in order on the same tensors, so a model's decoding step pays for its checks, kernel
lookups and view creation once. Tensors whose place changes between replays (the rows of a
KV cache a step writes and reads) are swapped in with ``rebind``, which must keep what the
recorded checks saw true (device, dtype, rank; shapes that still fit the op).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..tensor import Tensor

Call = list  # [kernel, outputs tuple, inputs tuple, attrs dict]


class Plan:
    """Checked op calls, each ``[kernel, outputs, inputs, attrs]``, run in recording order."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def append(self, kernel: Callable[[tuple, tuple, dict], None], outputs: tuple, inputs: tuple,
               attrs: dict[str, Any]) -> None:
        """Record one resolved kernel call (the ops do this when given ``plan=``)."""
        self.calls.append([kernel, tuple(outputs), tuple(inputs), attrs])

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

    def run(self) -> None:
        """Run every recorded call in order."""
        for kernel, outputs, inputs, attrs in self.calls:
            kernel(outputs, inputs, attrs)
