"""Calls into the plugin on a worker thread watched by a timeout: a call that does not return
fails its row, naming the plugin API it is blocked in."""
from __future__ import annotations

import linecache
import queue
import re
import sys
import threading
from typing import Any, Callable

from .report import Hung

_TABLE_CALL = re.compile(r"\btable\.(\w+)\(")
_ENTRY_POINTS = {"llaisys.plugins.loader": "InitPlugin", "llaisys.plugins.kernels": "InitPluginKernels"}


def _plugin_api_in(frame: Any) -> str | None:
    """The plugin API that the innermost llaisys plugin frame of a stack is calling, if any."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("llaisys.backends.plugin", "llaisys.plugins")):
            api = frame.f_locals.get("api")
            if isinstance(api, str):
                return api
            called = _TABLE_CALL.search(linecache.getline(frame.f_code.co_filename, frame.f_lineno))
            return called.group(1) if called else _ENTRY_POINTS.get(module, frame.f_code.co_name)
        frame = frame.f_back
    return None


class Worker:
    """One daemon thread that makes every call into the plugin, so that the caller can stop
    waiting for one that hangs (a thread blocked in C cannot be interrupted, only left)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="llaisys-plugin-check", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the caller
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()`` on the worker; raises Hung, naming the plugin API it is blocked in, when
        it has not returned after ``timeout`` seconds."""
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        if not done.wait(timeout):
            frame = sys._current_frames().get(self._thread.ident)
            raise Hung(_plugin_api_in(frame) or "a call into the plugin", timeout)
        ok, value = box[0]
        if ok:
            return value
        raise value

    def stop(self) -> None:
        """Let the thread end once it is idle."""
        self._jobs.put(None)
