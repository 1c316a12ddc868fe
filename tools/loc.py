"""Lines of Python per layer of src/llaisys (``make loc``).

A layer is a subpackage (runtime, tensor, kernels, ...); modules directly in the package
count as "(top)". ``lines`` counts every line; ``code`` leaves out blank lines, comments and
docstrings. Layers are listed bottom-up, as data flows in docs/architecture.md.

    python3 tools/loc.py [--root src/llaisys]
"""
from __future__ import annotations

import argparse
import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path

ORDER = ["runtime", "backends", "tensor", "kernels", "plugins", "ops", "parallel", "models", "generation", "engine", "tools", "server", "cli", "(top)"]
_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENCODING, tokenize.ENDMARKER}


def docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers covered by the docstrings of the module, classes and functions."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def count(source: str) -> tuple[int, int]:
    """(all lines, code lines) of one Python source."""
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _NOT_CODE:
            code.update(range(tok.start[0], tok.end[0] + 1))
    code -= docstring_lines(ast.parse(source))
    return len(source.splitlines()), len(code)


def layer_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else "(top)"


def main() -> None:
    parser = argparse.ArgumentParser(description="Lines of Python per layer of the package.")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent / "src" / "llaisys")
    args = parser.parse_args()
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # files, lines, code
    for path in sorted(args.root.rglob("*.py")):
        lines, code = count(path.read_text(encoding="utf-8"))
        entry = totals[layer_of(path, args.root)]
        entry[0] += 1
        entry[1] += lines
        entry[2] += code
    layers = sorted(totals, key=lambda name: (ORDER.index(name) if name in ORDER else len(ORDER), name))
    print(f"{'layer':12} {'files':>5} {'lines':>7} {'code':>7}")
    for name in layers:
        files, lines, code = totals[name]
        print(f"{name:12} {files:5d} {lines:7d} {code:7d}")
    files, lines, code = (sum(v[i] for v in totals.values()) for i in range(3))
    print(f"{'total':12} {files:5d} {lines:7d} {code:7d}")


if __name__ == "__main__":
    main()
