"""The DeviceBackend of a loaded plugin: a thin adapter over its ``C_DeviceInterface``.

A method is overridden only where the plugin provides the API; otherwise the base class's
synchronous fallback runs (``fallbacks()`` lists those). Every status other than C_SUCCESS
becomes a PluginAPIError naming the plugin, the API and the status; C_WARNING is logged once
per API. Device pointers stay opaque integers: only the plugin's copy APIs touch them.

Handles: a stream or event is the plugin's pointer as an int; ``None`` is the default
stream, on which llaisys works synchronously.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from typing import Any, Callable

from ...runtime.device import DeviceType
from ...runtime.dtypes import MemcpyKind
from ...runtime.interface import DEFAULT_ALLOCATOR_SIZES, AllocatorSizes, DeviceBackend
from . import abi
from .errors import PluginAPIError, PluginError, PluginOutOfMemoryError

log = logging.getLogger(__name__)

_STREAM_APIS = ("create_stream", "destroy_stream")
_EVENT_APIS = ("create_event", "record_event", "destroy_event", "synchronize_event")
_ASYNC_COPY_API = {MemcpyKind.H2D: "async_memory_copy_h2d", MemcpyKind.D2H: "async_memory_copy_d2h",
                   MemcpyKind.D2D: "async_memory_copy_d2d"}

# Host callbacks waiting on a stream, by the key passed as user_data.
_callbacks: dict[int, tuple["PluginBackend", Callable[[], None]]] = {}
_callback_keys = itertools.count(1)


@abi.C_Callback
def _run_callback(device: Any, stream: Any, user_data: int | None, status: Any) -> None:
    """The one C_Callback handed to every plugin: runs the Python callable user_data names."""
    entry = _callbacks.pop(user_data or 0, None)
    if entry is None:
        return
    backend, fn = entry
    try:
        fn()
    except BaseException as exc:  # raised again by the next synchronize on the host
        log.error("a host callback on %s failed: %r", backend.device_type.name, exc)
        backend._callback_errors.append(exc)


class PluginBackend(DeviceBackend):
    """Serves ``device_type`` through the function table ``table`` of the plugin at ``library``."""

    def __init__(self, library: str, device_type: DeviceType, table: abi.C_DeviceInterface):
        self.device_type = device_type
        self.origin = library
        self.library = library
        self._table = table
        self._present = {name for name in abi.API_NAMES if getattr(table, name)}
        self._warned: set[str] = set()
        self._closed = False
        self._lock = threading.Lock()
        self._callback_errors: list[BaseException] = []
        self._streams: dict[int, set[int]] = {}  # device index -> live stream handles
        self._idle_streams: dict[int, int] = {}  # device index -> private empty stream
        self._copy_streams: dict[int, Any] = {}  # device index -> stream of emulated sync copies
        self._copy_lock = threading.Lock()
        self._native_copies: dict[tuple[int, str], tuple] = {}  # (index, kind) -> native_copy's answer
        self.has_streams = all(a in self._present for a in _STREAM_APIS) and bool(
            {"synchronize_stream", "synchronize_device"} & self._present)
        self.has_events = all(a in self._present for a in _EVENT_APIS)
        self.has_host_memory = {"host_memory_allocate", "host_memory_deallocate"} <= self._present
        self._devices: list[Any] = []
        if "initialize" in self._present:
            self._check("initialize", table.initialize(), None)
        try:
            self._devices = self._enumerate()
        except BaseException:
            self.close()
            raise

    # ---- status handling -----------------------------------------------------------------
    def _check(self, api: str, status: int, index: int | None, pending_ok: bool = False) -> bool:
        """True on success; False for C_FAILED when ``pending_ok`` (a query's "not yet");
        raises PluginAPIError otherwise. C_WARNING counts as success, logged once."""
        if status == abi.C_SUCCESS:
            return True
        if status == abi.C_WARNING:
            if api not in self._warned:
                self._warned.add(api)
                log.warning("plugin %s: %s returned C_WARNING (the result may not be as asked)", self.library, api)
            return True
        if pending_ok and status == abi.C_FAILED:
            return False
        where = self.device_type.name if index is None else f"{self.device_type.name}:{index}"
        if api == "device_memory_allocate" and status == abi.C_FAILED:
            raise PluginOutOfMemoryError(self.library, where, api, abi.status_name(status))
        raise PluginAPIError(self.library, where, api, abi.status_name(status))

    def _call(self, api: str, index: int | None, *args: Any) -> None:
        if self._closed:
            raise PluginError(f"plugin {self.library}: {self.device_type.name} is unloaded; {api} is unavailable")
        self._check(api, getattr(self._table, api)(*args), index)

    def _dev(self, index: int) -> Any:
        if self._closed:
            raise PluginError(f"plugin {self.library}: {self.device_type.name} is unloaded")
        try:
            return self._devices[index]
        except IndexError:
            raise ValueError(f"{self.device_type.name}:{index} does not exist; "
                             f"{self.device_type.name} has {len(self._devices)} device(s)") from None

    def check_status(self, api: str, status: int, index: int | None) -> None:
        """Raise PluginAPIError unless ``status`` is success (for the kernel bridge)."""
        self._check(api, status, index)

    def device_handle(self, index: int) -> Any:
        """The ``C_Device`` of device ``index``, to pass to plugin functions."""
        return self._dev(index)

    def native_copy(self, index: int, kind: str) -> tuple[int, int, Callable[[int], None]] | None:
        """(address of the plugin's synchronous copy function, address of device ``index``'s
        ``C_Device``, the status check of a call) for ``kind`` "h2d" or "d2h", for copies made
        from C in a replayed plan (``kernels.cpu.native_calls``): the check raises
        PluginAPIError as a copy from Python would, and logs C_WARNING once. None when the
        plugin has only the asynchronous copy (then the fallback runs from Python)."""
        api = f"memory_copy_{kind}"
        if api not in self._present or self._closed:
            return None
        found = self._native_copies.get((index, kind))
        if found is None:
            fn = ctypes.cast(getattr(self._table, api), ctypes.c_void_p).value
            found = (fn, ctypes.addressof(self._dev(index).contents), lambda status: self._check(api, status, index))
            self._native_copies[(index, kind)] = found
        return found

    @property
    def table(self) -> abi.C_DeviceInterface:
        """The plugin's raw function table, for APIs llaisys does not wrap (collectives,
        ``blas_axpby``). Calls through it get no status checks."""
        return self._table

    def has_api(self, name: str) -> bool:
        """Whether the plugin filled in API ``name``."""
        return name in self._present

    # ---- set-up ------------------------------------------------------------------------
    def _enumerate(self) -> list[Any]:
        count = ctypes.c_size_t(0)
        self._call("get_device_count", None, ctypes.byref(count))
        ids = (ctypes.c_size_t * max(count.value, 1))()
        if count.value:
            self._call("get_device_list", None, ids)
        devices = []
        for i in range(count.value):
            dev = ctypes.pointer(abi.C_Device_st(int(ids[i])))
            if "init_device" in self._present:  # may replace the id by the physical one
                self._call("init_device", i, dev)
            devices.append(dev)
        if not devices:
            log.warning("plugin %s reports no %s devices", self.library, self.device_type.name)
        return devices

    def close(self) -> None:
        """Release private streams, de-initialise the devices and finalize the plugin, logging
        (not raising) what fails. Later calls raise PluginError. The library stays mapped."""
        if self._closed:
            return
        steps: list[tuple[str, int | None, tuple]] = [
            ("destroy_stream", i, (self._devices[i], h)) for i, h in self._idle_streams.items()]
        if "deinit_device" in self._present:
            steps += [("deinit_device", i, (dev,)) for i, dev in enumerate(self._devices)]
        if "finalize" in self._present:
            steps.append(("finalize", None, ()))
        for api, index, args in steps:
            try:
                self._call(api, index, *args)
            except PluginError as exc:
                log.warning("%s", exc)
        self._idle_streams.clear()
        self._closed = True

    # ---- report ----------------------------------------------------------------------------
    def fallbacks(self) -> list[str]:
        """The optional APIs the plugin lacks, each running on its fallback (``abi.FALLBACKS``)."""
        missing = [api for api in abi.FALLBACKS if api not in self._present]
        if not self.has_streams:
            missing += [a for a in ("create_stream", "destroy_stream", "query_stream", "stream_add_callback",
                                    "synchronize_stream") if a in self._present]
        if not self.has_events:
            missing += [a for a in ("create_event", "record_event", "destroy_event", "synchronize_event",
                                    "query_event", "stream_wait_event") if a in self._present]
        return sorted(set(missing), key=list(abi.FALLBACKS).index)

    # ---- devices -----------------------------------------------------------------------
    def device_count(self) -> int:
        return len(self._devices)

    def set_device(self, index: int) -> None:
        self._call("set_device", index, self._dev(index))

    def current_device_id(self) -> int:
        """The physical id ``get_device`` reports for the calling thread."""
        dev = abi.C_Device_st(-1)
        self._call("get_device", None, ctypes.byref(dev))
        return dev.id

    def synchronize_device(self, index: int) -> None:
        if "synchronize_device" in self._present:
            self._call("synchronize_device", index, self._dev(index))
        else:
            with self._lock:
                handles = list(self._streams.get(index, ()))
            for handle in handles:
                self._sync_stream(index, handle)
        self._raise_callback_error()

    def _raise_callback_error(self) -> None:
        if self._callback_errors:
            err = self._callback_errors.pop(0)
            raise PluginError(f"a host callback on {self.device_type.name} failed: {err!r}") from err

    # ---- streams -----------------------------------------------------------------------
    def create_stream(self, index: int) -> Any:
        if not self.has_streams:
            return None
        handle = ctypes.c_void_p()
        self._call("create_stream", index, self._dev(index), ctypes.byref(handle))
        if handle.value:
            with self._lock:
                self._streams.setdefault(index, set()).add(handle.value)
        return handle.value

    def destroy_stream(self, index: int, stream: Any) -> None:
        if stream is None or not self.has_streams:
            return
        self._sync_stream(index, stream)
        with self._lock:
            self._streams.get(index, set()).discard(stream)
        self._call("destroy_stream", index, self._dev(index), stream)

    def _sync_stream(self, index: int, stream: int) -> None:
        if "synchronize_stream" in self._present:
            self._call("synchronize_stream", index, self._dev(index), stream)
        else:
            self._call("synchronize_device", index, self._dev(index))

    def synchronize_stream(self, index: int, stream: Any) -> None:
        if stream is not None and self.has_streams:
            self._sync_stream(index, stream)
        self._raise_callback_error()

    def query_stream(self, index: int, stream: Any) -> bool:
        if stream is None or not self.has_streams:
            return True
        if "query_stream" not in self._present:
            return super().query_stream(index, stream)
        return self._check("query_stream", self._table.query_stream(self._dev(index), stream), index, pending_ok=True)

    def stream_add_callback(self, index: int, stream: Any, callback: Callable[[], None]) -> None:
        if stream is None or not self.has_streams:
            callback()
            return
        if "stream_add_callback" not in self._present:
            super().stream_add_callback(index, stream, callback)
            return
        key = next(_callback_keys)
        _callbacks[key] = (self, callback)
        try:
            self._call("stream_add_callback", index, self._dev(index), stream, _run_callback, key)
        except BaseException:
            _callbacks.pop(key, None)
            raise

    def _idle_stream(self, index: int) -> int | None:
        """An empty private stream: an event recorded on it completes at once, which is what a
        record on the synchronous default stream means."""
        if not self.has_streams:
            return None
        with self._lock:
            handle = self._idle_streams.get(index)
        if handle is None:
            out = ctypes.c_void_p()
            self._call("create_stream", index, self._dev(index), ctypes.byref(out))
            with self._lock:
                handle = self._idle_streams.setdefault(index, out.value)
            if handle != out.value:
                self._call("destroy_stream", index, self._dev(index), out.value)
        return handle

    # ---- events ----------------------------------------------------------------------------
    def create_event(self, index: int) -> Any:
        if not self.has_events:
            return super().create_event(index)
        handle = ctypes.c_void_p()
        self._call("create_event", index, self._dev(index), ctypes.byref(handle))
        return handle.value

    def destroy_event(self, index: int, event: Any) -> None:
        if self.has_events:
            self._call("destroy_event", index, self._dev(index), event)

    def record_event(self, index: int, stream: Any, event: Any) -> None:
        if not self.has_events:
            super().record_event(index, stream if self.has_streams else None, event)
            return
        if stream is None:
            stream = self._idle_stream(index)
        self._call("record_event", index, self._dev(index), stream, event)

    def synchronize_event(self, index: int, event: Any) -> None:
        if self.has_events:
            self._call("synchronize_event", index, self._dev(index), event)

    def query_event(self, index: int, event: Any) -> bool:
        if not self.has_events:
            return True  # a recorded fallback event is complete
        if "query_event" not in self._present:
            self.synchronize_event(index, event)
            return True
        return self._check("query_event", self._table.query_event(self._dev(index), event), index, pending_ok=True)

    def stream_wait_event(self, index: int, stream: Any, event: Any) -> None:
        if self.has_events and stream is not None and self.has_streams and "stream_wait_event" in self._present:
            self._call("stream_wait_event", index, self._dev(index), stream, event)
        else:  # the host waits; the default stream is synchronous with it anyway
            self.synchronize_event(index, event)

    # ---- memory --------------------------------------------------------------------------
    def _allocate_with(self, api: str, index: int, nbytes: int) -> int:
        """Call the allocation API ``api``; a success that returns NULL is an error too."""
        ptr = ctypes.c_void_p()
        self._call(api, index, self._dev(index), ctypes.byref(ptr), nbytes)
        if not ptr.value:
            raise PluginAPIError(self.library, f"{self.device_type.name}:{index}", api, "C_SUCCESS with a NULL pointer")
        return ptr.value

    def allocate(self, index: int, nbytes: int) -> int:
        return self._allocate_with("device_memory_allocate", index, nbytes)

    def deallocate(self, index: int, ptr: int, nbytes: int) -> None:
        self._call("device_memory_deallocate", index, self._dev(index), ptr, nbytes)

    def host_allocate(self, index: int, nbytes: int) -> int:
        if not self.has_host_memory:
            return super().host_allocate(index, nbytes)
        return self._allocate_with("host_memory_allocate", index, nbytes)

    def host_deallocate(self, index: int, ptr: int, nbytes: int) -> None:
        if not self.has_host_memory:
            super().host_deallocate(index, ptr, nbytes)
            return
        self._call("host_memory_deallocate", index, self._dev(index), ptr, nbytes)

    def copy_h2d(self, index: int, dst: int, src: int, nbytes: int) -> None:
        self._sync_copy("memory_copy_h2d", index, dst, src, nbytes)

    def copy_d2h(self, index: int, dst: int, src: int, nbytes: int) -> None:
        self._sync_copy("memory_copy_d2h", index, dst, src, nbytes)

    def copy_d2d(self, index: int, dst: int, src: int, nbytes: int) -> None:
        if "memory_copy_d2d" in self._present or abi.COPY_APIS["memory_copy_d2d"] in self._present:
            self._sync_copy("memory_copy_d2d", index, dst, src, nbytes)
            return
        bounce = ctypes.create_string_buffer(nbytes)  # no D2D API at all: through the host
        address = ctypes.addressof(bounce)
        self.copy_d2h(index, address, src, nbytes)
        self.copy_h2d(index, dst, address, nbytes)

    def _sync_copy(self, api: str, index: int, dst: int, src: int, nbytes: int) -> None:
        """A synchronous copy through ``api``, or its asynchronous twin on a private stream."""
        if api in self._present:
            self._call(api, index, self._dev(index), dst, src, nbytes)
            return
        stream = self._copy_stream(index)
        self._call(abi.COPY_APIS[api], index, self._dev(index), stream, dst, src, nbytes)
        if stream is None:
            self.synchronize_device(index)
        else:
            self.synchronize_stream(index, stream)

    def _copy_stream(self, index: int) -> Any:
        """The stream synchronous copies run on when the plugin has only asynchronous ones
        (NULL, the plugin's default stream, when it has no streams)."""
        with self._copy_lock:
            if index not in self._copy_streams:
                self._copy_streams[index] = self.create_stream(index) if self.has_streams else None
            return self._copy_streams[index]

    def copy_async(self, index: int, dst: int, src: int, nbytes: int, kind: MemcpyKind, stream: Any) -> None:
        api = _ASYNC_COPY_API.get(kind)
        if stream is None or not self.has_streams:
            self.copy(index, dst, src, nbytes, kind)
        elif api in self._present:
            self._call(api, index, self._dev(index), stream, dst, src, nbytes)
        else:
            super().copy_async(index, dst, src, nbytes, kind, stream)

    def memset(self, index: int, ptr: int, value: int, nbytes: int) -> None:
        if "device_memory_set" not in self._present:
            super().memset(index, ptr, value, nbytes)
            return
        self._call("device_memory_set", index, self._dev(index), ptr, value, nbytes)

    def memory_stats(self, index: int) -> tuple[int, int]:
        if "device_memory_stats" not in self._present:
            return 0, 0
        total, free = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._call("device_memory_stats", index, self._dev(index), ctypes.byref(total), ctypes.byref(free))
        return total.value, free.value

    def _size(self, api: str, index: int) -> int | None:
        if api not in self._present:
            return None
        out = ctypes.c_size_t(0)
        self._call(api, index, self._dev(index), ctypes.byref(out))
        return out.value

    def allocator_sizes(self, index: int) -> AllocatorSizes:
        """The caching allocator's sizes from the plugin's info APIs; missing ones take the
        defaults of ``abi.FALLBACKS``."""
        d = DEFAULT_ALLOCATOR_SIZES
        min_chunk = self._size("device_min_chunk_size", index)
        if min_chunk is None:
            min_chunk = 256
        if not min_chunk:
            raise PluginAPIError(self.library, f"{self.device_type.name}:{index}", "device_min_chunk_size",
                                 "a chunk size of 0 (expected at least 1)")
        max_alloc = self._size("device_max_alloc_size", index) or 0
        max_chunk = self._size("device_max_chunk_size", index) or (min(d.max_chunk_size, max_alloc) if max_alloc else d.max_chunk_size)
        init = self._size("device_init_alloc_size", index) or min(d.init_alloc_size, max_chunk)
        realloc = self._size("device_realloc_size", index) or min(d.realloc_size, max_chunk)
        padding = self._size("device_extra_padding_size", index) or 0
        return AllocatorSizes(min_chunk_size=min_chunk, max_chunk_size=max_chunk, max_alloc_size=max_alloc,
                              extra_padding_size=padding, init_alloc_size=init, realloc_size=realloc)

    def info(self) -> dict[str, Any]:
        """Versions and capability the plugin reports (absent APIs are left out)."""
        out: dict[str, Any] = {}
        for api in ("get_compute_capability", "get_runtime_version", "get_driver_version"):
            if api in self._present:
                value = ctypes.c_size_t(0)
                self._call(api, None, ctypes.byref(value))
                out[api[4:]] = value.value
        return out
