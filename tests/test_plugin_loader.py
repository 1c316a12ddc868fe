"""Loading device plugins that are broken on purpose (tests/plugins/variants.c), a minimal one
that runs everything through fallbacks, and discovery from the environment. Every failure
must be a clear PluginError and leave the runtime usable."""
from __future__ import annotations

import contextlib
import logging
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llaisys
from llaisys import MemcpyKind, Tensor
from llaisys.kernels import find_kernel
from llaisys.plugins import (PluginAPIError, PluginError, PluginOutOfMemoryError, load_plugin, load_plugins_from_env,
                             loaded_plugins, unload_plugin)
from llaisys.backends.plugin import abi
from llaisys.tools.plugin_check import FAIL, FALLBACK, decoder_layer_chain, random_model_run, run_check
from llaisys.runtime import KernelNotFoundError, OutOfMemoryError, available_backends, device_types
from conftest import plugin_libraries

SOURCE = Path(__file__).parent / "plugins" / "variants.c"
VARIANTS = {  # name -> macros
    "minimal": ['DEVICE_TYPE="mini_dev"'],
    "no_init": ["NO_INIT_PLUGIN"],
    "wrong_size": ["WRONG_SIZE_CHECK"],
    "missing_apis": ["MISSING_APIS"],
    "paddle_minimum": ["PADDLE_MINIMUM", 'DEVICE_TYPE="paddle_min_dev"'],
    "major": ["VERSION_MAJOR=1", 'DEVICE_TYPE="major_dev"'],
    "old_patch": ["VERSION_PATCH=0"],
    "null_type": ["NULL_DEVICE_TYPE"],
    "init_fails": ["INIT_FAILS", 'DEVICE_TYPE="init_fails_dev"'],
    "bad_status": ["BAD_STATUS", 'DEVICE_TYPE="bad_status_dev"'],
    "small": ["CAPACITY_KB=256", 'DEVICE_TYPE="small_dev"'],
    "foreign_kernel": ["FOREIGN_KERNEL", 'DEVICE_TYPE="foreign_dev"'],
    "failing_kernel": ["FAILING_KERNEL", 'DEVICE_TYPE="failing_dev"'],
    "crash": ["CRASH_IN_D2D", 'DEVICE_TYPE="crash_dev"'],
    "clash_cpu": ['DEVICE_TYPE="cpu"'],
    "env_a": ['DEVICE_TYPE="env_a_dev"'],
    "env_b": ['DEVICE_TYPE="env_b_dev"'],
}


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    yield from plugin_libraries(tmp_path_factory.mktemp("plugins"),
                                {name: (SOURCE, defines) for name, defines in VARIANTS.items()})


@pytest.fixture(scope="module")
def minimal(libs):
    return load_plugin(libs["minimal"])


def registered_state() -> tuple:
    """Device types, backends, kernels and plugins registered now."""
    return ([t.name for t in device_types()], available_backends(), llaisys.kernels.registered_kernels(),
            [p.name for p in loaded_plugins()])


def assert_nothing_left(name: str) -> None:
    assert name not in [t.name for t in device_types()]
    assert name not in available_backends()
    assert not [k for k in llaisys.kernels.registered_kernels() if k[1] == name]


def assert_runtime_usable() -> None:
    a = Tensor.from_numpy(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(llaisys.ops.functional.add(a, a).numpy(), np.arange(4) * 2.0)


# ---- loads that must fail ------------------------------------------------------------------
@pytest.mark.parametrize("variant, message", [
    ("no_init", r"libno_init\.so: does not export InitPlugin"),
    ("wrong_size", r"libwrong_size\.so: InitPlugin did not set the runtime version; it probably refused the "
                   r"struct sizes .*CustomRuntimeParams 88 bytes, C_DeviceInterface 912 bytes"),
    ("missing_apis", r"libmissing_apis\.so \(mini_dev\): required API\(s\) missing: "
                     r"memory_copy_d2h \(or async_memory_copy_d2h\)$"),
    ("old_patch", r"libold_patch\.so \(mini_dev\): built for custom runtime version 0\.1\.0, older than 0\.1\.1"),
    ("null_type", r"libnull_type\.so: InitPlugin left device_type NULL"),
    ("init_fails", r"libinit_fails\.so: initialize on init_fails_dev returned C_ERROR"),
    ("foreign_kernel", r"libforeign_kernel\.so: InitPluginKernels returned C_ERROR \(kernel 'add' for backend "
                       r"'some_other_device', but this plugin's device type is 'foreign_dev'\)"),
    ("clash_cpu", r"libclash_cpu\.so: device type 'cpu' is already registered by llaisys itself"),
])
def test_broken_plugin_is_refused_clearly(libs, variant, message):
    before = registered_state()
    with pytest.raises(PluginError, match=message):
        load_plugin(libs[variant])
    assert registered_state() == before
    assert_runtime_usable()


def test_plugin_without_stats_chunk_size_or_d2d_runs_on_fallbacks(libs):
    """PaddlePaddle loads a plugin without memory stats, min chunk size or a D2D copy; so
    does llaisys: stats are unknown (0), chunks 256 bytes, D2D goes through the host."""
    plugin = load_plugin(libs["paddle_minimum"])
    try:
        assert {"memory_copy_d2d", "device_memory_stats", "device_min_chunk_size"} <= set(plugin.backend.fallbacks())
        assert plugin.backend.memory_stats(0) == (0, 0)
        assert plugin.backend.allocator_sizes(0).min_chunk_size == 256
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        a = Tensor.from_numpy(x, device="paddle_min_dev:0")
        b = a.permute(1, 0).contiguous()  # a device-to-device copy of a strided view
        np.testing.assert_array_equal(b.numpy(), x.T)
        np.testing.assert_array_equal(llaisys.ops.functional.add(a, a).numpy(), 2 * x)
    finally:
        unload_plugin(plugin.name)


def test_newer_runtime_version_loads_with_a_warning(libs, caplog):
    """PaddlePaddle loads any version from 0.1.1 on, so llaisys does too, saying so."""
    with caplog.at_level(logging.WARNING, logger="llaisys.plugins.loader"):
        plugin = load_plugin(libs["major"])
    assert plugin.version == (1, 1, 1)
    assert any("reports custom runtime version 1.1.1; llaisys implements 0.1.x" in w for w in plugin.warnings)
    assert any("libmajor.so (major_dev): reports custom runtime version 1.1.1" in r.getMessage() for r in caplog.records)
    unload_plugin(plugin.name)
    assert_nothing_left("major_dev")


def test_not_a_library(tmp_path):
    bad = tmp_path / "libgarbage.so"
    bad.write_bytes(b"\x7fELF but not really")
    with pytest.raises(PluginError, match=r"libgarbage\.so: cannot be opened"):
        load_plugin(bad)
    with pytest.raises(PluginError, match="no such file"):
        load_plugin(tmp_path / "libmissing.so")


def test_clashing_device_type_is_refused(libs, minimal, tmp_path):
    copy = tmp_path / "libsame_type.so"
    shutil.copy(libs["minimal"], copy)
    with pytest.raises(PluginError, match=r"libsame_type\.so: device type 'mini_dev' is already registered by plugin .*libminimal\.so"):
        load_plugin(copy)
    assert llaisys.runtime.get_backend(minimal.device_type) is minimal.backend  # the first one still serves
    assert load_plugin(libs["minimal"]) is minimal


# ---- a minimal plugin: every optional API and every op through fallbacks --------------------------
def test_minimal_plugin_reports_its_fallbacks(minimal):
    fallbacks = minimal.backend.fallbacks()
    # It implements none of the optional APIs beyond the sync copies, stats and chunk size.
    assert set(fallbacks) == set(abi.FALLBACKS) - {"memory_copy_h2d", "memory_copy_d2h", "memory_copy_d2d",
                                                   "device_memory_stats", "device_min_chunk_size"}
    assert not minimal.kernels and not minimal.warnings


def test_minimal_plugin_runtime_fallbacks_keep_semantics(minimal):
    rt = llaisys.get_runtime("mini_dev:1")
    n = 1000
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    back = np.zeros(n, np.uint8)
    x = rt.malloc(n)
    rt.memset(x, 7, n)  # fallback: H2D copy of a filled buffer
    rt.memcpy(back.ctypes.data, x, n, MemcpyKind.D2H)
    assert (back == 7).all()
    seen = []
    with rt.create_stream() as s:  # fallback: no streams, work is synchronous
        rt.memcpy_async(x, src.ctypes.data, n, MemcpyKind.H2D, s)
        rt.memcpy_async(back.ctypes.data, x, n, MemcpyKind.D2H, s)
        s.add_callback(lambda: seen.append(bool((back == src).all())))
        ev = s.record_event()
        assert ev.query() and s.query()
    assert seen == [True]
    host = rt.malloc_host(64)  # fallback: pageable host memory
    rt.free_host(host, 64)
    rt.free(x)


def test_minimal_plugin_runs_the_decoder_layer_through_cpu_fallback(minimal):
    want, got = decoder_layer_chain("cpu"), decoder_layer_chain("mini_dev:0")
    for key in want:  # the same CPU kernels on copies: identical results
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_minimal_plugin_runs_a_model_through_cpu_fallback(minimal):
    want_logits, want_tokens = random_model_run("cpu")
    logits, tokens = random_model_run("mini_dev:1")
    # the CPU attends through its paged kernel, a device without paged kernels with self_attention
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert tokens == want_tokens


def test_fallback_switched_off_is_a_clear_error(minimal, monkeypatch):
    monkeypatch.setenv("LLAISYS_KERNEL_FALLBACK", "0")
    a = Tensor.from_numpy(np.ones(3, np.float32), "mini_dev:0")
    with pytest.raises(KernelNotFoundError, match=r"no kernel \(add, mini_dev, ANY, F32\) and CPU fallback is off "
                                                  r"\(LLAISYS_KERNEL_FALLBACK=0\)"):
        llaisys.ops.functional.add(a, a)


def test_fallback_logs_once_per_op(minimal, caplog):
    from llaisys.kernels import registry

    registry._fallback_logged.discard(("swiglu", "mini_dev"))
    a = Tensor.from_numpy(np.ones(3, np.float32), "mini_dev:0")
    with caplog.at_level(logging.INFO, logger="llaisys.kernels.registry"):
        for _ in range(3):
            llaisys.ops.functional.swiglu(a, a)
    assert sum("op swiglu has no kernel on mini_dev" in r.getMessage() for r in caplog.records) == 1


def test_check_on_minimal_plugin_passes_with_fallbacks(minimal, libs):
    report = run_check(libs["minimal"])
    assert report.ok, report.table()
    statuses = {r.name: r.status for r in report.rows}
    assert statuses["copies (async)"] == FALLBACK and statuses["memset"] == FALLBACK
    assert statuses["decoder layer vs CPU"] == FALLBACK and statuses["model vs CPU"] == FALLBACK
    assert "kernel rms_norm" in report.table()


# ---- plugins that fail while running ------------------------------------------------------------
def test_api_errors_name_plugin_api_and_status(libs, caplog):
    plugin = load_plugin(libs["bad_status"])
    t = Tensor.from_numpy(np.arange(3, dtype=np.float32), "bad_status_dev:1")  # H2D works
    with pytest.raises(PluginAPIError, match=r"libbad_status\.so: memory_copy_d2h on bad_status_dev:1 returned C_ERROR") as info:
        t.numpy()
    assert (info.value.api, info.value.status) == ("memory_copy_d2h", "C_ERROR")
    with pytest.raises(PluginAPIError, match="device_memory_set on bad_status_dev:1 returned C_FAILED"):
        Tensor.zeros((4,), device="bad_status_dev:1")
    with caplog.at_level(logging.WARNING, logger="llaisys.backends.plugin.backend"):
        for _ in range(3):  # C_WARNING: the values are used, the warning logged once
            assert llaisys.get_runtime("bad_status_dev:1").memory_stats()["total"] == 256 << 20
    assert sum("device_memory_stats returned C_WARNING" in r.getMessage() for r in caplog.records) == 1
    report = run_check(libs["bad_status"])
    assert not report.ok and {r.name for r in report.rows if r.status == FAIL} >= {"copies (sync)", "memset"}
    assert_runtime_usable()
    unload_plugin(plugin.name)
    assert_nothing_left("bad_status_dev")


def test_out_of_memory_mid_run(libs):
    plugin = load_plugin(libs["small"])  # 256 KiB of device memory, 64 KiB chunks
    kept = [Tensor.zeros((4096,), device="small_dev:0") for _ in range(3)]  # 48 KiB
    with pytest.raises(PluginOutOfMemoryError, match=r"device_memory_allocate on small_dev:0 returned C_FAILED") as info:
        kept.append(Tensor.empty((100_000,), device="small_dev:0"))  # 400 KB
    assert isinstance(info.value, OutOfMemoryError)
    x = Tensor.from_numpy(np.arange(8, dtype=np.float32), "small_dev:0")  # still usable
    np.testing.assert_array_equal(llaisys.ops.functional.add(x, x).numpy(), np.arange(8) * 2.0)
    del kept
    big = Tensor.empty((40_000,), device="small_dev:0")  # fits once the others are gone
    assert big.numel() == 40_000
    del big, x
    assert_runtime_usable()
    unload_plugin(plugin.name)


def test_failing_kernel_raises_with_its_name(libs):
    plugin = load_plugin(libs["failing_kernel"])
    assert find_kernel("add", "failing_dev", llaisys.DataType.F32) is not None
    a = Tensor.from_numpy(np.ones(3, np.float32), "failing_dev:0")
    with pytest.raises(PluginAPIError, match=r"libfailing_kernel\.so: kernel add on failing_dev:0 returned C_INTERNAL_ERROR"):
        llaisys.ops.functional.add(a, a)
    np.testing.assert_array_equal(llaisys.ops.functional.swiglu(a, a).numpy(),
                                  llaisys.ops.functional.swiglu(a.to("cpu"), a.to("cpu")).numpy())  # others fall back
    plan = llaisys.ops.Plan()  # recorded, it runs inside a native stretch, and fails the same way
    out = Tensor.empty((3,), device="failing_dev:0")
    llaisys.ops.add(out, a, a, plan=plan)
    assert plan.stats().stretches == 1
    with pytest.raises(PluginAPIError, match=r"libfailing_kernel\.so: kernel add on failing_dev:0 returned C_INTERNAL_ERROR"):
        plan.run()
    del a, out, plan
    unload_plugin(plugin.name)
    assert_nothing_left("failing_dev")


LAYOUT_KERNEL = """\
#include "{variants}"
static C_Status nhwc_rms_norm(const C_Device device, C_Stream stream, const LlaisysTensorDesc *const *outputs,
                              size_t num_outputs, const LlaisysTensorDesc *const *inputs, size_t num_inputs,
                              const LlaisysKernelAttr *attrs, size_t num_attrs) {{
  (void)device, (void)stream, (void)outputs, (void)num_outputs, (void)inputs, (void)num_inputs;
  (void)attrs, (void)num_attrs;
  return C_SUCCESS;
}}
LLAISYS_PLUGIN_EXPORT C_Status InitPluginKernels(LlaisysKernelRegistrar *registrar) {{
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, rms_norm, layout_dev, {layout}, nhwc_rms_norm, FLOAT32);
  return C_SUCCESS;
}}
"""


@pytest.mark.parametrize("layout, refused", [("NHWC", True), ("NCHW", True), ("STRIDED", False),
                                             ("ALL_LAYOUT", False)])
def test_kernel_under_a_layout_never_asked_for_is_refused(tmp_path, layout, refused):
    """Dispatch asks for ANY (strided tensors of any layout) only: a kernel registered under an
    image layout would never run, so the load refuses it, naming the kernel and the layout."""
    from llaisys.plugins.build import build_plugin

    src = tmp_path / "layout.c"
    src.write_text(LAYOUT_KERNEL.format(variants=SOURCE, layout=layout))
    lib = build_plugin(src, tmp_path / "liblayout.so", ['DEVICE_TYPE="layout_dev"'])
    before = registered_state()
    if refused:
        with pytest.raises(PluginError, match=rf"liblayout\.so: InitPluginKernels returned C_ERROR \(kernel "
                                              rf"'rms_norm' \(FLOAT32\) registered under layout {layout}, which "
                                              r"llaisys never asks for"):
            load_plugin(lib)
        assert registered_state() == before
        return
    plugin = load_plugin(lib)
    assert find_kernel("rms_norm", "layout_dev", llaisys.DataType.F32) is not None
    unload_plugin(plugin.name)


def test_native_fallback_equals_the_python_fallback(minimal, f32_quant_math):
    """On a device without kernels a recorded plan runs the CPU fallback from C (the plugin's
    copies around the CPU kernel's native call): the bundled model's decode step is one
    stretch, and its logits are those of the Python fallback bit for bit (and the CPU's, which
    attends through the paged kernel, to float32 rounding)."""
    from unittest import mock

    from llaisys.kernels.cpu import native_calls
    from llaisys.models import load_model

    def decode(device: str, python: bool) -> tuple[np.ndarray, llaisys.ops.Plan]:
        model = load_model(device=device)
        patch = mock.patch.object(native_calls, "native_call_of", lambda *args: None)
        with patch if python else contextlib.nullcontext():
            cache = model.new_cache(12)
            logits = [model.forward([1, 504, 3458], cache)]
            while len(logits) < 6:  # the K/V rows the fallback copies grow each step (rebinds)
                logits.append(model.forward([int(np.argmax(logits[-1]))], cache))
        return np.stack(logits), model.runner.decoding_pass(cache).plan

    native, plan = decode("mini_dev:0", python=False)
    stats = plan.stats()
    assert stats.stretches == 1 and stats.python == 0, stats  # every call native, the quantized embedding too
    python, python_plan = decode("mini_dev:0", python=True)
    assert python_plan.stats().python == python_plan.stats().calls
    np.testing.assert_array_equal(native, python)
    cpu = decode("cpu", python=False)[0]
    np.testing.assert_allclose(native, cpu, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(native.argmax(-1), cpu.argmax(-1))
