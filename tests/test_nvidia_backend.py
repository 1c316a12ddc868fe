"""The nvidia backend's device interface (in its simulated mode here, or on a GPU where this
process has one): memory under the caching allocator, copies in every direction, pinned host
memory, streams, events, memory stats, opaque pointers; and the clear one-line error of
``--device nvidia`` on a machine without a GPU."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from llaisys import DataType, Tensor
from llaisys.runtime import MemcpyKind, get_runtime


@pytest.fixture
def rt(nvidia_device):
    return get_runtime(nvidia_device)


def test_backend_names_its_mode(rt):
    backend = rt.backend
    assert backend.device_type.name == "nvidia"
    assert backend.device_count() >= 1
    if backend.simulate:
        assert backend.origin.startswith("cuda-simulated")
    assert rt.backend.fallbacks() == ["stream_add_callback"]


def test_copies_in_every_direction(rt):
    src = np.arange(1000, dtype=np.uint8)
    a, b = rt.malloc(1000), rt.malloc(1000)
    try:
        rt.memcpy(a, src.ctypes.data, 1000, MemcpyKind.H2D)
        rt.memcpy(b, a, 1000, MemcpyKind.D2D)
        back = np.zeros(1000, np.uint8)
        rt.memcpy(back.ctypes.data, b, 1000, MemcpyKind.D2H)
        np.testing.assert_array_equal(back, src)
        host2 = np.zeros(1000, np.uint8)
        rt.memcpy(host2.ctypes.data, back.ctypes.data, 1000, MemcpyKind.H2H)
        np.testing.assert_array_equal(host2, src)
        rt.memset(b, 7, 10)
        rt.memcpy(back.ctypes.data, b, 1000, MemcpyKind.D2H)
        assert (back[:10] == 7).all() and (back[10:] == src[10:]).all()
    finally:
        rt.free(a)
        rt.free(b)


def test_async_copies_through_pinned_memory_on_a_stream(rt):
    stream, event = rt.create_stream(), rt.create_event()
    pinned = rt.malloc_host(4096)
    dev = rt.malloc(4096)
    try:
        host = np.frombuffer((np.ctypeslib.as_ctypes_type(np.uint8) * 4096).from_address(pinned), np.uint8)
        host[:] = np.arange(4096) % 251
        rt.memcpy_async(dev, pinned, 4096, MemcpyKind.H2D, stream)
        out = np.zeros(4096, np.uint8)
        rt.memcpy_async(out.ctypes.data, dev, 4096, MemcpyKind.D2H, stream)
        event.record(stream)
        event.synchronize()
        assert event.query() and stream.query()
        np.testing.assert_array_equal(out, np.arange(4096) % 251)
        other = rt.create_stream()
        other.wait_event(event)
        other.synchronize()
    finally:
        rt.free(dev)
        rt.free_host(pinned, 4096)


def test_allocator_and_memory_stats(rt):
    before = rt.memory_stats()
    assert before["total"] > 0 and 0 <= before["free"] <= before["total"]
    t = Tensor.empty((1024, 1024), DataType.F32, rt.device)  # 4 MiB from the caching allocator
    during = rt.memory_stats()
    assert during["allocated"] >= before["allocated"] + (4 << 20)
    del t
    assert rt.memory_stats()["allocated"] == before["allocated"]


def test_out_of_memory_is_an_out_of_memory_error(rt):
    from llaisys.runtime import OutOfMemoryError

    with pytest.raises(OutOfMemoryError, match="allocate"):
        rt.malloc(1 << 60)
    t = Tensor.empty((4,), DataType.F32, rt.device)  # the device still works
    assert t.numpy().shape == (4,)


def test_device_memory_is_opaque(rt):
    t = Tensor.from_numpy(np.ones((2, 3), np.float32), device=rt.device)
    with pytest.raises(TypeError):
        rt.host_view(t.data_ptr, t.nbytes)
    with pytest.raises(TypeError, match="not host-addressable"):
        t.host_array()
    np.testing.assert_array_equal(t.numpy(), np.ones((2, 3), np.float32))  # through the D2H copy
    with pytest.raises(ValueError, match="not nvidia device memory"):
        rt.backend.block_at(12345, 8)


def test_tensor_round_trip_and_views(rt):
    host = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    t = Tensor.from_numpy(host, device=rt.device)
    np.testing.assert_array_equal(t.permute(2, 0, 1).contiguous().numpy(), host.transpose(2, 0, 1))
    np.testing.assert_array_equal(t.to("cpu").numpy(), host)
    np.testing.assert_array_equal(t.slice(2, 1, 3).numpy(), host[:, :, 1:3])


def test_simulated_mode_is_off_unless_asked(monkeypatch):
    from llaisys.backends.nvidia import simulated

    monkeypatch.delenv("LLAISYS_NVIDIA_SIMULATE", raising=False)
    assert simulated() == 0
    monkeypatch.setenv("LLAISYS_NVIDIA_SIMULATE", "2")
    assert simulated() == 2
    monkeypatch.setenv("LLAISYS_NVIDIA_SIMULATE", "many")
    with pytest.raises(ValueError, match="LLAISYS_NVIDIA_SIMULATE='many'"):
        simulated()


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: --device nvidia runs there")
def test_device_nvidia_without_a_gpu_is_a_one_line_error():
    env = {k: v for k, v in os.environ.items() if k not in ("LLAISYS_NVIDIA_SIMULATE", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-m", "llaisys", "generate", "--device", "nvidia", "hi"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "nvidia" in lines[0] and "GPU" in lines[0] and "Traceback" not in proc.stderr


def test_the_cpu_never_imports_torch_or_triton():
    code = ("import sys, numpy as np, llaisys\n"
            "from llaisys import Tensor, ops\n"
            "a = Tensor.from_numpy(np.ones((2, 3), np.float32)); ops.add(a, a, a)\n"
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_graph_cache_runs_steps_and_buckets(rt):
    from llaisys.backends.nvidia.graphs import GraphCache, bucket

    calls = []
    graphs = GraphCache(rt.backend, rt.index)
    for _ in range(3):
        graphs.run((2, 2, 2), lambda: calls.append(1))
    # simulated: the stand-in graph calls the step at each replay; on a GPU its Python runs for
    # the warm-up and the capture only
    assert len(calls) == (3 if rt.backend.simulate else 2)
    assert (graphs.captures, graphs.replays, len(graphs)) == (1, 3, 1)
    graphs.drop((2, 2, 2))
    graphs.run((2, 2, 2), lambda: calls.append(1))
    assert graphs.captures == 2
    assert [bucket(n) for n in (1, 3, 64, 65, 300)] == [1, 4, 64, 128, 300]


def test_graphs_switch(rt, monkeypatch):
    monkeypatch.setenv("LLAISYS_NVIDIA_GRAPHS", "0")
    assert rt.backend.graph_cache(rt.index) is None
    monkeypatch.delenv("LLAISYS_NVIDIA_GRAPHS")
    assert rt.backend.graph_cache(rt.index) is not None
