"""Device plugins: shared libraries implementing the custom-runtime C ABI
(``include/llaisys/device_ext.h``, binary-compatible with PaddlePaddle's 0.1.x plugins) and,
optionally, kernels through ``include/llaisys/kernel_ext.h``.

``load_plugin(path)`` loads one. Plugins in the folders of ``LLAISYS_PLUGIN_PATH`` (or
``CUSTOM_DEVICE_ROOT``) load on demand: the first time a device type llaisys does not know is
asked for (``Tensor.empty(..., device="custom_cpu:1")``), every ``lib*.so`` there is loaded
(``load_plugins_from_env``). Importing llaisys loads nothing.

Unloading a plugin and leaving the process wait at most ``LLAISYS_PLUGIN_EXIT_TIMEOUT``
seconds (default 5) for each plugin's synchronize and finalize, so a plugin that hangs cannot
hang the exit. ``trace_event_counts()`` counts the trace events plugins hand to the host.

This module stays light; the loader is imported on first use.
"""
from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from ..runtime.device import add_device_type_resolver
from ..backends.plugin.errors import PluginAPIError, PluginError, PluginOutOfMemoryError

if TYPE_CHECKING:
    from .loader import Plugin

__all__ = ["PluginAPIError", "PluginError", "PluginOutOfMemoryError", "get_plugin", "include_dir", "load_plugin",
           "load_plugins_from_env", "loaded_plugins", "trace_event_counts", "unload_plugin"]


def load_plugin(path: "str | os.PathLike[str]") -> "Plugin":
    """Load the device plugin library at ``path``; its device type becomes usable everywhere a
    device is named. Raises PluginError naming the library and the problem."""
    from .loader import load_plugin as load

    return load(path)


def load_plugins_from_env(strict: bool = False) -> "list[Plugin]":
    """Load every ``lib*.so`` in the folders of ``LLAISYS_PLUGIN_PATH`` and ``CUSTOM_DEVICE_ROOT``.
    Failures are logged and skipped unless ``strict``."""
    from .loader import load_plugins_from_env as load

    return load(strict)


def loaded_plugins() -> "list[Plugin]":
    """The plugins loaded so far."""
    from .loader import loaded_plugins as plugins

    return plugins()


def get_plugin(name: str) -> "Plugin":
    """The loaded plugin serving device type ``name``."""
    from .loader import get_plugin as get

    return get(name)


def unload_plugin(name: str) -> None:
    """Forget the plugin serving device type ``name``, then synchronize and finalize it, each
    step bounded by ``LLAISYS_PLUGIN_EXIT_TIMEOUT`` (the library stays mapped)."""
    from .loader import unload_plugin as unload

    unload(name)


def trace_event_counts() -> dict[str, int]:
    """How many trace events plugins have handed to the host through
    ``profiler_add_runtime_trace_event`` and ``profiler_add_device_trace_event``:
    ``{"runtime": n, "device": m}``."""
    from .loader import trace_event_counts as counts

    return counts()


def include_dir() -> "os.PathLike[str]":
    """The folder to pass as ``-I`` when compiling a plugin (holds ``llaisys/device_ext.h``)."""
    from .build import include_dir as find

    return find()


_resolving = threading.local()


def _resolve_from_env(name: str) -> None:
    """Device-type resolver: load the plugins of the environment when an unknown type is asked for."""
    if not any(os.environ.get(v) for v in ("LLAISYS_PLUGIN_PATH", "CUSTOM_DEVICE_ROOT")):
        return
    if getattr(_resolving, "active", False):
        return
    _resolving.active = True
    try:
        load_plugins_from_env()
    finally:
        _resolving.active = False


add_device_type_resolver(_resolve_from_env)
