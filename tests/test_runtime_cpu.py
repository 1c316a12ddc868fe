"""The CPU runtime: memory copies and fills, streams, events, host callbacks and the
thread-local device context.

Ordering is checked with gates (threading.Event) that hold a stream's worker until the test
opens them, so no test depends on timing; waits that would hang on a bug have a timeout.
"""
from __future__ import annotations

import ctypes
import inspect
import threading
from typing import Callable

import numpy as np
import pytest

import llaisys
from llaisys import MemcpyKind, Tensor
from llaisys.backends.cpu import CpuBackend
from llaisys.runtime import DeviceBackend, DeviceError, get_runtime

WAIT = 10.0  # seconds; only reached when ordering is broken


@pytest.fixture
def rt():
    return get_runtime("cpu:0")


def gate() -> tuple[threading.Event, Callable[[], bool]]:
    """An event and a callback that blocks its stream until the event is set."""
    opened = threading.Event()
    return opened, lambda: opened.wait(WAIT)


# ---- the device interface ---------------------------------------------------------------
def test_cpu_backend_implements_the_whole_interface():
    backend = get_runtime("cpu").backend
    assert isinstance(backend, CpuBackend) and isinstance(backend, DeviceBackend)
    assert backend.fallbacks() == []
    # Every optional API with a synchronous fallback in the interface is overridden.
    for name in ("create_stream", "destroy_stream", "synchronize_stream", "query_stream", "stream_add_callback",
                 "create_event", "record_event", "query_event", "synchronize_event", "stream_wait_event",
                 "copy_async", "memset", "allocator_sizes", "host_view", "synchronize_device"):
        assert getattr(CpuBackend, name) is not getattr(DeviceBackend, name), name
    assert not inspect.isabstract(CpuBackend)


def test_device_count_and_memory_info(rt):
    assert rt.backend.device_count() == 1
    info = rt.memory_stats()
    assert info["total"] >= info["free"] > 0
    assert {"allocated", "reserved", "peak_allocated"} <= set(info)


# ---- memory -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(MemcpyKind), ids=lambda k: k.name)
def test_memcpy_every_direction(rt, kind):
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, np.uint8)
    rt.memcpy(dst.ctypes.data + 10, src.ctypes.data, 50, kind)
    expected = np.zeros(100, np.uint8)
    expected[10:60] = src[:50]
    np.testing.assert_array_equal(dst, expected)


def test_memset_through_device_memory(rt):
    ptr = rt.malloc(64)
    try:
        rt.memset(ptr, 0xAB, 64)
        rt.memset(ptr + 8, 0, 8)
        out = (ctypes.c_uint8 * 64).from_address(ptr)
        assert bytes(out) == b"\xab" * 8 + b"\x00" * 8 + b"\xab" * 48
        with pytest.raises(ValueError, match="memset value must be a byte"):
            rt.memset(ptr, 256, 1)
    finally:
        rt.free(ptr)


def test_host_memory_is_usable(rt):
    ptr = rt.malloc_host(32)
    ctypes.memset(ptr, 7, 32)
    assert bytes((ctypes.c_uint8 * 32).from_address(ptr)) == b"\x07" * 32
    rt.free_host(ptr, 32)


# ---- streams ----------------------------------------------------------------------------
def test_tasks_on_one_stream_run_in_order(rt):
    opened, hold = gate()
    order: list[int] = []
    with rt.create_stream() as s:
        s.add_callback(hold)
        for i in range(20):
            s.add_callback(lambda i=i: order.append(i))
        assert not s.query() and order == []  # held by the gate
        opened.set()
        s.synchronize()
        assert s.query() and order == list(range(20))


def test_async_copy_is_ordered_before_a_later_callback(rt):
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    seen: list[bool] = []
    opened, hold = gate()
    with rt.create_stream() as s:
        s.add_callback(hold)
        rt.memcpy_async(dst.ctypes.data, src.ctypes.data, src.nbytes, MemcpyKind.H2H, s)
        s.add_callback(lambda: seen.append(bool((dst == src).all())))
        assert not dst.any()  # the copy waits behind the gate
        opened.set()
        s.synchronize()
    assert seen == [True]


def test_event_orders_work_across_streams(rt):
    order: list[str] = []
    opened, hold = gate()
    with rt.create_stream() as a, rt.create_stream() as b:
        a.add_callback(hold)
        a.add_callback(lambda: order.append("a"))
        event = a.record_event()
        b.wait_event(event)
        b.add_callback(lambda: order.append("b"))
        assert not event.query() and not b.query() and order == []
        opened.set()
        b.synchronize()
        assert event.query() and order == ["a", "b"]


def test_wait_uses_the_record_seen_when_it_was_queued(rt):
    done = threading.Event()
    opened_a, hold_a = gate()
    opened_c, hold_c = gate()
    with rt.create_stream() as a, rt.create_stream() as b, rt.create_stream() as c:
        event = rt.create_event()
        a.add_callback(hold_a)
        event.record(a)
        b.wait_event(event)
        b.add_callback(done.set)
        c.add_callback(hold_c)
        event.record(c)  # a later record must not delay the wait queued before it
        opened_a.set()
        assert done.wait(WAIT)
        assert not event.query()  # now tracks c, still held
        opened_c.set()
        event.synchronize()
        assert event.query()


def test_host_waits_for_an_event(rt):
    opened, hold = gate()
    results: list[int] = []
    with rt.create_stream() as s:
        s.add_callback(hold)
        s.add_callback(lambda: results.append(1))
        event = s.record_event()
        assert not event.query()
        opened.set()
        event.synchronize()
        assert results == [1]


def test_unrecorded_event_is_complete(rt):
    event = rt.create_event()
    assert event.query()
    event.synchronize()
    event.close()


def test_default_stream_runs_at_once(rt):
    seen: list[int] = []
    rt.default_stream.add_callback(lambda: seen.append(1))
    assert seen == [1] and rt.default_stream.query()


def test_device_synchronize_waits_for_every_stream(rt):
    opened, hold = gate()
    finished: list[int] = []
    s1, s2 = rt.create_stream(), rt.create_stream()
    try:
        s1.add_callback(hold)
        s1.add_callback(lambda: finished.append(1))
        s2.add_callback(lambda: finished.append(2))
        s2.add_callback(opened.set)  # s1 can only finish after s2 has run
        llaisys.synchronize("cpu")
        assert sorted(finished) == [1, 2]
    finally:
        s1.close()
        s2.close()


def test_error_in_stream_work_is_raised_on_synchronize(rt):
    def boom():
        raise RuntimeError("kaput")

    s = rt.create_stream()
    s.add_callback(boom)
    with pytest.raises(DeviceError, match="cpu:0: synchronize_stream failed: RuntimeError: kaput"):
        s.synchronize()
    s.synchronize()  # reported once
    s.close()


# ---- thread-local context ---------------------------------------------------------------
def test_default_device_is_cpu0():
    assert str(llaisys.current_device()) == "cpu:0"


def test_set_device_as_call_and_context_manager(fake_device):
    try:
        llaisys.set_device("fakedev:1")
        assert str(llaisys.current_device()) == "fakedev:1"
        assert str(Tensor.empty((2,)).device) == "fakedev:1"
        with llaisys.set_device("fakedev:0") as dev:
            assert str(dev) == "fakedev:0" == str(llaisys.current_device())
            assert str(Tensor.zeros((2,)).device) == "fakedev:0"
            assert str(Tensor.empty((2,), device="cpu").device) == "cpu:0"  # an explicit device wins
        assert str(llaisys.current_device()) == "fakedev:1"
        assert fake_device.calls[-1] == ("set_device", 1)  # restored on the backend too
    finally:
        llaisys.set_device("cpu")
    assert str(llaisys.current_device()) == "cpu:0"


def test_context_manager_restores_after_an_error(fake_device):
    with pytest.raises(KeyError):
        with llaisys.set_device("fakedev:1"):
            raise KeyError("x")
    assert str(llaisys.current_device()) == "cpu:0"


def test_current_device_is_per_thread(fake_device):
    seen: list[str] = []
    with llaisys.set_device("fakedev:1"):
        worker = threading.Thread(target=lambda: seen.append(str(llaisys.current_device())))
        worker.start()
        worker.join()
        assert str(llaisys.current_device()) == "fakedev:1"
    assert seen == ["cpu:0"]


@pytest.mark.parametrize("bad, message", [
    ("cpu:3", "device cpu:3 does not exist; cpu has 1 device"),
    ("fakedev:2", "device fakedev:2 does not exist; fakedev has 2 device"),
    ("tpu", "unknown device type 'tpu'; known device types: cpu, nvidia"),
])
def test_set_device_rejects_missing_devices(fake_device, bad, message):
    with pytest.raises(ValueError, match=message):
        llaisys.set_device(bad)
    assert str(llaisys.current_device()) == "cpu:0"


def test_runtimes_are_created_lazily_once_per_device(fake_device):
    sized = lambda: [c for c in fake_device.calls if c[0] == "allocator_sizes"]  # noqa: E731
    before = len(sized())
    first = get_runtime("fakedev:0")
    assert get_runtime("fakedev:0") is first and get_runtime(llaisys.runtime.as_device("fakedev")) is first
    second = get_runtime("fakedev:1")
    assert second is not first
    assert len(sized()) - before <= 2  # at most one construction each (none if made earlier)
    assert get_runtime("fakedev:1") is second and len(sized()) - before <= 2


def test_tensor_round_trip_through_a_non_cpu_device(fake_device):
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = Tensor.from_numpy(host).to("fakedev:1")
    assert str(t.device) == "fakedev:1"
    with pytest.raises(TypeError, match="not host-addressable"):
        t.host_array()
    np.testing.assert_array_equal(t.numpy(), host)
    np.testing.assert_array_equal(t.permute(1, 0).numpy(), host.T)  # strided copy on the device
    np.testing.assert_array_equal(t.to("fakedev:0").to("cpu").numpy(), host)


def test_strided_writes_to_a_non_cpu_device_keep_the_gaps(fake_device):
    host = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = Tensor.from_numpy(host).to("fakedev:0")
    t.slice(1, 1, 3).load(np.full((4, 2), -1.0))  # every row written in two places
    t.permute(1, 0).slice(0, 4, 6).copy_(Tensor.from_numpy(np.full((2, 4), -2.0, np.float32)))
    expected = host.copy()
    expected[:, 1:3] = -1
    expected[:, 4:6] = -2
    np.testing.assert_array_equal(t.numpy(), expected)
    cpu = Tensor.zeros((6, 4))
    cpu.copy_(t.permute(1, 0))  # device to host into another layout
    np.testing.assert_array_equal(cpu.numpy(), expected.T)
