"""The layer map of docs/architecture.md holds: no module imports from a layer above its own.

The layers and their order are read from the diagram at the top of docs/architecture.md
(top first), so the test and the document cannot drift apart. Lazy imports inside functions
count too; the few deliberate exceptions are listed in the document's "Upward imports"
paragraph and here.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "llaisys"
DOC = ROOT / "docs" / "architecture.md"

# (importing module, imported layer): each is named in docs/architecture.md.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def layer_order() -> list[str]:
    """Layer names from the diagram, top first (``llaisys.cli`` -> ``cli``)."""
    block = DOC.read_text(encoding="utf-8").split("```")[1]
    names = [m.group(1) for m in re.finditer(r"^ llaisys\.(\w+)", block, re.MULTILINE)]
    assert len(names) >= 8, f"could not read the layer diagram of {DOC}"
    return names


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Absolute names of the llaisys modules that ``path`` imports, with line numbers."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("llaisys")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("llaisys"):
                # ``from .. import ops`` imports the layer named by the alias
                found += [(node.lineno, f"{target}.{a.name}" if target == "llaisys" else target) for a in node.names]
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_package_is_on_the_map():
    order = layer_order()
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(order), f"packages missing from the layer map of {DOC.name}: {packages - set(order)}"


def test_no_module_imports_from_a_layer_above_it():
    order = layer_order()
    rank = {name: i for i, name in enumerate(order)}  # 0 is the top
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        own = layer_of(name)
        if own not in rank:  # llaisys/__init__.py and __main__.py sit above every layer
            continue
        for line, target in imported_modules(path):
            theirs = layer_of(target)
            if theirs in rank and rank[theirs] < rank[own] and (name, theirs) not in ALLOWED_UPWARD:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({own}) imports {target} ({theirs})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_relative_imports_resolve_to_their_layers():
    """The walker resolves ``from ...tensor import`` and ``from .. import ops`` to layers."""
    kernel = {layer_of(t) for _, t in imported_modules(PACKAGE / "kernels" / "cpu" / "attention.py")}
    assert {"tensor", "kernels"} <= kernel
    runner = {layer_of(t) for _, t in imported_modules(PACKAGE / "models" / "runner.py")}
    assert {"ops", "runtime", "tensor", "models"} <= runner


def _runtime_imports(path: Path) -> set[str]:
    """The llaisys modules ``path`` imports when run (``if TYPE_CHECKING:`` blocks left out),
    each resolved to the module file it names (``from .x import f`` -> ``...x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    names = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("llaisys")]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            if base.startswith("llaisys"):
                names += [f"{base}.{a.name}" for a in node.names]
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found = set()
    for target in names:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        found.add(target)
    found.discard("")
    found.discard(name)
    return found


def test_no_import_circle_crosses_a_folder():
    """Modules that import each other (directly or round a loop) sit in one folder: a reader
    can take the folders in order. Found as the strongly connected components of the graph."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _runtime_imports(p) for m, p in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len({files[m].parent for m in component}) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not circles, "import circles across folders:\n" + "\n".join(", ".join(c) for c in circles)
