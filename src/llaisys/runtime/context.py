"""The calling thread's current device."""
from __future__ import annotations

import threading

from .device import Device, DeviceType, as_device
from .runtime import Runtime, get_runtime

_CPU0 = Device(DeviceType.CPU, 0)


class _Context(threading.local):
    device: Device = _CPU0  # the class default: no exception path on a thread's first read


_local = _Context()


def current_device() -> Device:
    """The current device of this thread (``cpu:0`` until set)."""
    return _local.device


def current_runtime() -> Runtime:
    """The Runtime of this thread's current device (created on first use)."""
    return get_runtime(_local.device)


class set_device:
    """Make ``device`` current for this thread.

    Works as a call (``set_device("cpu:0")``) and as a context manager that restores the
    previous device on exit (``with set_device("custom_cpu:1"): ...``). Raises ValueError
    for a device that does not exist.
    """

    def __init__(self, device: "Device | str"):
        self.previous = current_device()
        self.device = as_device(device)
        get_runtime(self.device).activate()  # validates that the device exists
        _local.device = self.device

    def __enter__(self) -> Device:
        return self.device

    def __exit__(self, *exc: object) -> None:
        _local.device = self.previous
        get_runtime(self.previous).activate()
