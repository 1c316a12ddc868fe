"""Exceptions raised by the runtime."""
from __future__ import annotations


class LlaisysError(RuntimeError):
    """Base class of llaisys runtime errors."""


class DeviceError(LlaisysError):
    """A backend call failed: names the device, the API and the status or cause."""

    def __init__(self, device: object, api: str, detail: str):
        self.device = device
        self.api = api
        self.detail = detail
        super().__init__(f"{device}: {api} failed: {detail}")


class OutOfMemoryError(DeviceError):
    """A device allocation could not be satisfied, even after releasing cached memory."""


class KernelNotFoundError(LlaisysError, LookupError):
    """No kernel is registered for a (name, backend, layout, dtype) key."""
