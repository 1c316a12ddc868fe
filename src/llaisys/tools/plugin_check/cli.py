"""``llaisys plugin check`` and ``python -m llaisys.tools.plugin_check``: arguments, the child
process that runs the check, the table as it comes."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Sequence

from .report import CheckReport, format_row
from .rows import DEFAULT_TIMEOUT, run_check

DEADLINE_PER_TIMEOUT = 10  # the whole check's default deadline, in row timeouts
DEFAULT_DEADLINE = 300.0  # when rows have no timeout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The check's command-line arguments."""
    parser.add_argument("path", help="the plugin library (lib*.so)")
    parser.add_argument("--device", type=int, default=0, metavar="INDEX", help="device index to check (default 0)")
    parser.add_argument("--no-ops", action="store_true", help="skip running ops and a model on the device")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help=f"fail a row that takes longer, naming the plugin API it is blocked in, and skip the "
                             f"rows after it (default {DEFAULT_TIMEOUT:g}; 0: no limit)")
    parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                        help=f"stop the checking process after this long in all, failing the row it was in "
                             f"(default {DEADLINE_PER_TIMEOUT} x --timeout, or {DEFAULT_DEADLINE:g} without one; 0: none)")
    parser.add_argument("--in-process", action="store_true",
                        help="run in this process (by default a child process runs the check, so that a "
                             "plugin that crashes or hangs is reported rather than taking the command down)")
    parser.add_argument("--report-fd", type=int, default=None, help=argparse.SUPPRESS)  # the child's rows, as JSON lines
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (repeat for debug)")


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming an option with a value out of range."""
    if args.device < 0:
        raise ValueError(f"--device must be >= 0, got {args.device}")
    if args.timeout < 0:
        raise ValueError(f"--timeout must be >= 0 seconds, got {args.timeout:g}")
    if args.deadline is not None and args.deadline < 0:
        raise ValueError(f"--deadline must be >= 0 seconds, got {args.deadline:g}")


def deadline(args: argparse.Namespace) -> float:
    """Seconds the whole check may take (0: no deadline), from ``--deadline`` or ``--timeout``."""
    if args.deadline is not None:
        return args.deadline
    return DEADLINE_PER_TIMEOUT * args.timeout if args.timeout else DEFAULT_DEADLINE


def child_command(args: argparse.Namespace, report_fd: int) -> list[str]:
    """The command that runs the check for ``args`` in a child process, writing its rows as
    JSON lines to ``report_fd`` (``{"start": name}``, ``{"row": [name, status, detail]}``,
    then ``{"end": ok}``)."""
    return [sys.executable, "-m", "llaisys.tools.plugin_check", "--report-fd", str(report_fd), os.fspath(args.path),
            "--device", str(args.device), "--timeout", repr(args.timeout), *(["--no-ops"] if args.no_ops else []),
            *(["-v"] * args.verbose)]


def run_cli(args: argparse.Namespace) -> int:
    """Run the check for parsed ``args`` in this process, printing the table as it goes (or,
    with ``--report-fd``, writing rows for a parent); returns the exit status: 0 when
    nothing failed, 1 otherwise. ``llaisys plugin check`` runs this in a child process."""
    check_args(args)
    if args.report_fd is not None:
        return _run_as_child(args)
    print(CheckReport(os.fspath(args.path)).header(), flush=True)
    report = run_check(args.path, args.device, ops=not args.no_ops, timeout=args.timeout,
                       on_row=lambda row: print(format_row(row), flush=True))
    print(report.summary(), flush=True)
    return 0 if report.ok else 1


def _run_as_child(args: argparse.Namespace) -> int:
    """The child's side: rows as JSON lines on ``--report-fd`` for the parent to print."""
    with os.fdopen(args.report_fd, "w", encoding="utf-8", buffering=1) as out:
        emit = lambda event: out.write(json.dumps(event) + "\n")  # noqa: E731
        report = run_check(args.path, args.device, ops=not args.no_ops, timeout=args.timeout,
                           on_row=lambda row: emit({"row": [row.name, row.status, row.detail]}),
                           on_start=lambda name: emit({"start": name}))
        emit({"end": report.ok})
    if report.hung is not None:
        # A thread is blocked in the plugin for good: leave without the plugins' exit-time work.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m llaisys.tools.plugin_check PATH``: run the check in this process and print
    the report; 1 when a check failed (``llaisys plugin check`` adds the child process)."""
    parser = argparse.ArgumentParser(prog="python -m llaisys.tools.plugin_check", description="Check a device plugin library.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose <= 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return run_cli(args)
    except ValueError as exc:
        print(f"llaisys plugin check: error: {exc}", file=sys.stderr)
        return 1
