"""Which backend serves which device type: built-ins found by name and imported lazily,
plugins registered when loaded."""
from __future__ import annotations

import importlib
import threading

from .device import PLUGIN_HINT, DeviceType
from .interface import DeviceBackend

_BUILTIN_MODULES = {"cpu": "llaisys.backends.cpu", "nvidia": "llaisys.backends.nvidia"}

_lock = threading.Lock()
_backends: dict[str, DeviceBackend] = {}


def register_backend(backend: DeviceBackend) -> None:
    """Make ``backend`` serve its ``device_type``. Raises ValueError if one serves it already."""
    name = backend.device_type.name
    with _lock:
        if name in _backends:
            raise ValueError(f"a backend for device type {name!r} is already registered ({_backends[name].origin})")
        _backends[name] = backend


def unregister_backend(device_type: DeviceType) -> None:
    """Forget the backend of ``device_type`` (its runtimes must be gone)."""
    with _lock:
        _backends.pop(device_type.name, None)


def get_backend(device_type: DeviceType) -> DeviceBackend:
    """The backend for ``device_type``, importing a built-in one on first use."""
    name = device_type.name
    backend = _backends.get(name)
    if backend is not None:
        return backend
    module_name = _BUILTIN_MODULES.get(name)
    if module_name is None:
        raise ValueError(f"no backend serves device type {name!r}; available: {', '.join(available_backends())}. "
                         f"{PLUGIN_HINT}")
    backend = _create_builtin(name, module_name)
    with _lock:
        return _backends.setdefault(name, backend)


def _create_builtin(name: str, module_name: str) -> DeviceBackend:
    """The built-in backend of device type ``name``; a ValueError says why it cannot be had."""
    available = ", ".join(available_backends())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise ValueError(f"the {name} backend cannot start: it needs the module {exc.name!r}, which is "
                             f"not installed; available: {available}") from exc
        raise ValueError(f"the {name} backend is not available in this build: the device type is reserved, but "
                         f"no backend serves it yet; run on the CPU or on a plugin's device (available: "
                         f"{available}). {PLUGIN_HINT}") from None
    try:
        return module.create_backend()
    except Exception as exc:
        raise ValueError(f"the {name} backend failed to start ({type(exc).__name__}: {exc}); "
                         f"available: {available}") from exc


def available_backends() -> list[str]:
    """Names of device types with a loaded backend (the CPU is always one)."""
    with _lock:
        return sorted(set(_backends) | {"cpu"})
