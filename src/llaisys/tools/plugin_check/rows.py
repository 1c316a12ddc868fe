"""Running the rows in order: load the plugin, then each device check, each on the watchdog."""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from ...kernels.registry import find_kernel
from ...plugins import PluginError
from ...runtime.dtypes import DataType
from .device_checks import OPS, Checker
from .report import FAIL, PASS, SKIP, CheckReport, CheckRow, Hung
from .watchdog import Worker

DEFAULT_TIMEOUT = 30.0  # seconds one row may take


Step = tuple[str, Callable[[], str], Sequence[str]]


def _steps(c: Checker, ops: bool) -> list[Step]:
    """The rows after ``load``, in order: (name, check, optional APIs it may fall back for)."""
    steps: list[Step] = [
        ("devices", c.devices, ()),
        ("allocator sizes", c.allocator, ("device_min_chunk_size", "device_max_chunk_size", "device_max_alloc_size",
                                          "device_extra_padding_size", "device_init_alloc_size", "device_realloc_size")),
        ("allocate/free odd sizes", c.odd_allocations, ()),
        ("copies (sync)", c.sync_copies, ("memory_copy_h2d", "memory_copy_d2h", "memory_copy_d2d")),
        ("copies (async)", c.async_copies, ("create_stream", "async_memory_copy_h2d", "async_memory_copy_d2d",
                                            "async_memory_copy_d2h")),
        ("memset", c.memset, ("device_memory_set",)),
        ("stream order", c.stream_order, ("create_stream", "query_stream")),
        ("synchronize device", c.synchronize, ("create_stream", "synchronize_device")),
        ("events across streams", c.events, ("create_event", "stream_wait_event", "query_event")),
        ("host callbacks", c.callbacks, ("create_stream", "stream_add_callback")),
        ("memory stats", c.memory_stats, ("device_memory_stats",)),
    ]
    if not ops:
        return steps
    missing = [op for op in OPS if find_kernel(op, c.plugin.name, DataType.F32) is None]
    c.fallbacks |= {f"kernel {op}" for op in missing}
    uses = [f"kernel {op}" for op in missing]
    return steps + [("kernels", lambda: c.kernels(missing), ()), ("decoder layer vs CPU", c.decoder_layer, uses),
                    ("model vs CPU", c.model, uses), ("dispatch per token", c.dispatch, uses)]


def run_check(path: "str | os.PathLike[str]", device_index: int = 0, ops: bool = True,
              on_row: Callable[[CheckRow], None] | None = None, timeout: float | None = DEFAULT_TIMEOUT,
              on_start: Callable[[str], None] | None = None) -> CheckReport:
    """Load the plugin at ``path`` and run every check on device ``device_index``; ``ops``
    also runs the decoder layer and the model against the CPU. ``on_row`` sees each row,
    ``on_start`` each row's name as it starts.

    With a ``timeout`` (seconds per row; None or 0 for none), calls into the plugin run on a
    worker thread: a row that has not finished in time fails, naming the plugin API it is
    blocked in (``report.hung``), and the rows after it are skipped. The blocked thread cannot
    be stopped and stays behind, with the plugin loaded: run the check in a child process
    (the command does) when a plugin may hang.
    """
    report = CheckReport(os.fspath(path), on_row=on_row)
    worker = Worker() if timeout else None
    try:
        _run_rows(report, path, device_index, ops, worker, timeout or 0.0, on_start or (lambda name: None))
    finally:
        if worker is not None and report.hung is None:
            worker.stop()
    return report


def _run_rows(report: CheckReport, path: "str | os.PathLike[str]", device_index: int, ops: bool,
              worker: Worker | None, timeout: float, on_start: Callable[[str], None]) -> None:
    from ...plugins import load_plugin

    def call(fn: Callable[[], Any]) -> Any:
        return fn() if worker is None else worker.call(fn, timeout)

    on_start("load")
    try:
        plugin = call(lambda: load_plugin(path))
    except Hung as exc:
        report.hung = exc.api
        report.add("load", FAIL, f"{exc} (the row timeout): the plugin hangs")
        return
    except (PluginError, OSError, ValueError) as exc:
        report.add("load", FAIL, str(exc))
        return
    version = ".".join(map(str, plugin.version))
    report.add("load", PASS, f"device type {plugin.name} ({plugin.sub_device_type or 'no sub type'}), "
                             f"ABI {version}; required APIs present")
    c = Checker(plugin, device_index)
    steps = _steps(c, ops)
    for k, (name, fn, uses) in enumerate(steps):
        on_start(name)
        try:
            rows = call(lambda name=name, fn=fn, uses=uses: c.run(name, fn, uses))
        except Hung as exc:
            report.hung = exc.api
            report.add(name, FAIL, f"{exc} (the row timeout): the plugin hangs")
            for later, _, _ in steps[k + 1:]:
                report.add(later, SKIP, f"not run: the plugin hung in {exc.api}")
            return
        for row in rows:
            report.add(row.name, row.status, row.detail)
        if name == "devices" and rows[-1].status == FAIL:
            return
    if not ops:
        report.add("decoder layer vs CPU", SKIP, "not asked for (--no-ops)")
        report.add("model vs CPU", SKIP, "not asked for (--no-ops)")
        report.add("dispatch per token", SKIP, "not asked for (--no-ops)")
