"""``llaisys plugin check PATH``: the conformance check of a device plugin library.

Prints a table of what passed, what ran through a fallback, what failed and what the device
is too small for; the exit status is 1 when something failed. The check runs in a child
process with a timeout per row and a deadline for the whole, so a plugin that crashes or
hangs is reported as a failure. The checks live in ``llaisys.tools.plugin_check``; this
module runs the child, prints its rows as they come and stops it at the deadline.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from ..tools.plugin_check import CheckReport

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plugin`` command and its ``check`` sub-command."""
    from ..tools.plugin_check import add_arguments

    p = subparsers.add_parser("plugin", help="device plugins", description="Work with device plugin libraries.")
    actions = p.add_subparsers(dest="plugin_command", metavar="ACTION")
    check = actions.add_parser(
        "check", help="check that a plugin library works with llaisys",
        description="Load the plugin, exercise its device API with verified data (within the sizes and "
                    "memory the device reports), then run one decoder layer's ops and a small model on its "
                    "device and compare with the CPU. Each row has a timeout; a call that hangs fails its row.")
    add_arguments(check)
    check.set_defaults(func=_check)
    p.set_defaults(func=lambda args: _usage(p))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _check(args: argparse.Namespace) -> int:
    from ..tools.plugin_check import check_args, run_cli
    from .common import UsageError, missing_plugin

    try:
        check_args(args)
    except ValueError as exc:  # an option's value out of range: a usage error
        raise UsageError(str(exc)) from None
    missing = missing_plugin(os.fspath(args.path))
    if missing is not None:
        raise FileNotFoundError(missing)
    return run_cli(args) if args.in_process else run_in_child(args)


def run_in_child(args: argparse.Namespace) -> int:
    """Run the check for ``args`` in a child process, print its rows as they come and stop
    it at the deadline; a crash or a stop becomes a failed row. Returns the exit status."""
    from ..tools.plugin_check import CheckReport, child_command, deadline, format_row

    path = os.fspath(args.path)
    limit = deadline(args)
    read_fd, write_fd = os.pipe()
    report = CheckReport(path, on_row=lambda row: print(format_row(row), flush=True))
    print(report.header(), flush=True)
    proc = subprocess.Popen(child_command(args, write_fd), pass_fds=(write_fd,))
    os.close(write_fd)
    events: queue.Queue = queue.Queue()
    threading.Thread(target=_read_events, args=(read_fd, events), name="plugin-check-rows", daemon=True).start()
    try:
        return _follow(proc, report, events, time.monotonic() + limit if limit else None, limit)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _read_events(fd: int, events: queue.Queue) -> None:
    """Put each JSON line the child writes on ``events``, then None at its end."""
    with os.fdopen(fd, "r", encoding="utf-8") as lines:
        for line in lines:
            try:
                events.put(json.loads(line))
            except ValueError:
                log.warning("plugin check: unreadable line from the checking process: %r", line)
    events.put(None)


def _follow(proc: subprocess.Popen, report: "CheckReport", events: queue.Queue, end: float | None, limit: float) -> int:
    """Add the child's rows to ``report`` until it exits or ``end`` (monotonic) passes."""
    left = lambda: None if end is None else max(0.0, end - time.monotonic())  # noqa: E731
    current, finished = None, False
    while True:
        try:
            event = events.get(timeout=left())
        except queue.Empty:
            return _stopped(proc, report, current, finished, limit)
        if event is None:
            break
        if "start" in event:
            current = event["start"]
        elif "row" in event:
            report.add(*event["row"])
            if event["row"][0] == current:
                current = None
        elif "end" in event:
            finished, current = True, None
    try:
        rc = proc.wait(timeout=left())
    except subprocess.TimeoutExpired:
        return _stopped(proc, report, current, finished, limit)
    if rc < 0:
        return _crashed(report, rc, current)
    if not finished:
        report.fail("(error)", f"the checking process exited with status {rc} before the check finished; "
                               "see its messages above")
    print(report.summary(), flush=True)
    return 0 if report.ok and rc == 0 else 1


def _stopped(proc: subprocess.Popen, report: "CheckReport", current: str | None, finished: bool, limit: float) -> int:
    proc.kill()
    proc.wait()
    if finished:
        report.fail("(exit)", f"the checking process had not exited {limit:g} s after the check began "
                              "(--deadline): the plugin's exit-time work hangs; it was stopped")
    else:
        report.fail(current or "(deadline)", f"not finished within the check's deadline of {limit:g} s "
                                             "(--deadline); the checking process was stopped")
    print(report.summary(), flush=True)
    return 1


def _crashed(report: "CheckReport", rc: int, current: str | None) -> int:
    try:
        why = signal.Signals(-rc).name
    except ValueError:
        why = f"signal {-rc}"
    where = f"in the check {current!r}" if current else "after the last row above"
    report.fail("(crash)", f"the plugin crashed the checking process ({why}) {where}")
    print("FAILED: the plugin crashed", flush=True)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``plugin ...`` on its own (``python -m llaisys.cli.plugin check PATH``)."""
    from .common import UsageError, command_name
    from .main import Parser

    parser = Parser(prog="llaisys")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plugin", *(sys.argv[1:] if argv is None else argv)])
    level = logging.WARNING if getattr(args, "verbose", 0) <= 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"llaisys {command_name(args)}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1


if __name__ == "__main__":
    raise SystemExit(main())
