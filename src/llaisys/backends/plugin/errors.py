"""Errors of device plugins: a library that cannot be loaded, and API calls that fail."""
from __future__ import annotations

from ...runtime.errors import LlaisysError, OutOfMemoryError


class PluginError(LlaisysError):
    """A device plugin could not be loaded or used; the message names the library."""


class PluginAPIError(PluginError):
    """A plugin API returned a status other than success.

    ``library``: the plugin's path; ``api``: the C function (``memory_copy_d2h``, or
    ``kernel rms_norm``); ``status``: its ``C_Status`` name; ``device``: where it ran.
    """

    def __init__(self, library: str, device: object, api: str, status: str):
        self.library = library
        self.device = device
        self.api = api
        self.status = status
        self.detail = f"returned {status}"
        RuntimeError.__init__(self, f"plugin {library}: {api} on {device} returned {status}")


class PluginOutOfMemoryError(PluginAPIError, OutOfMemoryError):
    """``device_memory_allocate`` returned ``C_FAILED``: the device has no room.

    Also an OutOfMemoryError, so the caching allocator frees its cache and tries again."""
