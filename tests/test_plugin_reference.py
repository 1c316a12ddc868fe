"""The reference plugin (plugins/custom_cpu), built with cc and loaded through the C ABI: its
device API semantics through the llaisys runtime, its C kernels against PyTorch, its
collectives, and the conformance check."""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import llaisys
from llaisys import DataType, MemcpyKind, Tensor
from llaisys.kernels import find_kernel, unregister_kernels
from llaisys.backends.plugin import abi
from llaisys.plugins import PluginAPIError, PluginOutOfMemoryError, load_plugin, unload_plugin
from llaisys.plugins.build import build_reference_plugin
from llaisys.plugins.kernels import install_kernels
from llaisys.tools.plugin_check import FAIL, PASS, decoder_layer_chain, random_model_run, run_check, write_random_qwen2

F = llaisys.ops.functional
DEV = "custom_cpu:1"
PAGED_OPS = ("kv_cache_write", "paged_attention", "paged_attention_window")


@pytest.fixture(scope="module")
def plugin():
    path = build_reference_plugin()
    plugin = load_plugin(path)
    yield plugin
    llaisys.get_runtime(DEV).synchronize()
    unload_plugin("custom_cpu")


@pytest.fixture
def no_fallback(monkeypatch):
    """Ops must run on the plugin's own kernels: a missing one raises instead of falling back."""
    monkeypatch.setenv("LLAISYS_KERNEL_FALLBACK", "0")


@pytest.fixture
def rows_pass(plugin):
    """The plugin without its paged kernels for the test, so a model loaded on its device runs
    single sequences with the contiguous ops (``RowsPass``); they are installed again after."""
    unregister_kernels(plugin.name, ops=PAGED_OPS)
    yield
    install_kernels([k for k in plugin.kernels if k.op in PAGED_OPS], plugin.backend)


def dev(array: np.ndarray) -> Tensor:
    return Tensor.from_numpy(np.ascontiguousarray(array), device=DEV)


# ---- loading and the device API --------------------------------------------------------------
def test_loads_with_two_devices_and_no_fallbacks(plugin):
    assert plugin.name == "custom_cpu" and plugin.version == (0, 1, 1)
    assert plugin.sub_device_type == "reference-1"
    assert plugin.backend.device_count() == 2
    assert plugin.backend.fallbacks() == []
    assert load_plugin(build_reference_plugin()) is plugin  # loading the same file again
    assert "custom_cpu" in llaisys.runtime.available_backends()


def test_tensors_round_trip_on_both_devices(plugin):
    rng = np.random.default_rng(0)
    for index in (0, 1):
        host = rng.standard_normal((3, 5)).astype(np.float32)
        t = Tensor.from_numpy(host, device=f"custom_cpu:{index}")
        assert t.device == llaisys.runtime.as_device(f"custom_cpu:{index}")
        np.testing.assert_array_equal(t.numpy(), host)
        np.testing.assert_array_equal(t.to("cpu").numpy(), host)
        np.testing.assert_array_equal(Tensor.zeros((4,), device=f"custom_cpu:{index}").numpy(), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="custom_cpu has 2 device"):
        llaisys.get_runtime("custom_cpu:2")


def test_device_memory_is_not_host_addressable(plugin):
    t = Tensor.from_numpy(np.ones(4, np.float32), DEV)
    with pytest.raises(TypeError, match="not host-addressable"):
        t.host_array()
    with pytest.raises(TypeError, match="not host-addressable"):
        llaisys.get_runtime(DEV).host_view(t.data_ptr, 16)


def test_set_device_is_what_get_device_reports(plugin):
    for index in (1, 0, 1):
        with llaisys.set_device(f"custom_cpu:{index}"):
            assert llaisys.current_device() == llaisys.runtime.as_device(f"custom_cpu:{index}")
            assert plugin.backend.current_device_id() == index


def test_allocator_is_sized_from_the_plugin(plugin):
    rt = llaisys.get_runtime(DEV)
    sizes = plugin.backend.allocator_sizes(1)
    # The values runtime.c reports: min chunk 512, max chunk 32 MiB, init/realloc 4 MiB, no padding.
    assert (sizes.min_chunk_size, sizes.max_chunk_size, sizes.init_alloc_size, sizes.realloc_size,
            sizes.extra_padding_size) == (512, 32 << 20, 4 << 20, 4 << 20, 0)
    assert rt.allocator.round_size(1) == 512 and rt.allocator.round_size(513) == 1024
    total, _ = plugin.backend.memory_stats(1)
    assert sizes.max_alloc_size == total


def test_memory_stats_follow_allocations(plugin):
    b = plugin.backend
    total, free = b.memory_stats(0)
    ptr = b.allocate(0, 3 << 20)
    assert b.memory_stats(0) == (total, free - (3 << 20))
    b.deallocate(0, ptr, 3 << 20)
    assert b.memory_stats(0) == (total, free)


def test_plugin_failures_name_plugin_api_and_status(plugin):
    b = plugin.backend
    total, _ = b.memory_stats(0)
    with pytest.raises(PluginOutOfMemoryError, match=r"libcustom_cpu\.so: device_memory_allocate on custom_cpu:0 returned C_FAILED"):
        b.allocate(0, 2 * total)
    ptr = b.allocate(0, 100)
    with pytest.raises(PluginAPIError, match="device_memory_deallocate on custom_cpu:0 returned C_ERROR"):
        b.deallocate(0, ptr, 99)  # wrong size: the plugin refuses
    b.deallocate(0, ptr, 100)


def test_stream_waits_for_event_recorded_behind_blocked_work(plugin):
    rt = llaisys.get_runtime(DEV)
    n = 1 << 20
    src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    back = np.zeros(n, np.uint8)
    x, y = rt.malloc(n), rt.malloc(n)
    s1, s2 = rt.create_stream(), rt.create_stream()
    gate = threading.Event()
    try:
        s1.add_callback(gate.wait)  # holds stream 1 until released
        rt.memcpy_async(x, src.ctypes.data, n, MemcpyKind.H2D, s1)
        ev = s1.record_event()
        s2.wait_event(ev)
        rt.memcpy_async(y, x, n, MemcpyKind.D2D, s2)
        rt.memcpy_async(back.ctypes.data, y, n, MemcpyKind.D2H, s2)
        assert not ev.query() and not s1.query() and not s2.query()
        assert not back.any()  # nothing of stream 2 ran ahead of the event
        gate.set()
        s2.synchronize()
        np.testing.assert_array_equal(back, src)
        ev.synchronize()
        assert ev.query() and s1.query()
    finally:
        gate.set()
        s1.close()
        s2.close()
        rt.free(x)
        rt.free(y)


def test_callbacks_run_in_stream_order(plugin):
    rt = llaisys.get_runtime(DEV)
    order: list[int] = []
    with rt.create_stream() as s:
        for i in range(20):
            s.add_callback(lambda i=i: order.append(i))
        s.synchronize()
    assert order == list(range(20))


def test_callback_error_is_raised_at_synchronize(plugin):
    rt = llaisys.get_runtime(DEV)
    with rt.create_stream() as s:
        s.add_callback(lambda: 1 / 0)
        with pytest.raises(llaisys.runtime.LlaisysError, match="ZeroDivisionError"):
            s.synchronize()


def test_event_on_default_stream_completes(plugin):
    rt = llaisys.get_runtime(DEV)
    ev = rt.create_event()
    ev.record(None)
    ev.synchronize()
    assert ev.query()


def test_collectives_on_one_rank(plugin, monkeypatch):
    t, b = plugin.backend.table, plugin.backend
    size = ctypes.c_size_t()
    assert t.xccl_get_unique_id_size(ctypes.byref(size)) == abi.C_SUCCESS
    buf = (ctypes.c_char * size.value)()
    root = abi.C_CCLRootId(size.value, ctypes.cast(buf, ctypes.c_void_p))
    comm = ctypes.c_void_p()
    assert t.xccl_comm_init_rank(2, ctypes.byref(root), 0, ctypes.byref(comm)) == abi.C_ERROR  # an id it never made
    assert t.xccl_get_unique_id(ctypes.byref(root)) == abi.C_SUCCESS
    monkeypatch.setenv("LLAISYS_CCL_TIMEOUT", "0.3")
    start = time.monotonic()
    assert t.xccl_comm_init_rank(2, ctypes.byref(root), 0, ctypes.byref(comm)) == abi.C_FAILED  # rank 1 never comes
    assert 0.3 <= time.monotonic() - start < 5
    assert not os.path.exists("/dev/shm/" + buf.value.decode().lstrip("/"))  # its segment is gone
    assert t.xccl_comm_init_rank(1, ctypes.byref(root), 0, ctypes.byref(comm)) == abi.C_SUCCESS
    values = np.arange(10, dtype=np.float32)
    send, recv = dev(values), Tensor.zeros((10,), device=DEV)
    stream = b.create_stream(1)
    try:
        status = t.xccl_all_reduce(send.data_ptr, recv.data_ptr, 10, abi.C_DATA_TYPES.index("FLOAT32"), 0, comm, stream)
        assert status == abi.C_SUCCESS
        b.synchronize_stream(1, stream)
        np.testing.assert_array_equal(recv.numpy(), values)  # the sum over one rank
        y = dev(np.ones(10, np.float32))
        assert t.blas_axpby(b.device_handle(1), stream, abi.C_DATA_TYPES.index("FLOAT32"), 10, 2.0, send.data_ptr,
                            0.5, y.data_ptr) == abi.C_SUCCESS
        b.synchronize_stream(1, stream)
        np.testing.assert_allclose(y.numpy(), 2.0 * values + 0.5)
    finally:
        b.destroy_stream(1, stream)
        assert t.xccl_destroy_comm(comm) == abi.C_SUCCESS


# ---- kernels ----------------------------------------------------------------------------------
def test_kernels_are_registered_for_f32(plugin):
    for op in ("add", "argmax", "embedding", "linear", "rearrange", "rms_norm", "rope", "self_attention", "swiglu",
               *PAGED_OPS):
        assert find_kernel(op, "custom_cpu", DataType.F32) is not None, op
    assert find_kernel("add", "custom_cpu", DataType.F16) is None
    assert find_kernel("rearrange", "custom_cpu", DataType.I64) is not None


def _t(array) -> torch.Tensor:
    return torch.from_numpy(np.asarray(array, np.float64))


def test_elementwise_kernels_on_strided_views(plugin, no_fallback):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((6, 4)).astype(np.float32)
    b = rng.standard_normal((4, 6)).astype(np.float32)
    da, db = dev(a), dev(b).permute(1, 0)  # (6, 4) strided
    np.testing.assert_allclose(F.add(da, db).numpy(), (_t(a) + _t(b).T).numpy(), rtol=1e-6, atol=1e-6)
    out = Tensor.zeros((6, 8), device=DEV).slice(1, 2, 6)  # a strided output
    llaisys.ops.swiglu(out, da, db)
    want = torch.nn.functional.silu(_t(a)) * _t(b).T
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(F.rearrange(db).numpy(), b.T)
    idx = dev(np.arange(12, dtype=np.int64).reshape(3, 4)).permute(1, 0)
    np.testing.assert_array_equal(F.rearrange(idx).numpy(), np.arange(12).reshape(3, 4).T)


def test_rms_norm_and_linear_kernels(plugin, no_fallback):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    xt = _t(x)
    want = xt / torch.sqrt((xt * xt).mean(-1, keepdim=True) + 1e-5) * _t(w)
    np.testing.assert_allclose(F.rms_norm(dev(x), dev(w), 1e-5).numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    weight = rng.standard_normal((7, 16)).astype(np.float32)
    bias = rng.standard_normal(7).astype(np.float32)
    got = F.linear(dev(x), dev(weight), dev(bias)).numpy()
    np.testing.assert_allclose(got, torch.nn.functional.linear(xt, _t(weight), _t(bias)).numpy(), rtol=1e-5, atol=1e-5)
    got = F.linear(dev(x), dev(weight)).numpy()
    np.testing.assert_allclose(got, torch.nn.functional.linear(xt, _t(weight)).numpy(), rtol=1e-5, atol=1e-5)


def test_embedding_and_argmax_kernels(plugin, no_fallback):
    rng = np.random.default_rng(4)
    table = rng.standard_normal((10, 6)).astype(np.float32)
    ids = np.array([3, 0, 9, 3], np.int64)
    got = F.embedding(dev(ids), dev(table)).numpy()
    np.testing.assert_array_equal(got, torch.nn.functional.embedding(torch.from_numpy(ids), torch.from_numpy(table)).numpy())
    with pytest.raises(PluginAPIError, match="kernel embedding on custom_cpu:1 returned C_ERROR"):
        F.embedding(dev(np.array([10], np.int64)), dev(table))
    vals = rng.standard_normal((3, 11)).astype(np.float32)
    idx, val = F.argmax(dev(vals))
    want_val, want_idx = torch.from_numpy(vals).max(-1)
    np.testing.assert_array_equal(idx.numpy(), want_idx.numpy())
    np.testing.assert_array_equal(val.numpy(), want_val.numpy())


def _rope_reference(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (D/2,)
    ang = pos.double()[:, None] * inv  # (S, D/2)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # (S, 1, D/2)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def test_rope_kernel(plugin, no_fallback):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 3, 8)).astype(np.float32)
    pos = np.array([0, 5, 17, 300], np.int64)
    got = F.rope(dev(x), dev(pos), 10000.0).numpy()
    np.testing.assert_allclose(got, _rope_reference(_t(x), torch.from_numpy(pos), 10000.0).numpy(), rtol=1e-5, atol=1e-5)


def test_self_attention_kernel_with_grouped_heads_and_a_cache(plugin, no_fallback):
    rng = np.random.default_rng(6)
    s, t, h, kh, d = 3, 7, 4, 2, 8
    q = rng.standard_normal((s, h, d)).astype(np.float32)
    k = rng.standard_normal((t, kh, d)).astype(np.float32)
    v = rng.standard_normal((t, kh, d)).astype(np.float32)
    got = F.self_attention(dev(q), dev(k), dev(v), 0.3).numpy()
    qt = _t(q).permute(1, 0, 2)  # (H, S, D)
    kt = _t(k).repeat_interleave(h // kh, dim=1).permute(1, 0, 2)  # (H, T, D)
    vt = _t(v).repeat_interleave(h // kh, dim=1).permute(1, 0, 2)
    mask = torch.arange(t)[None, :] <= torch.arange(s)[:, None] + (t - s)  # (S, T): query i sees keys <= T-S+i
    want = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=0.3).permute(1, 0, 2)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


def test_f16_falls_back_to_the_cpu_kernel(plugin):
    rng = np.random.default_rng(7)
    a, b = (rng.standard_normal(9).astype(np.float16) for _ in range(2))
    got = F.add(Tensor.from_numpy(a, DEV), Tensor.from_numpy(b, DEV)).numpy()
    want = F.add(Tensor.from_numpy(a), Tensor.from_numpy(b)).numpy()
    np.testing.assert_array_equal(got, want)


def test_decoder_layer_matches_cpu(plugin, no_fallback):
    want, got = decoder_layer_chain("cpu"), decoder_layer_chain(DEV)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got["argmax"], want["argmax"])
    np.testing.assert_array_equal(got["transposed"], got["hidden"].T)


def test_model_on_plugin_matches_transformers(plugin, no_fallback, tmp_path):
    import transformers

    write_random_qwen2(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    logits, tokens = random_model_run(DEV)
    prompt = [3, 17, 42, 5, 77, 8]  # the prompt random_model_run uses
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0].numpy()  # (S, V)
        greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
    assert tokens == greedy.tolist()


# ---- recorded plans: plugin kernels inside native stretches ---------------------------------
def decode_logits(device: str, steps: int = 6, python_replay: bool = False, model_path=None):
    """Logits (steps, V) of a greedy decode of ``model_path`` (default: the random Qwen2 of the
    check) on ``device`` after a short prompt, and the decode step's plan. ``python_replay``:
    every recorded call runs from Python (no native forms), the reference the stretches must
    equal bit for bit."""
    from unittest import mock

    from llaisys.kernels.cpu import native_calls
    from llaisys.models import load_model

    if model_path is None:
        model = random_model_on(device)
    else:
        model = load_model(model_path, device=device)
    no_native = mock.patch.object(native_calls, "native_call_of", lambda *args: None)
    with no_native if python_replay else contextlib.nullcontext():
        cache = model.new_cache(4 + steps)
        logits = [model.forward([3, 17, 42, 5], cache)]
        while len(logits) < steps:
            logits.append(model.forward([int(np.argmax(logits[-1]))], cache))
    return np.stack(logits), model.runner.decoding_pass(cache).plan


def random_model_on(device: str):
    import tempfile

    from llaisys.models import load_model

    with tempfile.TemporaryDirectory() as folder:
        write_random_qwen2(folder)
        return load_model(folder, device=device)


def test_plan_runs_plugin_kernels_in_native_stretches(plugin, rows_pass, no_fallback, monkeypatch):
    """A decode step recorded on the plugin's device with its contiguous ops (``RowsPass``,
    every op a plugin kernel) replays as one native call with no kernel called from Python,
    bit for bit as the calls run one by one from Python."""
    from llaisys.models.passes import RowsPass

    kernel_calls = []  # the Python wrapper of a plugin kernel checks each call's status
    check = plugin.backend.check_status
    monkeypatch.setattr(plugin.backend, "check_status", lambda *a: (kernel_calls.append(a[0]), check(*a)))
    logits, plan = decode_logits(DEV)
    stats = plan.stats()
    assert (stats.python, stats.stretches, stats.native) == (0, 1, stats.calls), stats
    model = random_model_on(DEV)
    cache = model.new_cache(4)
    model.forward([3, 17], cache)
    model.forward([42], cache)
    assert isinstance(model.runner.decoding_pass(cache), RowsPass)
    before = len(kernel_calls)
    plan.run()
    assert len(kernel_calls) == before  # a replay calls no kernel from Python
    want, python_plan = decode_logits(DEV, python_replay=True)
    assert python_plan.stats().python == python_plan.stats().calls
    assert len(kernel_calls) > before + python_plan.stats().calls  # which does call them from Python
    np.testing.assert_array_equal(logits, want)
    cpu, _ = decode_logits("cpu")
    np.testing.assert_allclose(logits, cpu, rtol=1e-4, atol=1e-4)
    assert logits.argmax(-1).tolist() == cpu.argmax(-1).tolist()


def test_decoding_moves_cache_rows_from_c(plugin, rows_pass, no_fallback, monkeypatch):
    """Past its first tokens a decode step on the plugin moves its cache rows with one C call
    (no rebind from Python) and still gives, token after token, the logits of the calls run
    one by one from Python; after the plan compiles again it goes back to rebinding the new
    descriptors from the recorded tensors and stays equal."""
    from llaisys.models.passes import RowFields

    steps = 12
    want, _ = decode_logits(DEV, steps=steps, python_replay=True)
    model = random_model_on(DEV)
    cache = model.new_cache(4 + steps)
    logits = [model.forward([3, 17, 42, 5], cache)]
    rebinds = []
    step = None
    while len(logits) < steps:
        if len(logits) == 3:
            step = model.runner.decoding_pass(cache)
            assert isinstance(step._fields, RowFields)  # the rows move in C from here on
            rebind, plan = llaisys.ops.Plan.rebind, step.plan
            monkeypatch.setattr(llaisys.ops.Plan, "rebind",
                                lambda self, *a, **k: (self is plan and rebinds.append(a), rebind(self, *a, **k)))
        if len(logits) == 8:
            step.plan._program = None  # as after anything that makes the plan compile again
        logits.append(model.forward([int(np.argmax(logits[-1]))], cache))
    # one move rebinds from Python (after compiling again): 3 calls per layer
    assert len(rebinds) == 3 * model.config.num_hidden_layers, len(rebinds)
    np.testing.assert_array_equal(np.stack(logits), want)
    assert isinstance(step._fields, RowFields)  # and the C moves resumed


def test_native_stretch_raises_the_plugin_status(plugin):
    """A plugin kernel failing inside a stretch raises PluginAPIError naming it, as the call
    from Python does."""
    x = dev(np.ones((2, 8), np.float32))
    w = Tensor.from_numpy(np.ones(8, np.float32), DEV)
    out = Tensor.empty((2, 8), DataType.F32, DEV)
    plan = llaisys.ops.Plan()
    llaisys.ops.rms_norm(out, x, w, 1e-6, plan=plan)
    plan.run()
    assert plan.stats().stretches == 1
    np.testing.assert_allclose(out.numpy(), np.ones((2, 8)), rtol=1e-5)
    # the kernels refuse a descriptor of the wrong data type: make the recorded one wrong
    native = plan._native[0]
    native.keep[0].descs[0].dtype = abi.to_c_dtype(DataType.F64)
    with pytest.raises(PluginAPIError, match=r"kernel rms_norm on custom_cpu:1 returned C_ERROR"):
        plan.run()


def test_bundled_model_keeps_the_cpu_text_on_the_plugin(plugin, rows_pass):
    """The bundled (quantized) model: the plugin's kernels and the CPU fallback of the
    quantized linear, all in one native stretch, give what the Python replay gives, and the
    CPU's greedy tokens."""
    from llaisys.models import default_model_path

    path = default_model_path()
    logits, plan = decode_logits(DEV, steps=5, model_path=path)
    stats = plan.stats()
    assert stats.stretches == 1 and stats.python == 0, stats  # the quantized embedding in C too
    want, _ = decode_logits(DEV, steps=5, python_replay=True, model_path=path)
    np.testing.assert_array_equal(logits, want)
    cpu, _ = decode_logits("cpu", steps=5, model_path=path)
    assert logits.argmax(-1).tolist() == cpu.argmax(-1).tolist()


def test_bundled_model_head_runs_from_c_on_the_plugin(plugin, rows_pass):
    """The decoding step's output head (a quantized matrix: the CPU fallback on the plugin) is
    a recorded plan replayed in one native stretch, bit for bit as the call from Python."""
    from llaisys.models import default_model_path, load_model

    model = load_model(default_model_path(), device=DEV)
    cache = model.new_cache(8)
    model.forward([3, 17, 42, 5], cache)
    got = model.forward([7], cache)  # (V,)
    step = model.runner.decoding_pass(cache)
    stats = step.head.stats()
    assert (stats.calls, stats.native, stats.stretches, stats.python) == (1, 1, 1, 0), stats
    llaisys.ops.linear(step.ws.logits, step.ws.h_last, model.params.lm_head)  # from Python
    np.testing.assert_array_equal(got, step.ws.logits.numpy().reshape(-1))


def test_rebind_follows_moved_tensors_in_place(plugin):
    """A rebind of a plugin call rewrites its descriptors (pointer, shape) in place; one of
    another rank is refused and leaves them as they were."""
    from llaisys.plugins.kernels import _Descs

    a, b = dev(np.ones((2, 8), np.float32)), dev(np.zeros((3, 8), np.float32))
    descs = _Descs((a, None))
    assert descs.follow(descs.given)
    assert descs.follow((b, None))
    desc = descs.descs[0]
    assert (desc.data, desc.shape[0], desc.shape[1], descs.ptrs[1]) == (b.data_ptr, 3, 8, None)
    assert not descs.follow((dev(np.ones(8, np.float32)), None))
    assert not descs.follow((b,))
    assert (desc.data, desc.shape[0], descs.tensors[0]) == (b.data_ptr, 3, b)
    x, w = dev(np.arange(16, dtype=np.float32).reshape(2, 8)), dev(np.ones(8, np.float32))
    out = Tensor.empty((2, 8), DataType.F32, DEV)
    plan = llaisys.ops.Plan()
    llaisys.ops.rms_norm(out, x, w, 1e-6, plan=plan)
    plan.run()
    x2 = dev(np.arange(16, 40, dtype=np.float32).reshape(3, 8))
    out2 = Tensor.empty((3, 8), DataType.F32, DEV)
    plan.rebind(0, outputs=(out2,), inputs=(x2, w))
    plan.run()
    assert plan.stats().native == 1
    np.testing.assert_array_equal(out2.numpy(), F.rms_norm(x2, w, 1e-6).numpy())


# ---- the conformance check ------------------------------------------------------------------
def test_conformance_check_passes(plugin):
    report = run_check(build_reference_plugin(), device_index=1)
    assert report.ok, report.table()
    assert [r.status for r in report.rows] == [PASS] * len(report.rows), report.table()
    names = [r.name for r in report.rows]
    for needed in ("allocator sizes", "allocate/free odd sizes", "copies (async)", "memset", "stream order",
                   "synchronize device", "events across streams", "host callbacks", "memory stats",
                   "decoder layer vs CPU", "model vs CPU"):
        assert needed in names
    # Device memory of 1 GiB: every row runs at its full size.
    details = {r.name: r.detail for r in report.rows}
    assert "1048589 bytes (allocated as 512, 512, 512, 4608, 1049088)" in details["allocate/free odd sizes"]
    assert details["copies (async)"].startswith("2097159 bytes")
    assert "2-layer Qwen2 logits (6, 96)" in details["model vs CPU"]
    # the dispatch overhead per token, the device's next to the CPU's
    assert re.fullmatch(r"[0-9.]+ ms per token on custom_cpu:1 \((\d+)/\1 calls of the 2-layer decode step in 1 "
                        r"native stretch\(es\), 0 from Python; step [0-9.]+ ms\), cpu [0-9.]+ ms \(\d+/\d+ native; "
                        r"step [0-9.]+ ms\)", details["dispatch per token"]), details["dispatch per token"]


def test_check_command_exit_status(plugin, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "llaisys.cli.plugin", "check", str(build_reference_plugin()), "--no-ops"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK:" in ok.stdout and "stream order" in ok.stdout
    full = subprocess.run([sys.executable, "-m", "llaisys.cli.plugin", "check", str(build_reference_plugin())],
                          capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stdout + full.stderr
    line = next(line for line in full.stdout.splitlines() if line.split()[:3] == ["dispatch", "per", "token"])
    assert re.search(r"pass +[0-9.]+ ms per token on custom_cpu:0 .* cpu [0-9.]+ ms", line), line
    assert "WARNING" not in full.stderr
    bad = tmp_path / "libnot_a_plugin.so"
    bad.write_bytes(b"not an ELF file")
    failed = subprocess.run([sys.executable, "-m", "llaisys.cli.plugin", "check", str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert "cannot be opened" in failed.stdout and FAIL in failed.stdout
    bad_option = subprocess.run([sys.executable, "-m", "llaisys.cli.plugin", "check", str(bad), "--timeout", "-1"],
                                capture_output=True, text=True, timeout=120)
    # a usage error (an option out of range) exits 2, as argparse does
    assert bad_option.returncode == 2 and "--timeout must be >= 0 seconds, got -1" in bad_option.stderr
