"""CUDA graphs of recorded steps, one per batch-size bucket (GPU only).

A decoding step of the serving engine is a recorded ``ops.Plan`` over fixed buffers: the
same kernels on the same memory every time, only the contents of its index tensors (ids,
positions, slots, block tables) change, and those are copied in before it runs. Such a step
can be captured once as a CUDA graph and replayed: one launch instead of hundreds, no Python
between kernels. ``GraphCache`` keeps one graph per key (the step's shape (N, B, R), so one
per batch bucket when the caller pads batches to buckets) and falls back to calling the step
in the simulated mode, where nothing is captured.

The step must make no host syncs and allocate nothing new while captured: the nvidia kernels
skip their host-side index checks while a capture runs (``NvidiaBackend.is_capturing``), and
every cached view or table they make is made by the warm-up run before capture.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable

from .backend import NvidiaBackend

log = logging.getLogger(__name__)


class GraphCache:
    """Captured replays of steps by key, at most ``limit`` kept (least recently used dropped)."""

    def __init__(self, backend: NvidiaBackend, index: int, limit: int = 16):
        self.backend, self.index, self.limit = backend, index, limit
        self._graphs: "OrderedDict[Hashable, Callable[[], None]]" = OrderedDict()
        self._lock = threading.Lock()
        self.captures = 0

    def run(self, key: Hashable, step: Callable[[], None]) -> None:
        """Run ``step`` (kernel launches on the device): replay its graph for ``key``, captured
        on the first call with that key (after one eager warm-up run, which computes this
        call's result; the capture itself then computes nothing that is kept)."""
        with self._lock:
            replay = self._graphs.get(key)
            if replay is not None:
                self._graphs.move_to_end(key)
        if replay is not None:
            replay()
            return
        if self.backend.simulate:
            step()
            return
        replay = self.backend.capture(self.index, step, warmup=1)
        replay()  # the capture recorded the work; this runs it on the inputs loaded for this call
        self.captures += 1
        log.debug("captured a CUDA graph for step %r (%d kept)", key, len(self._graphs) + 1)
        with self._lock:
            self._graphs[key] = replay
            while len(self._graphs) > self.limit:
                self._graphs.popitem(last=False)

    def clear(self) -> None:
        """Drop every captured graph (their memory pools with them)."""
        with self._lock:
            self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)


def bucket(n: int, buckets: "tuple[int, ...]" = (1, 2, 4, 8, 16, 32, 64, 128, 256)) -> int:
    """The smallest bucket holding ``n`` sequences (``n`` itself above the largest)."""
    for b in buckets:
        if n <= b:
            return b
    return n


__all__: list[Any] = ["GraphCache", "bucket"]
