"""Loading device plugins: open the library, run ``InitPlugin``, check what it filled in, then
register its device type, backend and kernels (all or nothing).

The checks are those of PaddlePaddle's loader, so a plugin it loads loads here too. Refused,
each with a PluginError naming the library (as PaddlePaddle skips such a library):
  - a file that cannot be opened, or has no ``InitPlugin``;
  - ``device_type`` left NULL, or the version left unset (a plugin refusing the struct sizes);
  - a version below 0.1.1 (compared as major * 10000 + minor * 100 + patch);
  - an API PaddlePaddle requires left NULL (``abi.REQUIRED_APIS``; the events PaddlePaddle
    also requires have fallbacks here), and a copy direction with neither its synchronous nor
    its asynchronous API (PaddlePaddle would crash on the first such copy); missing memory
    stats, min chunk size or D2D copy run on fallbacks (``abi.FALLBACKS``);
  - a device type already registered; and (llaisys only) one it cannot write in a device
    string (letters, digits, '_', '-' only).
Logged as a warning, and loaded (a stricter check would refuse what PaddlePaddle runs): a
version from 0.1.1 on other than 0.1.x. Noted at INFO, once per plugin file and process: a
size field changed by ``InitPlugin`` (a plugin that memsets the whole table clears
``C_DeviceInterface.size``, as most of PaddleCustomDevice's backends do); neither host reads
them after ``InitPlugin``, so it is a habit, not a fault (``Plugin.notes``).
Before opening any plugin the native host library (``csrc/host``) is loaded with global
symbols: it defines ``profiler_add_runtime_trace_event`` / ``profiler_add_device_trace_event``,
which plugins may link against (``trace_event_counts()`` counts their calls), and loading it
checks the ctypes mirrors of the plugin ABI's structures (``backends/plugin/abi.py``) against
the C compiler's layout of the headers. Plugins are opened through ``llaisys._native.open_path``.

Unloading and exit are bounded: each plugin's devices are synchronized, then it is finalized,
each step on a daemon thread given ``LLAISYS_PLUGIN_EXIT_TIMEOUT`` seconds (default 5). A step
that does not return is logged (plugin and API) and left running; after a synchronize that
does not return, the plugin is not finalized.
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
from typing import Callable

from .. import _native
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
EXIT_TIMEOUT_VAR = "LLAISYS_PLUGIN_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT = 5.0  # seconds for each plugin's synchronize, and again for its finalize
HOST_FUNCTIONS = ("profiler_add_runtime_trace_event", "profiler_add_device_trace_event")


@dataclass
class Plugin:
    """A loaded device plugin."""

    path: str  # the library, as resolved
    device_type: DeviceType
    sub_device_type: str
    version: tuple[int, int, int]
    backend: PluginBackend
    kernels: list[PluginKernel] = field(default_factory=list, repr=False)
    library: _native.Library | None = field(default=None, repr=False)
    warnings: list[str] = field(default_factory=list)  # what the load logged as warnings
    notes: list[str] = field(default_factory=list)  # what it noted at INFO (PaddlePaddle habits)

    @property
    def name(self) -> str:
        """The device type name, as used in device strings (``custom_cpu:1``)."""
        return self.device_type.name


_lock = threading.RLock()
_by_name: dict[str, Plugin] = {}
_by_path: dict[str, Plugin] = {}
_failed: dict[tuple[str, float], str] = {}  # (path, mtime) -> error, so the env scan does not retry
_noted: set[str] = set()  # plugin files whose habits were logged already (unload and reload says nothing new)


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
    Then synchronize its devices and finalize it, each step bounded by ``exit_timeout()``.

    Tensors still on its devices must be gone. The library stays mapped in the process.
    """
    with _lock:
        plugin = get_plugin(name)
        _rollback(plugin.device_type)
        del _by_name[plugin.name]
        _by_path.pop(plugin.path, None)
    _finish(plugin, exit_timeout())


@atexit.register
def _shutdown() -> None:
    """At exit: let queued work (and host callbacks) finish, then finalize each plugin, never
    waiting more than ``exit_timeout()`` on a step."""
    timeout = exit_timeout()
    for plugin in loaded_plugins():
        _finish(plugin, timeout)


def exit_timeout() -> float:
    """Seconds to wait for a plugin's synchronize (and again for its finalize) at unload and
    exit: ``$LLAISYS_PLUGIN_EXIT_TIMEOUT`` or ``DEFAULT_EXIT_TIMEOUT``."""
    raw = os.environ.get(EXIT_TIMEOUT_VAR, "").strip()
    if not raw:
        return DEFAULT_EXIT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        log.warning("%s=%r is not a positive number of seconds; using %g", EXIT_TIMEOUT_VAR, raw,
                    DEFAULT_EXIT_TIMEOUT)
        return DEFAULT_EXIT_TIMEOUT
    return value


def _finish(plugin: Plugin, timeout: float) -> None:
    """Synchronize every device of ``plugin``, then close it (deinit_device, finalize), each
    step on a daemon thread bounded by ``timeout``; finalizing while work may still run on the
    device is worse than not finalizing, so a hung synchronize skips the close."""
    backend = plugin.backend
    api = "synchronize_device" if backend.has_api("synchronize_device") else "synchronize_stream"
    if not _bounded(plugin, api, lambda: _synchronize_all(backend), timeout):
        log.warning("plugin %s (%s): skipped deinit_device/finalize after %s did not return", plugin.path,
                    plugin.name, api)
        return
    _bounded(plugin, "deinit_device/finalize", backend.close, timeout)


def _synchronize_all(backend: PluginBackend) -> None:
    for index in range(backend.device_count()):
        backend.synchronize_device(index)


def _bounded(plugin: Plugin, api: str, step: Callable[[], None], timeout: float) -> bool:
    """Run ``step`` on a daemon thread; True when it returned (failing or not) within
    ``timeout`` seconds. A daemon thread left blocked in C does not keep the process alive."""
    done = threading.Event()

    def run() -> None:
        try:
            step()
        except PluginError as exc:
            log.warning("%s", exc)
        except Exception as exc:  # at exit nobody is left to catch it
            log.warning("plugin %s (%s): %s failed: %r", plugin.path, plugin.name, api, exc)
        finally:
            done.set()

    try:
        threading.Thread(target=run, name=f"llaisys-{plugin.name}-{api}", daemon=True).start()
    except RuntimeError as exc:  # the interpreter may refuse new threads this late
        log.warning("plugin %s (%s): %s not run: %s", plugin.path, plugin.name, api, exc)
        return False
    if done.wait(timeout):
        return True
    log.warning("plugin %s (%s): %s did not return within %g s; left it running (set %s to wait longer)",
                plugin.path, plugin.name, api, timeout, EXIT_TIMEOUT_VAR)
    return False


def trace_event_counts() -> dict[str, int]:
    """How many trace events plugins have handed to the host so far, by kind:
    ``{"runtime": n, "device": m}`` (calls of ``profiler_add_runtime_trace_event`` and
    ``profiler_add_device_trace_event``). Zeros when the native host library is not built."""
    host = _native.load("host")
    if host is None:
        return {"runtime": 0, "device": 0}
    runtime, device = ctypes.c_uint64(0), ctypes.c_uint64(0)
    host.llaisys_trace_event_counts(ctypes.byref(runtime), ctypes.byref(device))
    return {"runtime": runtime.value, "device": device.value}


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
    notes: list[str] = []  # warnings
    habits: list[str] = []  # logged at INFO
    lib = _open(real, shown)
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

    table = _filled_table(params, table, shown, habits)
    name, sub_type, version = _check_params(params, shown, notes)
    _check_apis(table, name, shown)
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
    for note in notes:
        log.warning("%s", note)
    if real not in _noted:
        _noted.add(real)
        for habit in habits:
            log.info("%s", habit)
    return Plugin(real, device_type, sub_type, version, backend, kernels, lib, notes, habits)


def _open(real: str, shown: str) -> _native.Library:
    """dlopen the plugin, after the host library whose functions it may link against."""
    host_ready = _load_host_functions()
    try:
        return _native.open_path(real)
    except OSError as exc:
        hint = ""
        if not host_ready and any(f in str(exc) for f in HOST_FUNCTIONS):
            hint = (" (the plugin calls host functions of llaisys._native._host, which is not built: reinstall "
                    "llaisys with a C compiler on PATH, pip install -e .)")
        raise PluginError(f"plugin {shown}: cannot be opened: {exc}{hint}") from None


def _load_host_functions() -> bool:
    """Load the native host library with global symbols (``_native`` always opens it so), so
    that plugins linking against its functions (``HOST_FUNCTIONS``) open; False when it is not
    built."""
    return _native.load("host", global_symbols=True) is not None


def _filled_table(params: abi.CustomRuntimeParams, ours: abi.C_DeviceInterface, shown: str,
                  notes: list[str]) -> abi.C_DeviceInterface:
    """The function table after InitPlugin: ours, or a copy of the one the plugin pointed to."""
    if not params.interface:
        raise PluginError(f"plugin {shown}: InitPlugin set the interface pointer to NULL; it must fill the "
                          "C_DeviceInterface the host passed")
    address = ctypes.addressof(params.interface.contents)
    table = ours if address == ctypes.addressof(ours) else abi.C_DeviceInterface.from_buffer_copy(
        ctypes.string_at(address, ctypes.sizeof(abi.C_DeviceInterface)))
    for struct, found, want in (("CustomRuntimeParams", params.size, ctypes.sizeof(abi.CustomRuntimeParams)),
                                ("C_DeviceInterface", table.size, ctypes.sizeof(abi.C_DeviceInterface))):
        if found != want:  # PaddlePaddle never reads them again either
            notes.append(f"plugin {shown}: InitPlugin changed {struct}.size from {want} to {found} (a memset of "
                         "the whole struct does that, as many PaddlePaddle plugins do); the host does not read "
                         "it after InitPlugin, so this is fine")
    return table


def _check_params(params: abi.CustomRuntimeParams, shown: str,
                  notes: list[str]) -> tuple[str, str, tuple[int, int, int]]:
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
    _check_version(version, name, shown, notes)
    if not name or ":" in name or not name.replace("_", "").replace("-", "").isalnum():
        raise PluginError(f"plugin {shown}: device_type {name!r} is not a valid name "
                          "(letters, digits, '_' or '-')")
    return name, sub_type, version


def _check_version(version: tuple[int, int, int], name: str, shown: str, notes: list[str]) -> None:
    """Refuse what PaddlePaddle refuses (below 0.1.1); note a version other than 0.1.x."""
    ours = (abi.MAJOR_VERSION, abi.MINOR_VERSION, abi.PATCH_VERSION)
    text, oldest = ".".join(map(str, version)), ".".join(map(str, ours))
    if abi.version_number(*version) < abi.version_number(*ours):
        raise PluginError(f"plugin {shown} ({name}): built for custom runtime version {text}, older than "
                          f"{oldest}, the oldest llaisys (and PaddlePaddle) loads: rebuild it against "
                          "include/llaisys/device_ext.h")
    if version[:2] != ours[:2]:
        notes.append(f"plugin {shown} ({name}): reports custom runtime version {text}; llaisys implements "
                     f"{ours[0]}.{ours[1]}.x and uses the plugin as such (PaddlePaddle loads any version from "
                     f"{oldest} on)")


def _check_apis(table: abi.C_DeviceInterface, name: str, shown: str) -> None:
    """Refuse a plugin without an API llaisys cannot run without (``abi.REQUIRED_APIS``, and
    each copy direction either synchronous or asynchronous)."""
    missing = [api for api in abi.REQUIRED_APIS if not getattr(table, api)]
    missing += [f"{api} (or {twin})" for api, twin in abi.COPY_APIS.items()
                if not getattr(table, api) and not getattr(table, twin) and api != "memory_copy_d2d"]
    if missing:
        raise PluginError(f"plugin {shown} ({name}): required API(s) missing: {', '.join(missing)}")


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
