"""Timing for the micro-benchmarks: per-call wall times over timed batches of calls."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def per_call_seconds(fn: Callable[[], object], repeat: int, warmup: int = 5, batch_s: float = 2e-4) -> list[float]:
    """Wall time of one call of ``fn`` in each of ``repeat`` timed batches, after ``warmup``
    calls. A batch runs about ``batch_s`` seconds (or one call, if longer), so the timer's
    resolution does not matter."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    fn()
    inner = max(1, int(batch_s / max(time.perf_counter() - start, 1e-9)))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return times


def median_seconds(fn: Callable[[], object], repeat: int, warmup: int = 5) -> float:
    """Median wall time of one call of ``fn`` over ``repeat`` timed batches of calls."""
    return statistics.median(per_call_seconds(fn, repeat, warmup))
