"""The calling thread's current device."""
from __future__ import annotations

import threading

from .device import Device, DeviceType, as_device

_local = threading.local()
_CPU0 = Device(DeviceType.CPU, 0)


def current_device() -> Device:
    """The current device of this thread (``cpu:0`` until set)."""
    return getattr(_local, "device", _CPU0)


class set_device:
    """Make ``device`` current for this thread.

    Works as a call (``set_device("cpu:0")``) and as a context manager that restores the
    previous device on exit (``with set_device("custom_cpu:1"): ...``).
    """

    def __init__(self, device: "Device | str"):
        from .runtime import get_runtime

        self.previous = current_device()
        self.device = as_device(device)
        get_runtime(self.device).activate()  # validates that the device exists
        _local.device = self.device

    def __enter__(self) -> Device:
        return self.device

    def __exit__(self, *exc: object) -> None:
        _local.device = self.previous
