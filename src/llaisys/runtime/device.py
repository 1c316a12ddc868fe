"""Device types and device names ("cpu", "cpu:0", "custom_cpu:1")."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class DeviceType:
    """A kind of device. CPU=0 and NVIDIA=1 are built in; plugins add types by name."""

    name: str
    id: int

    def __str__(self) -> str:
        return self.name

    # Filled in below; class attributes for convenience (DeviceType.CPU).
    CPU = None  # type: ignore[assignment]
    NVIDIA = None  # type: ignore[assignment]


_types_lock = threading.Lock()
_types_by_name: dict[str, DeviceType] = {}


def register_device_type(name: str) -> DeviceType:
    """Add a device type named ``name`` (lower-cased) and return it.

    Raises ValueError when a type of that name exists already.
    """
    key = name.lower()
    if not key or ":" in key or not key.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"invalid device type name {name!r}; expected letters, digits, '_' or '-'")
    with _types_lock:
        if key in _types_by_name:
            raise ValueError(f"device type {key!r} is already registered")
        # max + 1, not len: ids stay unique after a plugin's type is removed again
        dt = DeviceType(key, max((t.id for t in _types_by_name.values()), default=-1) + 1)
        _types_by_name[key] = dt
        return dt


def unregister_device_type(name: str) -> None:
    """Remove a custom device type (used when a plugin fails after registering)."""
    key = name.lower()
    if key in ("cpu", "nvidia"):
        raise ValueError(f"built-in device type {key!r} cannot be removed")
    with _types_lock:
        _types_by_name.pop(key, None)
        _device_cache.clear()


def device_types() -> list[DeviceType]:
    """All device types known now, built-in first."""
    return sorted(_types_by_name.values(), key=lambda t: t.id)


# The runtime does not load plugins (that layer sits above it), but its errors say how to.
PLUGIN_HINT = ("A device plugin adds device types: load its library with `--plugin PATH` (llaisys commands), "
               "a folder of lib*.so in LLAISYS_PLUGIN_PATH, or llaisys.load_plugin(path)")

_resolvers: list[Callable[[str], None]] = []


def add_device_type_resolver(resolver: Callable[[str], None]) -> None:
    """Call ``resolver(name)`` when an unknown device type is asked for, before giving up; it
    may register the type (the plugin loader does, from ``LLAISYS_PLUGIN_PATH``)."""
    if resolver not in _resolvers:
        _resolvers.append(resolver)


def lookup_device_type(name: str) -> DeviceType:
    """The device type called ``name``; the error lists the known ones."""
    found = _types_by_name.get(name.lower())
    if found is None and _resolvers:
        for resolver in list(_resolvers):
            resolver(name)
        found = _types_by_name.get(name.lower())
    if found is None:
        known = ", ".join(t.name for t in device_types())
        raise ValueError(f"unknown device type {name!r}; known device types: {known}. {PLUGIN_HINT}")
    return found


DeviceType.CPU = register_device_type("cpu")  # id 0
DeviceType.NVIDIA = register_device_type("nvidia")  # id 1


@dataclass(frozen=True)
class Device:
    """One device: a type and an index (``cpu:0``)."""

    type: DeviceType
    index: int = 0

    def __str__(self) -> str:
        return f"{self.type.name}:{self.index}"

    def __repr__(self) -> str:
        return f"Device('{self}')"

    @property
    def is_cpu(self) -> bool:
        return self.type is DeviceType.CPU


_device_cache: dict[object, Device] = {}


def as_device(value: "Device | str | DeviceType | None" = None) -> Device:
    """Parse ``"cpu"``, ``"cpu:0"``, ``"custom_cpu:1"``, a DeviceType or a Device.

    ``None`` means the calling thread's current device.
    """
    if isinstance(value, Device):
        return value
    if value is None:
        from .context import current_device

        return current_device()
    cached = _device_cache.get(value)
    if cached is not None:
        return cached
    if isinstance(value, DeviceType):
        dev = Device(value, 0)
    elif isinstance(value, str):
        name, _, index = value.partition(":")
        try:
            idx = int(index) if index else 0
        except ValueError:
            raise ValueError(f"bad device {value!r}; expected 'type' or 'type:index', e.g. 'cpu:0'") from None
        if idx < 0:
            raise ValueError(f"bad device {value!r}; the index must be >= 0")
        dev = Device(lookup_device_type(name), idx)
    else:
        raise TypeError(f"expected a device name, DeviceType or Device, got {type(value).__name__}")
    _device_cache[value] = dev
    return dev
