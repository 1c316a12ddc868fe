"""The ctypes mirrors of C structures, and their check against the layouts the C side exports.

A mirror is a ``ctypes.Structure`` registered with ``mirror(library, c_name)``: it stands for
structure ``c_name`` of native library ``library``, field for field, in order, with the C
names. Each library that has mirrors exports
``int64_t llaisys_<library>_layout(const char *type, int64_t i, const char **field, int64_t *size)``
(``csrc/<library>/layouts.c`` over ``csrc/common/layout.h``): the size of a structure, and the
name, offset and size of each of its fields as the C compiler laid them out. When
``llaisys._native`` loads a library it compares every mirror of it with that (a mirror
registered later is compared when it registers), once; a mismatch raises ``LayoutError``
naming the structure, the field and both values. Nothing is checked per call.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Callable, TypeVar

S = TypeVar("S", bound=type)


class LayoutError(RuntimeError):
    """A ctypes mirror disagrees with the C structure it mirrors (size, a field's offset or
    size, a field missing on either side), or the library does not describe the structure."""


@dataclass(frozen=True, slots=True)
class Mirror:
    """``cls`` mirrors C structure ``c_name`` of native library ``library`` (``_<library>``).
    ``optional``: the library may not describe it (a C library's own structure, which only
    some C libraries have); it is then left unchecked."""

    cls: type
    library: str
    c_name: str
    optional: bool = False


@dataclass(frozen=True, slots=True)
class CField:
    """One field of a C structure as the library was compiled: name, byte offset, byte size."""

    name: str
    offset: int
    size: int


_lock = threading.Lock()
_mirrors: list[Mirror] = []
_libraries: dict[str, ctypes.CDLL] = {}  # loaded libraries whose mirrors have been checked
_checked: set[Mirror] = set()  # mirrors compared with a layout the C side exported


def mirror(library: str, c_name: str, optional: bool = False) -> Callable[[S], S]:
    """Class decorator: register a ctypes Structure as the mirror of C structure ``c_name`` of
    native library ``library``; checked when the library loads (now, if it is loaded)."""

    def register(cls: S) -> S:
        entry = Mirror(cls, library, c_name, optional)
        with _lock:
            lib = _libraries.get(library)
            if lib is not None:
                _check(entry, lib)
            _mirrors.append(entry)
        return cls

    return register


def mirrors() -> list[Mirror]:
    """Every registered mirror, in registration order."""
    with _lock:
        return list(_mirrors)


def checked() -> list[Mirror]:
    """The mirrors compared with their C layout so far (their libraries are loaded)."""
    with _lock:
        return [m for m in _mirrors if m in _checked]


def check_library(name: str, lib: ctypes.CDLL) -> int:
    """Compare every mirror of library ``name`` (just loaded as ``lib``) with its C layout, and
    check mirrors registered from now on as they come. Returns how many were compared;
    LayoutError on the first structure that disagrees."""
    with _lock:
        count = 0
        for entry in _mirrors:
            if entry.library == name:
                count += _check(entry, lib)
        _libraries[name] = lib
        return count


def c_layout(name: str, lib: ctypes.CDLL, c_name: str) -> tuple[int, list[CField]] | None:
    """(size, fields in declaration order) of C structure ``c_name`` as library ``name``
    describes it, or None when it does not know the structure. LayoutError when the library
    exports no layout function (built from sources older than its mirrors)."""
    fn = getattr(lib, f"llaisys_{name}_layout", None)
    if fn is None:
        raise LayoutError(f"llaisys._native._{name} exports no llaisys_{name}_layout, so the layouts of its "
                          f"structures cannot be checked: it was built from older sources; rebuild it "
                          f"(pip install -e . or python setup.py build_ext --inplace)")
    fn.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int64)]
    fn.restype = ctypes.c_int64
    key = c_name.encode()
    size = fn(key, -1, None, None)
    if size < 0:
        return None
    fields, field, field_size = [], ctypes.c_char_p(), ctypes.c_int64()
    while (offset := fn(key, len(fields), ctypes.byref(field), ctypes.byref(field_size))) >= 0:
        fields.append(CField(field.value.decode(), offset, field_size.value))
    return size, fields


def mirror_fields(cls: type) -> list[CField]:
    """The fields of ctypes Structure ``cls`` (its bases' first, as ctypes lays them out)."""
    names = [name for base in reversed(cls.__mro__) for name, *_ in base.__dict__.get("_fields_", ())]
    return [CField(name, getattr(cls, name).offset, getattr(cls, name).size) for name in names]


def compare(cls: type, c_name: str, library: str, layout: tuple[int, list[CField]]) -> None:
    """Raise LayoutError listing every difference between mirror ``cls`` and the C layout
    (size, fields) of ``c_name`` in ``library``: each names the field and both values."""
    size, c_fields = layout
    ours = mirror_fields(cls)
    theirs = {f.name: f for f in c_fields}
    problems = []
    for f in ours:
        c = theirs.get(f.name)
        if c is None:
            problems.append(f"field {f.name!r} (offset {f.offset}) is not a field of the C structure")
        elif (f.offset, f.size) != (c.offset, c.size):
            problems.append(f"field {f.name!r} at offset {f.offset} ({f.size} bytes), C has it at offset "
                            f"{c.offset} ({c.size} bytes)")
    named = {f.name for f in ours}
    problems += [f"C field {c.name!r} (offset {c.offset}) has no field in the mirror" for c in c_fields
                 if c.name not in named]
    if ctypes.sizeof(cls) != size:
        problems.append(f"size {ctypes.sizeof(cls)} bytes, C has {size}")
    if problems:
        raise LayoutError(f"ctypes mirror {cls.__module__}.{cls.__qualname__} of C structure {c_name} "
                          f"(llaisys._native._{library}) disagrees with it: " + "; ".join(problems)
                          + ". Fix the mirror, or rebuild the library if its sources changed")


def check_mirror(cls: type, library: str, c_name: str, lib: ctypes.CDLL) -> None:
    """Compare ``cls`` with C structure ``c_name`` of ``lib`` (library ``library``); raises
    LayoutError on any difference, or when the library does not describe the structure."""
    layout = c_layout(library, lib, c_name)
    if layout is None:
        raise LayoutError(f"llaisys._native._{library} does not describe C structure {c_name}, which "
                          f"{cls.__module__}.{cls.__qualname__} mirrors: add it to csrc/{library}/layouts.c")
    compare(cls, c_name, library, layout)


def _check(entry: Mirror, lib: ctypes.CDLL) -> int:
    """Check one mirror (the lock held); 1 when compared, 0 when an optional one is not described."""
    if entry.optional and c_layout(entry.library, lib, entry.c_name) is None:
        return 0
    check_mirror(entry.cls, entry.library, entry.c_name, lib)
    _checked.add(entry)
    return 1
