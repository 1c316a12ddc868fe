"""The one native boundary: only ``llaisys._native`` opens shared libraries, and every ctypes
mirror of a C structure is checked against the layout its library exports when it loads."""
from __future__ import annotations

import ast
import ctypes
from pathlib import Path

import pytest

from llaisys import _native
from llaisys._native import layouts, structs
from llaisys.backends.plugin import abi  # noqa: F401  (registers the plugin ABI's mirrors)

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "llaisys"
NATIVE = PACKAGE / "_native"
OPENERS = {"CDLL", "PyDLL", "WinDLL", "OleDLL", "LoadLibrary", "dlopen"}  # ctypes' ways to open a library

built = pytest.mark.skipif(any(_native.library_path(n) is None for n in ("ops", "kernels", "host")),
                           reason="the native libraries are not built: python setup.py build_ext --inplace")


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if NATIVE not in p.parents)


def _structure_classes() -> set[str]:
    """``module.Class`` of every class of the source tree that derives from ctypes.Structure."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                    (isinstance(b, ast.Attribute) and b.attr == "Structure") or (isinstance(b, ast.Name)
                                                                                 and b.id == "Structure")
                    for b in node.bases):
                found.add(f"{module}.{node.name}")
    return found


def test_no_module_outside_native_opens_a_library():
    opened = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            via_cdll = isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Attribute) and fn.value.attr in (
                "cdll", "pydll")  # ctypes.cdll.LoadLibrary(...), ctypes.cdll.libc
            if name in OPENERS or via_cdll:
                opened.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not opened, "libraries opened outside llaisys._native (use _native.load / open_path):\n" + "\n".join(opened)


def test_no_module_outside_native_declares_signatures():
    declared = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign | ast.AnnAssign) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr in ("argtypes", "restype"):
                        declared.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not declared, "signatures declared outside llaisys._native.signatures:\n" + "\n".join(declared)


def test_every_structure_is_a_registered_mirror():
    """Each ctypes.Structure of the source tree is registered, so none goes unchecked."""
    registered = {f"{m.cls.__module__}.{m.cls.__qualname__}" for m in _native.mirrors()}
    assert _structure_classes() == registered
    assert len(registered) >= 30
    assert len({(m.library, m.c_name) for m in _native.mirrors()}) == len(registered)  # one mirror per C struct


@built
def test_every_mirror_is_checked_against_its_library():
    checked = _native.check_all()
    assert len(checked) >= 30
    unchecked = [m for m in _native.mirrors() if m not in checked and not m.optional]
    assert not unchecked, f"mirrors the libraries do not describe: {unchecked}"
    by_library = {lib: sum(m.library == lib for m in checked) for lib in ("ops", "kernels", "host")}
    assert by_library["ops"] >= 18 and by_library["kernels"] >= 4 and by_library["host"] >= 8, by_library
    assert abi.C_DeviceInterface in {m.cls for m in checked}


@built
def test_the_layout_export_describes_sizes_and_fields():
    lib = _native.require("ops")
    size, fields = layouts.c_layout("ops", lib, "lo_norm_args")
    assert size == ctypes.sizeof(structs.NormArgs)
    assert [f.name for f in fields] == [name for name, _ in structs.NormArgs._fields_]
    assert fields[-1].size == 8  # double eps
    assert layouts.c_layout("ops", lib, "no_such_struct") is None


class _Moved(ctypes.Structure):
    """lo_norm_args with its last field (eps) moved to the front."""

    _fields_ = [structs.NormArgs._fields_[-1], *structs.NormArgs._fields_[:-1]]


class _NarrowFactor(ctypes.Structure):
    """lo_scale_args with factor a double: the padding keeps the size, the field's size differs."""

    _fields_ = [*structs.ScaleArgs._fields_[:-1], ("factor", ctypes.c_double)]


class _Longer(structs.SwigluArgs):
    """A subclass of a real mirror with a field the C structure lacks."""

    _fields_ = [("extra", ctypes.c_int64)]


@built
def test_a_moved_field_fails_the_check_naming_it():
    lib = _native.require("ops")
    with pytest.raises(_native.LayoutError) as err:
        _native.check_mirror(_Moved, "ops", "lo_norm_args", lib)
    message = str(err.value)
    assert "lo_norm_args" in message and "_Moved" in message
    assert "field 'eps' at offset 0 (8 bytes), C has it at offset 80 (8 bytes)" in message
    assert "field 'out' at offset 8 (8 bytes), C has it at offset 0 (8 bytes)" in message


@built
def test_a_field_of_the_wrong_size_fails_though_the_size_matches():
    assert ctypes.sizeof(_NarrowFactor) == ctypes.sizeof(structs.ScaleArgs)
    with pytest.raises(_native.LayoutError, match=r"field 'factor' at offset 48 \(8 bytes\), C has it at offset 48 "
                                                  r"\(4 bytes\)"):
        _native.check_mirror(_NarrowFactor, "ops", "lo_scale_args", _native.require("ops"))


@built
def test_an_extra_field_and_a_wrong_size_are_named():
    with pytest.raises(_native.LayoutError) as err:
        _native.check_mirror(_Longer, "ops", "lo_swiglu_args", _native.require("ops"))
    message = str(err.value)
    assert "field 'extra' (offset 64) is not a field of the C structure" in message
    assert "size 72 bytes, C has 64" in message


@built
def test_a_wrong_mirror_registered_after_load_is_refused_at_once():
    _native.require("ops")
    before = len(_native.mirrors())
    with pytest.raises(_native.LayoutError, match="lo_norm_args"):
        _native.mirror("ops", "lo_norm_args")(_Moved)
    assert len(_native.mirrors()) == before  # not registered


@built
def test_a_structure_the_library_does_not_describe_is_an_error():
    with pytest.raises(_native.LayoutError, match=r"does not describe C structure lo_nothing.*layouts\.c"):
        _native.check_mirror(structs.NormArgs, "ops", "lo_nothing", _native.require("ops"))


@built
def test_libraries_are_loaded_once_with_their_signatures():
    ops = _native.require("ops")
    assert _native.load("ops") is ops
    assert ops.llaisys_ops_run.restype is ctypes.c_int
    assert _native.require("kernels").llaisys_peak_read.restype is ctypes.c_uint64
    host = _native.load("host", global_symbols=True)
    assert hasattr(ctypes.CDLL(None), "profiler_add_runtime_trace_event")  # its symbols are global
    assert host is _native.load("host")


def test_a_missing_library_says_how_to_build_it(monkeypatch):
    monkeypatch.setattr(_native, "library_path", lambda name: None)
    assert _native.load("nothing") is None
    with pytest.raises(RuntimeError, match=r"_native\._nothing is not built.*csrc/nothing"):
        _native.require("nothing")
