"""The one native boundary: every shared library llaisys opens is opened here.

Each folder ``csrc/<name>/`` is built into ``llaisys/_native/_<name>`` at install time (a plain C
library, not a Python extension). ``load(name)`` opens it once and keeps it: on that first load
the functions of its table in ``signatures.py`` get their ctypes types, and every ctypes mirror
of its C structures (``structs.py``, and the plugin ABI's in ``backends/plugin/abi.py``) is
compared with the layout the library exports (``layouts.py``), so a mirror that drifted from the
C raises ``LayoutError`` there instead of corrupting memory later; nothing is checked per
call. ``load`` returns None when the library was not built (no C compiler at install time);
``require`` raises an error that says how to build it; ``optional`` logs what runs instead.

Libraries outside llaisys: ``open_path`` opens a device plugin's file (the plugin loader keeps
the handle), ``libc`` the C library (glibc's heap counts).
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import threading
from pathlib import Path

from . import layouts, structs  # noqa: F401  (structs registers the mirrors before any library loads)
from .layouts import LayoutError, Mirror, check_mirror, checked, mirror, mirrors
from .signatures import SIGNATURES, declare

__all__ = ["Library", "LayoutError", "Mirror", "address", "check_all", "check_mirror", "checked", "libc",
           "library_path", "load", "mirror", "mirrors", "open_path", "optional", "require"]

Library = ctypes.CDLL  # the type of an opened library, for annotations elsewhere

log = logging.getLogger(__name__)
_HERE = Path(__file__).resolve().parent
LIBRARIES = ("ops", "kernels", "host", "gguf")  # the folders of csrc/
GLOBAL_LIBRARIES = frozenset({"host"})  # opened with RTLD_GLOBAL: device plugins link against their functions
_lock = threading.RLock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_global: set[str] = set()  # loaded libraries whose symbols are global


def library_path(name: str) -> Path | None:
    """The built file of library ``name`` (``_<name>`` plus the extension suffix), if any."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _HERE / f"_{name}{suffix}"
        if path.is_file():
            return path
    return None


def load(name: str, global_symbols: bool = False) -> ctypes.CDLL | None:
    """The library ``name`` (``csrc/<name>``), opened once with its signatures declared and its
    structures' mirrors checked, or None when it was not built. ``global_symbols`` makes its
    exported symbols visible to libraries loaded after it (RTLD_GLOBAL; always so for
    ``GLOBAL_LIBRARIES``). LayoutError when a mirror disagrees with the library."""
    with _lock:
        if name in _loaded:
            lib = _loaded[name]
            if lib is not None and global_symbols and name not in _global:
                _make_global(name)
            return lib
        path = library_path(name)
        if path is None:
            _loaded[name] = None
            return None
        shared = global_symbols or name in GLOBAL_LIBRARIES
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | (os.RTLD_GLOBAL if shared else os.RTLD_LOCAL))
        declare(lib, SIGNATURES.get(name, {}))
        layouts.check_library(name, lib)  # raises before the library is handed to anyone
        _loaded[name] = lib
        if shared:
            _global.add(name)
        return lib


def _make_global(name: str) -> None:
    """Make the symbols of library ``name``, loaded with local ones, global (dlopen again with
    RTLD_NOLOAD | RTLD_GLOBAL: the same copy, promoted)."""
    ctypes.CDLL(str(library_path(name)), mode=os.RTLD_NOW | os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    _global.add(name)


def require(name: str, global_symbols: bool = False) -> ctypes.CDLL:
    """Like ``load`` but raises RuntimeError when the library was not built."""
    lib = load(name, global_symbols)
    if lib is None:
        raise RuntimeError(f"the native library llaisys._native._{name} is not built: reinstall llaisys with a "
                           f"C compiler on PATH (pip install -e . or pip install llaisys), sources in csrc/{name}/")
    return lib


def optional(name: str, missing: str) -> ctypes.CDLL | None:
    """``load(name)``, or None after logging the warning ``missing`` (what runs instead) when
    the library was not built. Callers keep what it returns (module-level ``_lib``)."""
    lib = load(name)
    if lib is None:
        log.warning("%s", missing)
    return lib


def open_path(path: "str | os.PathLike[str]", global_symbols: bool = False) -> ctypes.CDLL:
    """Open the shared library at ``path`` that is not llaisys's own (a device plugin): RTLD_NOW,
    local symbols unless ``global_symbols``. Not cached here (dlopen counts references; the
    caller keeps the handle, as the plugin loader keeps its plugins). OSError as dlopen reports it."""
    return ctypes.CDLL(os.fspath(path), mode=os.RTLD_NOW | (os.RTLD_GLOBAL if global_symbols else os.RTLD_LOCAL))


_libc: list = []  # [glibc with its signatures declared, or None], once looked up


def libc() -> ctypes.CDLL | None:
    """The C library with ``mallinfo2`` and ``malloc_trim`` declared (``signatures.LIBC``),
    opened once; None where it is not glibc 2.33 or later. Its ``struct mallinfo2`` mirror is
    checked against ``_host`` where that is built."""
    with _lock:
        if not _libc:
            lib = None
            try:
                lib = ctypes.CDLL("libc.so.6")
                lib.mallinfo2  # noqa: B018  (AttributeError before glibc 2.33)
            except (OSError, AttributeError):
                lib = None
            if lib is not None:
                load("host")  # checks the MallInfo2 mirror
                declare(lib, SIGNATURES["libc"])
            _libc.append(lib)
        return _libc[0]


def address(lib: ctypes.CDLL, function: str) -> int:
    """The address of ``function`` in ``lib`` (for a C caller of a function pointer)."""
    return ctypes.cast(getattr(lib, function), ctypes.c_void_p).value


def check_all() -> list[Mirror]:
    """Load every built library (checking the mirrors of each) and return the mirrors compared
    with their C layout (tests)."""
    for name in LIBRARIES:
        load(name)
    return checked()

