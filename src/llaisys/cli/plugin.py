"""``llaisys plugin check PATH``: the conformance check of a device plugin library.

Prints a table of what passed, what ran through a fallback and what failed; the exit status
is 1 when something failed. The check runs in a child process, so a plugin that crashes is
reported as a failure. The logic lives in ``llaisys.tools.plugin_check``.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plugin`` command and its ``check`` sub-command."""
    from ..tools.plugin_check import add_arguments

    p = subparsers.add_parser("plugin", help="device plugins", description="Work with device plugin libraries.")
    actions = p.add_subparsers(dest="plugin_command", metavar="ACTION")
    check = actions.add_parser(
        "check", help="check that a plugin library works with llaisys",
        description="Load the plugin, exercise its device API with verified data, then run one decoder "
                    "layer's ops on its device and compare with the CPU.")
    add_arguments(check)
    check.set_defaults(func=_check)
    p.set_defaults(func=lambda args: _usage(p))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _check(args: argparse.Namespace) -> int:
    from ..tools.plugin_check import run_cli

    return run_cli(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``plugin ...`` on its own (``python -m llaisys.cli.plugin check PATH``)."""
    parser = argparse.ArgumentParser(prog="llaisys")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plugin", *(sys.argv[1:] if argv is None else argv)])
    level = logging.WARNING if getattr(args, "verbose", 0) <= 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"llaisys plugin: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
