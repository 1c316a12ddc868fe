"""``llaisys``: argument parsing, logging, thread count and error reporting for all sub-commands.

Each sub-command lives in ``llaisys.cli.<name>`` and exposes ``register(subparsers)``, which adds
its parser and sets ``func`` (``func(args) -> int | None``, the exit status) with
``set_defaults``. A module of the list that is not there is left out of the command.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

SUBCOMMANDS = ("generate", "chat", "info", "bench", "plugin", "serve", "list")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Errors that mean bad input or a missing file: reported in one line, without a traceback;
# status 2 for a bad command line (common.UsageError, as argparse's own), 1 for the rest.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, FileNotFoundError, PermissionError,
                                                IsADirectoryError, NotADirectoryError)

logger = logging.getLogger("llaisys.cli")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``llaisys generate: error: ...``, and status
    2, like the value checks made after parsing (``common.UsageError``); its sub-parsers are
    Parsers too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """As argparse's, with arguments left over reported by the sub-command they were given to."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.command_parser(ns).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns

    def command_parser(self, ns: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the innermost sub-command ``ns`` was parsed with (``plugin check``'s)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(ns, action.dest, None))
                if chosen is not None:
                    return chosen.command_parser(ns) if isinstance(chosen, Parser) else chosen
        return self


def build_parser() -> argparse.ArgumentParser:
    """The ``llaisys`` parser with every sub-command module found."""
    from .. import __version__
    from .common import add_verbose

    parser = Parser(prog="llaisys", description="Run small language models with llaisys.")
    parser.add_argument("--version", action="version", version=f"llaisys {__version__}")
    add_verbose(parser, dest="global_verbose")  # before the command; added to the command's own -v
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__package__}.{name}":
                continue
            raise
        module.register(subparsers)
    return parser


def _busy_cpus(cpus: set[int], interval: float = 0.1) -> float | None:
    """How many of ``cpus`` other processes kept busy over ``interval`` seconds, from the
    per-CPU counters of /proc/stat; None where there is no /proc/stat."""
    def sample() -> dict[int, tuple[int, int]]:
        counts = {}
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                    counts[int(name[3:])] = (sum(ticks), ticks[3] + ticks[4])
        return counts

    try:
        before = sample()
        time.sleep(interval)  # this process sleeps meanwhile: what is busy is other work
        after = sample()
    except (OSError, ValueError):
        return None
    total = sum(after[c][0] - before[c][0] for c in before if c in after)
    idle = sum(after[c][1] - before[c][1] for c in before if c in after)
    return len(before) * (1 - idle / total) if total > 0 else None


def default_threads() -> int:
    """Threads when --threads is not given: the CPUs this process may run on, less those other
    processes keep busy (measured over 0.1 s), rounded, at least 1.

    BLAS threads wait for each other at every matrix product, so one that shares its CPU with
    another busy process stalls them all: on 2 CPUs beside one busy process, 2 threads decode
    several times slower than 1.
    """
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    busy = _busy_cpus(cpus)
    if busy is None and hasattr(os, "getloadavg"):
        busy = os.getloadavg()[0]
    free = len(cpus) - (busy or 0.0)
    return max(1, min(len(cpus), int(free + 0.5)))


def apply_threads(threads: int | None) -> int | None:
    """Size the BLAS and OpenMP pools and the quantized kernels' own pool: ``threads``, or
    ``default_threads()`` unless a thread variable (OMP_NUM_THREADS, ...) is set. Returns the
    pools' size (None if unknown).

    The BLAS pools read their size when numpy loads, which importing llaisys has done by now,
    so threadpoolctl resizes them in place; the variables are set too, for child processes.
    """
    if threads is None:
        preset = next((os.environ[var] for var in THREAD_VARS if os.environ.get(var)), None)
        if preset is not None:  # the user's own choice, which the BLAS pools have read already
            threads = int(preset) if preset.isdigit() and int(preset) > 0 else None
            if threads is not None:
                _size_native_pool(threads)
            return threads
        threads = default_threads()
    for var in THREAD_VARS:
        os.environ[var] = str(threads)
    from threadpoolctl import threadpool_limits

    threadpool_limits(threads)
    _size_native_pool(threads)
    logger.info("threads: %d", threads)
    return threads


def apply_quant_math(name: str | None) -> None:
    """Use arithmetic ``name`` for the block formats (``--quant-math``), or else check that a
    LLAISYS_QUANT_MATH the user set names one that runs here. UsageError when ``name`` does not
    run on this CPU; a warning when the variable's value was not taken."""
    from ..kernels.quant import native
    from .common import UsageError

    if not native.available():
        if name not in (None, "f32"):
            raise UsageError(f"--quant-math {name} needs the native kernels, which are not built here")
        return
    if name is not None:
        try:
            native.set_quant_math(name)
        except ValueError as exc:
            raise UsageError(f"--quant-math: {exc}") from None
        return
    wanted = os.environ.get("LLAISYS_QUANT_MATH")
    if wanted and wanted != native.quant_math():
        logger.warning("LLAISYS_QUANT_MATH=%s is not an arithmetic this CPU runs (%s); using %s", wanted,
                       ", ".join(native.available_quant_maths()), native.quant_math())


def _size_native_pool(threads: int) -> None:
    """Give the native quantized kernels ``threads`` threads (when the library was built)."""
    from ..kernels.quant import native

    if native.available():
        native.set_threads(threads)


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def world_size() -> int:
    """The MPI ranks this process was started among (1 outside a launcher)."""
    from ..parallel.mpi import world_size as ranks

    return ranks()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``llaisys`` command with ``argv`` (default: the process arguments); return the exit status."""
    from .common import UsageError, command_name

    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    args.verbose = args.global_verbose + getattr(args, "verbose", 0)
    _setup_logging(args.verbose)
    ranks = getattr(args, "tensor_parallel", 1)
    if ranks > 1 or world_size() > 1:
        started = world_size()
        if started == 1:  # not under a launcher: start the ranks, each running this same command
            from ..parallel.launch import STOP_GRACE_S, relaunch

            # serve drains its requests for --shutdown-timeout s after a stop signal: wait that long
            grace = max(STOP_GRACE_S, getattr(args, "shutdown_timeout", 0.0) + 5.0)
            try:
                return relaunch(ranks, list(sys.argv[1:] if argv is None else argv), grace_s=grace)
            except FileNotFoundError as exc:
                print(f"llaisys {command_name(args)}: error: {exc}", file=sys.stderr)
                return 1
        if started != ranks:
            print(f"llaisys {command_name(args)}: error: started as {started} MPI ranks; pass --tensor-parallel "
                  f"{started} to split the model over them", file=sys.stderr)
            return 2
        if args.threads is None and not any(os.environ.get(v) for v in THREAD_VARS):
            args.threads = max(1, len(os.sched_getaffinity(0)) // ranks)  # the ranks share this host's CPUs
    if hasattr(args, "threads"):  # the model commands
        args.threads = apply_threads(args.threads)
    try:
        if hasattr(args, "quant_math"):
            apply_quant_math(args.quant_math)
        status = args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        _stop_ranks()
        return 130
    except BrokenPipeError:
        # The reader went away (``llaisys generate ... | head``): not an error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except USER_ERRORS as exc:
        if args.verbose >= 2:
            logger.exception("failed")
        if os.environ.get("PMI_RANK", "0") == "0":  # every rank fails alike; one says so
            print(f"llaisys {command_name(args)}: error: {exc}", file=sys.stderr)
        _stop_ranks()
        return 2 if isinstance(exc, UsageError) else 1
    except BaseException:
        _stop_ranks()
        raise
    return int(status or 0)


def _stop_ranks() -> None:
    """After rank 0 of a tensor-parallel run stopped early: let the other ranks go, or end
    them all when a pass was left half done (``tensor_parallel.release``)."""
    from . import common

    if common.TENSOR_PARALLEL_LEADER is None:  # nothing started: every rank fails alike and exits
        return
    sys.stderr.flush()
    from ..models.tensor_parallel import release
    release(common.TENSOR_PARALLEL_LEADER)


if __name__ == "__main__":
    raise SystemExit(main())
