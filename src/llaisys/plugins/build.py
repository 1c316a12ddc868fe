"""Building device plugins with the system C compiler (``cc``), no other build tool.

``build_plugin(sources, out)`` compiles C files against ``include_dir()`` into a shared
library; ``build_reference_plugin()`` builds ``plugins/custom_cpu`` into ``build_dir()``,
only when a source or header is newer than the library.

Where the headers are: ``$LLAISYS_INCLUDE_DIR`` if set, else the ``include/`` folder of the
source tree this package runs from (an editable install, ``pip install -e .``).
"""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Iterable, Sequence

log = logging.getLogger(__name__)

CFLAGS = ("-shared", "-fPIC", "-O2", "-pthread", "-fvisibility=hidden", "-Wall")
_SOURCE_ROOT = Path(__file__).resolve().parents[3]


def include_dir() -> Path:
    """The folder holding ``llaisys/device_ext.h`` and ``llaisys/kernel_ext.h``."""
    root = os.environ.get("LLAISYS_INCLUDE_DIR")
    path = Path(root) if root else _SOURCE_ROOT / "include"
    if not (path / "llaisys" / "device_ext.h").is_file():
        raise FileNotFoundError(
            f"the plugin headers are not in {path}; set LLAISYS_INCLUDE_DIR to the folder holding "
            "llaisys/device_ext.h (the include/ folder of the llaisys source tree)")
    return path


def reference_plugin_dir() -> Path:
    """The sources of the reference plugin (``plugins/custom_cpu``)."""
    path = _SOURCE_ROOT / "plugins" / "custom_cpu"
    if not path.is_dir():
        raise FileNotFoundError(f"the reference plugin sources are not in {path}; use a source checkout of llaisys")
    return path


def build_dir() -> Path:
    """Where built plugins go: ``$LLAISYS_BUILD_DIR`` or ``build/plugins`` of the source tree."""
    root = os.environ.get("LLAISYS_BUILD_DIR")
    return Path(root) if root else _SOURCE_ROOT / "build" / "plugins"


def _sources(src: "str | os.PathLike[str] | Iterable[str | os.PathLike[str]]") -> list[Path]:
    items = [src] if isinstance(src, (str, os.PathLike)) else list(src)
    files: list[Path] = []
    for item in map(Path, items):
        if item.is_dir():
            files.extend(sorted(item.glob("*.c")))
        elif item.is_file():
            files.append(item)
        else:
            raise FileNotFoundError(f"plugin source {item} does not exist")
    if not files:
        raise ValueError(f"no C sources in {', '.join(map(str, items))}")
    return files


def build_plugin(src: "str | os.PathLike[str] | Iterable[str | os.PathLike[str]]", out: "str | os.PathLike[str]",
                 defines: Sequence[str] = (), extra_flags: Sequence[str] = (), compiler: str | None = None) -> Path:
    """Compile C sources into the shared library ``out`` and return its path.

    ``src``: a folder (its ``*.c``), a file, or a list of them. ``defines``: ``NAME`` or
    ``NAME=VALUE`` macros. The command is ``cc -shared -fPIC -O2 -pthread
    -fvisibility=hidden -I <include_dir()> ... -lm`` (``$CC`` or ``compiler`` replaces cc).
    Raises RuntimeError with the compiler's output when it fails.
    """
    files = _sources(src)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cc = compiler or os.environ.get("CC") or "cc"
    if shutil.which(cc.split()[0]) is None:
        raise RuntimeError(f"no C compiler: {cc!r} is not on PATH (set CC to one)")
    # Compile to a temporary name, then rename: a library loaded from ``out`` stays intact.
    tmp = str(out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.tmp"))
    cmd = [*shlex.split(cc), *CFLAGS, f"-I{include_dir()}", *(f"-D{d}" for d in defines), *extra_flags,
           *map(str, files), "-o", tmp, "-lm"]
    log.debug("building %s: %s", out, shlex.join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise RuntimeError(f"building {out} failed ({shlex.join(cmd)}):\n{proc.stderr.strip()}")
    os.replace(tmp, out)
    return out


def build_reference_plugin(out_dir: "str | os.PathLike[str] | None" = None) -> Path:
    """Build ``libcustom_cpu.so`` from ``plugins/custom_cpu`` into ``out_dir`` (default
    ``build_dir()``) unless it is newer than every source and header; returns its path."""
    src = reference_plugin_dir()
    out = Path(out_dir or build_dir()) / "libcustom_cpu.so"
    inputs = [*src.glob("*.[ch]"), *(include_dir() / "llaisys").glob("*.h")]
    if out.is_file() and out.stat().st_mtime >= max(p.stat().st_mtime for p in inputs):
        return out
    return build_plugin(src, out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m llaisys.plugins.build [OUT_DIR]``: build the reference plugin (``make plugins``)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    path = build_reference_plugin(args[0] if args else None)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
