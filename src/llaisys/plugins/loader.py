"""Loading device plugins: open the library, run ``InitPlugin``, check what it filled in, then
register its device type, backend and kernels (all or nothing).

The checks follow the host side of the custom-runtime ABI: both size fields set and the table
zeroed before ``InitPlugin``; a missing ``InitPlugin`` or a NULL ``device_type`` reported; the
version must be 0.1.x with x >= 1; the device type must be new; the required APIs
(``abi.REQUIRED_APIS``) must be present. Each failure raises PluginError naming the library.
"""
from __future__ import annotations

import atexit
import ctypes
import glob
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..kernels.registry import unregister_kernels
from ..runtime.backends import register_backend, unregister_backend
from ..runtime.device import DeviceType, device_types, register_device_type, unregister_device_type
from ..runtime.runtime import drop_runtimes
from ..backends.plugin import abi
from ..backends.plugin.backend import PluginBackend
from ..backends.plugin.errors import PluginError
from .kernels import PluginKernel, collect_kernels, install_kernels

log = logging.getLogger(__name__)

PATH_VARS = ("LLAISYS_PLUGIN_PATH", "CUSTOM_DEVICE_ROOT")


@dataclass
class Plugin:
    """A loaded device plugin."""

    path: str  # the library, as resolved
    device_type: DeviceType
    sub_device_type: str
    version: tuple[int, int, int]
    backend: PluginBackend
    kernels: list[PluginKernel] = field(default_factory=list, repr=False)
    library: ctypes.CDLL | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """The device type name, as used in device strings (``custom_cpu:1``)."""
        return self.device_type.name


_lock = threading.RLock()
_by_name: dict[str, Plugin] = {}
_by_path: dict[str, Plugin] = {}
_failed: dict[tuple[str, float], str] = {}  # (path, mtime) -> error, so the env scan does not retry


def loaded_plugins() -> list[Plugin]:
    """The plugins loaded so far, in load order."""
    with _lock:
        return list(_by_name.values())


def get_plugin(name: str) -> Plugin:
    """The loaded plugin serving device type ``name``."""
    with _lock:
        found = _by_name.get(name.lower())
    if found is None:
        loaded = ", ".join(_by_name) or "none"
        raise ValueError(f"no plugin serves device type {name!r}; loaded plugins: {loaded}")
    return found


def load_plugin(path: "str | os.PathLike[str]") -> Plugin:
    """Load the device plugin at ``path`` and make its device type usable everywhere.

    Loading the same file again returns the plugin already loaded. Raises PluginError (naming
    the library and the problem) when the file is not a usable plugin; nothing stays
    registered then.
    """
    shown = os.fspath(path)
    if not os.path.isfile(shown):
        raise PluginError(f"plugin {shown}: no such file")
    real = os.path.realpath(shown)
    with _lock:
        if real in _by_path:
            return _by_path[real]
        plugin = _load(real, shown)
        _by_path[real] = plugin
        _by_name[plugin.name] = plugin
    log.info("loaded plugin %s: device type %s (%s), %d device(s), %d kernel(s)", shown, plugin.name,
             plugin.sub_device_type, plugin.backend.device_count(), len(plugin.kernels))
    return plugin


def unload_plugin(name: str) -> None:
    """Forget the plugin serving device type ``name``: its kernels, backend, runtimes and type.

    Tensors still on its devices must be gone. The library stays mapped in the process.
    """
    with _lock:
        plugin = get_plugin(name)
        _rollback(plugin.device_type)
        plugin.backend.close()
        del _by_name[plugin.name]
        _by_path.pop(plugin.path, None)


@atexit.register
def _shutdown() -> None:
    """At exit: let queued work (and host callbacks) finish, then finalize each plugin."""
    for plugin in loaded_plugins():
        try:
            for index in range(plugin.backend.device_count()):
                plugin.backend.synchronize_device(index)
        except PluginError as exc:
            log.warning("%s", exc)
        plugin.backend.close()


def plugin_search_dirs() -> list[Path]:
    """The folders named by ``LLAISYS_PLUGIN_PATH`` then ``CUSTOM_DEVICE_ROOT`` (each a
    ``os.pathsep``-separated list)."""
    dirs: list[Path] = []
    for var in PATH_VARS:
        for part in os.environ.get(var, "").split(os.pathsep):
            if part.strip() and Path(part) not in dirs:
                dirs.append(Path(part))
    return dirs


def load_plugins_from_env(strict: bool = False) -> list[Plugin]:
    """Load every ``lib*.so`` in the folders of ``plugin_search_dirs()``; returns the plugins
    loaded (or already loaded) from there.

    A library that fails is logged and skipped (and not tried again until it changes);
    with ``strict`` the first failure raises PluginError instead.
    """
    plugins: list[Plugin] = []
    for folder in plugin_search_dirs():
        if not folder.is_dir():
            log.warning("plugin folder %s (from %s) does not exist", folder, "/".join(PATH_VARS))
            continue
        for lib in sorted(glob.glob(os.path.join(glob.escape(str(folder)), "lib*.so"))):
            try:
                key = (os.path.realpath(lib), os.path.getmtime(lib))
            except OSError:
                continue
            if key in _failed and not strict:
                continue
            try:
                plugins.append(load_plugin(lib))
            except PluginError as exc:
                if strict:
                    raise
                _failed[key] = str(exc)
                log.warning("skipped %s", exc)
    return plugins


def _load(real: str, shown: str) -> Plugin:
    try:
        lib = ctypes.CDLL(real, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as exc:
        raise PluginError(f"plugin {shown}: cannot be opened: {exc}") from None
    try:
        init = abi.InitPluginFn(("InitPlugin", lib))
    except AttributeError:
        raise PluginError(f"plugin {shown}: does not export InitPlugin; a device plugin defines "
                          "`void InitPlugin(CustomRuntimeParams *params)` (include/llaisys/device_ext.h)") from None

    table = abi.C_DeviceInterface()  # zeroed by ctypes
    table.size = ctypes.sizeof(abi.C_DeviceInterface)
    params = abi.CustomRuntimeParams()
    params.size = ctypes.sizeof(abi.CustomRuntimeParams)
    params.interface = ctypes.pointer(table)
    init(ctypes.byref(params))

    table = _filled_table(params, table, shown)
    name, sub_type, version = _check_params(params, shown)
    missing = [api for api in abi.REQUIRED_APIS if not getattr(table, api)]
    if missing:
        raise PluginError(f"plugin {shown} ({name}): required API(s) missing: {', '.join(missing)}")
    _check_new_type(name, shown)

    device_type = register_device_type(name)
    try:
        backend = PluginBackend(shown, device_type, table)
        try:
            register_backend(backend)
            kernels = collect_kernels(lib, backend)
            install_kernels(kernels, backend)
        except BaseException:
            backend.close()
            raise
    except BaseException as exc:
        _rollback(device_type)
        if isinstance(exc, PluginError):
            raise
        raise PluginError(f"plugin {shown} ({name}): {type(exc).__name__}: {exc}") from exc
    return Plugin(real, device_type, sub_type, version, backend, kernels, lib)


def _filled_table(params: abi.CustomRuntimeParams, ours: abi.C_DeviceInterface, shown: str) -> abi.C_DeviceInterface:
    """The function table after InitPlugin: ours, or a copy of the one the plugin pointed to."""
    if params.size != ctypes.sizeof(abi.CustomRuntimeParams):
        raise PluginError(f"plugin {shown}: InitPlugin changed CustomRuntimeParams.size to {params.size} "
                          f"(it must stay {ctypes.sizeof(abi.CustomRuntimeParams)})")
    if not params.interface:
        raise PluginError(f"plugin {shown}: InitPlugin set the interface pointer to NULL")
    address = ctypes.addressof(params.interface.contents)
    table = ours if address == ctypes.addressof(ours) else abi.C_DeviceInterface.from_buffer_copy(
        ctypes.string_at(address, ctypes.sizeof(abi.C_DeviceInterface)))
    if table.size != ctypes.sizeof(abi.C_DeviceInterface):
        raise PluginError(f"plugin {shown}: C_DeviceInterface.size is {table.size} after InitPlugin "
                          f"(it must stay {ctypes.sizeof(abi.C_DeviceInterface)})")
    return table


def _check_params(params: abi.CustomRuntimeParams, shown: str) -> tuple[str, str, tuple[int, int, int]]:
    """The device type, sub-type and version InitPlugin reported, checked."""
    version = (params.version.major, params.version.minor, params.version.patch)
    if version == (0, 0, 0):
        raise PluginError(
            f"plugin {shown}: InitPlugin did not set the runtime version; it probably refused the struct sizes "
            f"llaisys passed (CustomRuntimeParams {ctypes.sizeof(abi.CustomRuntimeParams)} bytes, "
            f"C_DeviceInterface {ctypes.sizeof(abi.C_DeviceInterface)} bytes): rebuild it against "
            "include/llaisys/device_ext.h")
    if params.device_type is None:
        raise PluginError(f"plugin {shown}: InitPlugin left device_type NULL; it must name the device type, "
                          "e.g. params->device_type = \"custom_cpu\"")
    try:
        name = params.device_type.decode("ascii").lower()
    except UnicodeDecodeError:
        raise PluginError(f"plugin {shown}: device_type {params.device_type!r} is not ASCII") from None
    sub_type = (params.sub_device_type or b"").decode("utf-8", "replace")
    want = (abi.MAJOR_VERSION, abi.MINOR_VERSION)
    if version[:2] != want or version[2] < abi.PATCH_VERSION:
        raise PluginError(
            f"plugin {shown} ({name}): built for custom runtime version {'.'.join(map(str, version))}; "
            f"llaisys supports {want[0]}.{want[1]}.x with x >= {abi.PATCH_VERSION}")
    if not name or ":" in name or not name.replace("_", "").replace("-", "").isalnum():
        raise PluginError(f"plugin {shown}: device_type {name!r} is not a valid name "
                          "(letters, digits, '_' or '-')")
    return name, sub_type, version


def _check_new_type(name: str, shown: str) -> None:
    if any(t.name == name for t in device_types()):
        owner = _by_name.get(name)
        by = f"plugin {owner.path}" if owner else "llaisys itself"
        raise PluginError(f"plugin {shown}: device type {name!r} is already registered by {by}; "
                          "each plugin needs its own device type")


def _rollback(device_type: DeviceType) -> None:
    """Remove everything registered under ``device_type``."""
    unregister_kernels(device_type)
    unregister_backend(device_type)
    drop_runtimes(device_type.name)
    unregister_device_type(device_type.name)
