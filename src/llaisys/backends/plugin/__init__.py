"""The plugin device backend: ctypes bindings of the custom-runtime C ABI (``abi``), the
``DeviceBackend`` over a plugin's ``C_DeviceInterface`` table (``backend``) and its errors.

Loading a library and registering its device type and kernels is ``llaisys.plugins``' job,
one layer up (it also touches the kernel registry).
"""
from .errors import PluginAPIError, PluginError, PluginOutOfMemoryError

__all__ = ["PluginAPIError", "PluginError", "PluginOutOfMemoryError"]
