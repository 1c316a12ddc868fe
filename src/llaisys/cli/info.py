"""``llaisys info [MODEL]`` (or ``--model MODEL``): what a model file holds: architecture, sizes,
dtypes, tensor types."""
from __future__ import annotations

import argparse
import json
from typing import Any

from .common import UsageError, add_model_options, load_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``info`` sub-command."""
    p = subparsers.add_parser("info", help="describe a model",
                              description="Load MODEL and print its architecture, sizes, data types and the "
                                          "tensor types in the file.")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="a Hugging Face model folder or a .gguf file, as --model (default: the bundled SmolLM2-135M)")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_model_options(p)
    p.set_defaults(func=run)


def format_info(info: dict[str, Any], indent: int = 0) -> list[str]:
    """``info`` as aligned ``key: value`` lines, nested dicts indented."""
    width = max((len(str(k)) for k in info), default=0)
    lines = []
    for key, value in info.items():
        pad = " " * indent
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.extend(format_info(value, indent + 2))
        else:
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
                value = f"{value:,}"
            elif isinstance(value, (list, tuple)):
                value = ", ".join(str(v) for v in value)
            lines.append(f"{pad}{str(key) + ':':<{width + 1}} {value}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Load the model and print ``model.info()``, with the arithmetic its block formats run in."""
    if args.model_path is not None and args.model is not None and args.model_path != args.model:
        raise UsageError(f"two models given, {args.model_path!r} and --model {args.model!r}; give one")
    model = load_from_args(args, args.model_path or args.model)
    info = model.info()
    from .bench import block_arithmetic
    from ..kernels.quant import native

    arithmetic = block_arithmetic(model)
    if arithmetic is not None:  # the arithmetic of the block-format matrices, and its units
        info["quant_math"] = arithmetic if arithmetic == "f32" else f"{arithmetic} on {native.int_level()}"
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print("\n".join(format_info(info)))
    return 0
