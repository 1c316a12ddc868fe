"""CUDA graphs of recorded steps, one per batch-size bucket.

A decoding step is a recorded ``ops.Plan`` over fixed buffers: the same kernels on the same
memory every time; only the contents of its static input buffers (token ids, positions,
slots, block tables) change, and those are copied in before each replay. Such a step is
captured once as a CUDA graph and replayed: one launch instead of hundreds, no Python between
kernels. ``GraphCache`` keeps one graph per key (the decoder uses the batch bucket,
``bucket(n)``, and pads a decoding batch to it), captured at the key's first step.

In the simulated mode (tests only) there is no CUDA graph: ``SimulatedGraph`` stands in for
one, keeping the step at capture and calling it at each replay (the recorded plan, kernel by
kernel, through the interpreter, on the same static buffers a graph reads), so the keying,
padding, input buffers and capture-once-replay-many logic run in CI without a GPU.

A captured step must make no host syncs and allocate nothing new of its own: the nvidia
kernels skip their host-side index checks while a capture runs (``NvidiaBackend.is_capturing``),
and every view or table they cache is made by the warm-up run before the capture.
``LLAISYS_NVIDIA_GRAPHS=0`` turns the decoder's use of graphs off.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Callable, Hashable

from .backend import NvidiaBackend

log = logging.getLogger(__name__)

GRAPHS_ENV = "LLAISYS_NVIDIA_GRAPHS"
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graphs_enabled() -> bool:
    """Whether decoding steps on nvidia devices replay CUDA graphs (``LLAISYS_NVIDIA_GRAPHS``,
    default on; ``0`` runs every step kernel by kernel)."""
    return os.environ.get(GRAPHS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def bucket(n: int, buckets: "tuple[int, ...]" = BUCKETS) -> int:
    """The smallest bucket holding ``n`` sequences (``n`` itself above the largest)."""
    for b in buckets:
        if n <= b:
            return b
    return n


class SimulatedGraph:
    """Tests only: what the simulated mode has instead of a CUDA graph. ``capture`` keeps the
    step; ``replay`` calls it, reading whatever its static buffers hold, as a graph would."""

    __slots__ = ("step",)

    def __init__(self, step: Callable[[], None]):
        self.step = step

    def replay(self) -> None:
        self.step()


class GraphCache:
    """Captured replays of steps by key, at most ``limit`` kept (least recently used dropped).

    ``captures`` and ``replays`` count what happened (a first run of a key is one capture
    and one replay)."""

    def __init__(self, backend: NvidiaBackend, index: int, limit: int = 16):
        self.backend, self.index, self.limit = backend, index, limit
        self._graphs: "OrderedDict[Hashable, Callable[[], None]]" = OrderedDict()
        self._lock = threading.Lock()
        self.captures = 0
        self.replays = 0

    bucket = staticmethod(bucket)

    def run(self, key: Hashable, step: Callable[[], None]) -> None:
        """Run ``step`` (kernel launches on the device, reading static buffers): replay its
        graph for ``key``, captured on the first call with that key. On a GPU the capture is
        preceded by one eager warm-up run (Triton compiles, views are made), and the replay
        that follows computes this call's result again on the same inputs."""
        with self._lock:
            replay = self._graphs.get(key)
            if replay is not None:
                self._graphs.move_to_end(key)
        if replay is None:
            replay = self.backend.capture(self.index, step, warmup=1)
            self.captures += 1
            log.debug("captured a graph for step %r (%d kept)", key, len(self._graphs) + 1)
            with self._lock:
                self._graphs[key] = replay
                while len(self._graphs) > self.limit:
                    self._graphs.popitem(last=False)
        replay()
        self.replays += 1

    def drop(self, key: Hashable) -> None:
        """Forget the graph of ``key`` (its step's buffers were replaced: a new one is captured)."""
        with self._lock:
            self._graphs.pop(key, None)

    def clear(self) -> None:
        """Drop every captured graph (their memory pools with them)."""
        with self._lock:
            self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)


__all__ = ["BUCKETS", "GRAPHS_ENV", "GraphCache", "SimulatedGraph", "bucket", "graphs_enabled"]
