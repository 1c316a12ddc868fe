"""Kernel layer: the registry and the built-in CPU kernels."""
from .registry import (Layout, dispatch, fallback_enabled, find_kernel, register_kernel,
                       registered_kernels, resolve, unregister_kernels)
from . import cpu as _cpu  # registers the CPU kernels

__all__ = ["Layout", "dispatch", "fallback_enabled", "find_kernel", "register_kernel", "registered_kernels", "resolve", "unregister_kernels"]
