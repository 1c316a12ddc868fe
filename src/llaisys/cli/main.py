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
from collections.abc import Sequence

SUBCOMMANDS = ("generate", "chat", "info", "bench", "plugin", "serve")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Errors that mean bad input or a missing file: reported in one line, without a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, FileNotFoundError, PermissionError,
                                                IsADirectoryError, NotADirectoryError)

logger = logging.getLogger("llaisys.cli")


def build_parser() -> argparse.ArgumentParser:
    """The ``llaisys`` parser with every sub-command module found."""
    from .. import __version__

    parser = argparse.ArgumentParser(prog="llaisys", description="Run small language models with llaisys.")
    parser.add_argument("--version", action="version", version=f"llaisys {__version__}")
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


def _thread_count(argv: Sequence[str]) -> str | None:
    """The value of ``--threads`` in ``argv``, if given (read before the full parse)."""
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return None


def _apply_threads(argv: Sequence[str]) -> None:
    """Make ``--threads N`` size the BLAS and OpenMP pools.

    Those pools read their size when numpy loads, which importing llaisys has done by now, so
    threadpoolctl resizes them in place; the variables are set too, for child processes.
    """
    value = _thread_count(argv)
    if value is None or not value.isdigit() or int(value) < 1:
        return  # argparse reports a bad value
    for var in THREAD_VARS:
        os.environ[var] = value
    from threadpoolctl import threadpool_limits

    threadpool_limits(int(value))


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``llaisys`` command with ``argv`` (default: the process arguments); return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    _apply_threads(args_list)
    parser = build_parser()
    args = parser.parse_args(args_list)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    _setup_logging(getattr(args, "verbose", 0))
    try:
        status = args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``llaisys generate ... | head``): not an error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except USER_ERRORS as exc:
        if getattr(args, "verbose", 0) >= 2:
            logger.exception("failed")
        print(f"llaisys {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return int(status or 0)


if __name__ == "__main__":
    raise SystemExit(main())
