"""The native libraries built from ``csrc/`` at install time, loaded with ctypes.

``load("host")`` returns the ``ctypes.CDLL`` of ``csrc/host`` or None when it was not built
(no C compiler at install time); ``require`` raises an error that says how to build it.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)
_HERE = Path(__file__).resolve().parent
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def library_path(name: str) -> Path | None:
    """The built file of library ``name`` (``_<name>`` plus the extension suffix), if any."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _HERE / f"_{name}{suffix}"
        if path.is_file():
            return path
    return None


def load(name: str, global_symbols: bool = False) -> ctypes.CDLL | None:
    """The loaded library ``name``, or None when it was not built. ``global_symbols`` makes
    its exported symbols visible to libraries loaded after it (RTLD_GLOBAL)."""
    with _lock:
        if name not in _loaded:
            path = library_path(name)
            mode = os.RTLD_NOW | (os.RTLD_GLOBAL if global_symbols else os.RTLD_LOCAL)
            _loaded[name] = ctypes.CDLL(str(path), mode=mode) if path else None
        return _loaded[name]


def require(name: str, global_symbols: bool = False) -> ctypes.CDLL:
    """Like ``load`` but raises RuntimeError when the library was not built."""
    lib = load(name, global_symbols)
    if lib is None:
        raise RuntimeError(f"the native library llaisys._native._{name} is not built: reinstall llaisys with a "
                           f"C compiler on PATH (pip install -e . or pip install llaisys), sources in csrc/{name}/")
    return lib


Signatures = dict  # function name -> (argtypes list, restype)


def declared(name: str, signatures: Signatures, missing: str) -> ctypes.CDLL | None:
    """``load(name)`` with each function of ``signatures`` given its argument and result types,
    or None (after logging the warning ``missing``) when the library was not built."""
    lib = load(name)
    if lib is None:
        log.warning("%s", missing)
        return None
    for function, (argtypes, restype) in signatures.items():
        fn = getattr(lib, function)
        fn.argtypes, fn.restype = argtypes, restype
    return lib
