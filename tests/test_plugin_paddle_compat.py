"""Plugins written the way plugins for PaddlePaddle's custom runtime are (tests/plugins/
paddle_habits.c and .cc): what PaddlePaddle loads, llaisys loads. Also the version-check
macro's semantics, the host trace-event functions, and a plugin that hangs
(tests/plugins/hanging.c) not hanging unload or exit."""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import llaisys
from llaisys import Tensor
from llaisys.backends.plugin import abi
from llaisys.plugins import load_plugin, trace_event_counts, unload_plugin
from llaisys.plugins.build import include_dir
from llaisys.plugins.loader import DEFAULT_EXIT_TIMEOUT, exit_timeout
from conftest import plugin_libraries

HERE = Path(__file__).parent / "plugins"
CXX = shutil.which("g++") or shutil.which("c++")
NO_CXX = "no C++ compiler (g++ or c++) on PATH"
C_BUILDS = {  # name -> (source, macros)
    "habits": ("paddle_habits.c", []),
    "trace": ("paddle_habits.c", ["TRACE_EVENTS", 'DEVICE_TYPE="paddle_trace"']),
    "hang_sync": ("hanging.c", []),
    "hang_finalize": ("hanging.c", ["SYNC_RETURNS", "FINALIZE_HANGS", 'DEVICE_TYPE="hang_fin_dev"']),
}
IFACE_SIZE, PARAMS_SIZE = ctypes.sizeof(abi.C_DeviceInterface), ctypes.sizeof(abi.CustomRuntimeParams)


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    builds = {name: (HERE / src, macros) for name, (src, macros) in C_BUILDS.items()}
    if CXX:  # linked by the C++ driver for its runtime library
        builds["cxx"] = (HERE / "paddle_habits.cc", [], {"extra_flags": ["-std=c++11"], "compiler": CXX})
    yield from plugin_libraries(tmp_path_factory.mktemp("paddle_habits"), builds)


def assert_adds_on(device: str) -> None:
    a = Tensor.from_numpy(np.arange(6, dtype=np.float32), device)
    np.testing.assert_array_equal(llaisys.ops.functional.add(a, a).numpy(), np.arange(6) * 2.0)


def some_ops(device: str) -> dict[str, np.ndarray]:
    """A decoder layer's kinds of op on ``device``, from fixed random inputs, as host arrays."""
    F = llaisys.ops.functional
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((4, 8), np.float32), "w": rng.standard_normal((6, 8), np.float32),
              "b": rng.standard_normal(6, np.float32), "g": np.ones(8, np.float32)}
    t = {name: Tensor.from_numpy(v, device) for name, v in arrays.items()}
    normed = F.rms_norm(t["x"], t["g"], 1e-6)  # (4, 8)
    out = F.linear(normed, t["w"], t["b"])  # (4, 6)
    act = F.swiglu(out, F.add(out, out))  # (4, 6)
    return {"normed": normed.numpy(), "linear": out.numpy(), "swiglu": act.numpy(),
            "transposed": F.rearrange(act.permute(1, 0)).numpy(), "argmax": F.argmax(act)[0].numpy()}


# ---- the header ---------------------------------------------------------------------------------
HEADER_ONLY_SOURCE = """\
#include "llaisys/device_ext.h"
/* Everything here comes from the device header alone, as PaddlePaddle's provides it. */
size_t copy_and_clear(CustomRuntimeParams *params, uint64_t *out) {
  void *scratch = malloc(sizeof(C_DeviceInterface));
  memcpy(scratch, params->interface, sizeof(C_DeviceInterface));
  memset(params->interface, 0, sizeof(C_DeviceInterface));
  profiler_add_runtime_trace_event((C_Profiler)0, scratch);
  free(scratch);
  *out = PADDLE_CUSTOM_RUNTIME_MAJOR_VERSION * 10000 + PADDLE_CUSTOM_RUNTIME_MINOR_VERSION * 100 +
         PADDLE_CUSTOM_RUNTIME_PATCH_VERSION;
  return params->size;
}
"""


@pytest.mark.parametrize("lang, flags", [
    ("c", ["-x", "c", "-std=c11"]),
    ("c++11", ["-x", "c++", "-std=c++11"]),
    ("c++17", ["-x", "c++", "-std=c++17"]),
])
def test_header_alone_gives_what_paddle_plugin_sources_use(tmp_path, lang, flags):
    """memcpy, memset, malloc, free, uint64_t, the version macros and the host functions, with
    no warning in C or C++."""
    compiler = "cc" if lang == "c" else CXX
    if compiler is None:
        pytest.skip(NO_CXX)
    src = tmp_path / "header_only.txt"
    src.write_text(HEADER_ONLY_SOURCE)
    proc = subprocess.run([compiler, *flags, "-Wall", "-Wextra", "-pedantic", "-Werror", f"-I{include_dir()}",
                           "-c", str(src), "-o", str(tmp_path / "header_only.o")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---- plugins with PaddlePaddle's habits ------------------------------------------------------------
def test_plugin_that_memsets_its_table_loads_and_runs(libs, caplog):
    """The memset of the whole table (most PaddleCustomDevice backends do it) is noted at INFO
    once per plugin file, never as a warning, and the plugin runs."""
    from llaisys.plugins import loader

    loader._noted.discard(os.path.realpath(libs["habits"]))  # as in a fresh process
    message = "InitPlugin changed C_DeviceInterface.size from 912 to 0"
    with caplog.at_level(logging.INFO, logger="llaisys.plugins.loader"):
        plugin = load_plugin(libs["habits"])
        unload_plugin(plugin.name)
        plugin = load_plugin(libs["habits"])  # loaded again: nothing new to say
    assert (plugin.name, plugin.version, plugin.backend.device_count()) == ("paddle_habits", (0, 1, 1), 2)
    assert plugin.warnings == [] and len(plugin.notes) == 1 and message in plugin.notes[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert [r.levelno for r in caplog.records if message in r.getMessage()] == [logging.INFO]
    assert plugin.backend.has_events and not plugin.backend.has_streams
    want, got = some_ops("cpu"), some_ops("paddle_habits:1")
    for key in want:  # the CPU kernels on copies: identical results
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    unload_plugin(plugin.name)


def test_paddle_plugin_keeps_the_cpu_greedy_text(libs, f32_quant_math):
    """The bundled model on a PaddlePaddle-style plugin (no kernels: every op on the CPU
    fallback, replayed from C between the plugin's copies) decodes the CPU's greedy tokens,
    its logits equal to float32 rounding (a device without paged kernels attends with the
    contiguous kernel, the CPU with the paged one)."""
    from llaisys.models import load_model

    plugin = load_plugin(libs["habits"])
    try:
        cpu, dev = load_model(device="cpu"), load_model(device="paddle_habits:0")
        runs = []
        for model in (cpu, dev):
            cache = model.new_cache(24)
            logits = [model.forward([1, 504, 3458, 314], cache)]
            while len(logits) < 8:
                logits.append(model.forward([int(np.argmax(logits[-1]))], cache))
            runs.append(np.stack(logits))
        assert runs[1].argmax(-1).tolist() == runs[0].argmax(-1).tolist()
        np.testing.assert_allclose(runs[1], runs[0], rtol=1e-4, atol=1e-4)
        stats = model.runner.decoding_pass(cache).plan.stats()
        assert stats.python <= 1 and stats.stretches == 1, stats  # only the quantized embedding runs from Python
        del dev, cache
    finally:
        unload_plugin(plugin.name)


def test_cxx_plugin_source_builds_and_loads(libs):
    if "cxx" not in libs:
        pytest.skip(NO_CXX)
    plugin = load_plugin(libs["cxx"])
    assert (plugin.name, plugin.sub_device_type, plugin.backend.device_count()) == ("paddle_habits_cxx", "v0.1", 1)
    assert_adds_on("paddle_habits_cxx:0")
    unload_plugin(plugin.name)


def test_plugin_calling_host_trace_functions_loads(libs):
    before = trace_event_counts()
    plugin = load_plugin(libs["trace"])  # its initialize hands over one event of each kind
    after = trace_event_counts()
    assert (after["runtime"] - before["runtime"], after["device"] - before["device"]) == (1, 1)
    assert_adds_on("paddle_trace:0")
    unload_plugin(plugin.name)


@pytest.mark.parametrize("lib", ["habits", "cxx"])
@pytest.mark.parametrize("params_delta, iface_delta, accepted", [
    (0, 0, True),
    (-8, 0, True),   # one size differs: PaddlePaddle's macro goes on
    (0, 8, True),
    (-8, 8, False),  # both differ: it returns before writing anything
])
def test_version_check_macro_refuses_only_when_both_sizes_differ(libs, lib, params_delta, iface_delta, accepted):
    """InitPlugin called directly with the sizes a host of another build would pass."""
    if lib not in libs:
        pytest.skip(NO_CXX)
    init = abi.InitPluginFn(("InitPlugin", ctypes.CDLL(str(libs[lib]))))
    table = abi.C_DeviceInterface()  # the real size: the plugin memsets sizeof(C_DeviceInterface)
    table.size = IFACE_SIZE + iface_delta
    params = abi.CustomRuntimeParams(size=PARAMS_SIZE + params_delta, interface=ctypes.pointer(table))
    init(ctypes.byref(params))
    version = (params.version.major, params.version.minor, params.version.patch)
    assert version == ((0, 1, 1) if accepted else (0, 0, 0))
    assert (params.device_type is not None) == accepted
    assert bool(table.memory_copy_h2d) == accepted


# ---- a plugin that hangs ------------------------------------------------------------------------
EXIT_SCRIPT = """\
import time
import numpy as np
import llaisys
from llaisys.plugins import load_plugin, unload_plugin

plugin = load_plugin({path!r})
t = llaisys.Tensor.from_numpy(np.arange(4, dtype=np.float32), plugin.name + ":0")
assert t.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
del t
if {unload!r}:
    start = time.monotonic()
    unload_plugin(plugin.name)
    print("unloaded in %.1f s" % (time.monotonic() - start), flush=True)
print("exiting", flush=True)
"""


def run_script(path: Path, unload: bool, timeout_s: str = "0.5") -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("LLAISYS_PLUGIN_PATH", "CUSTOM_DEVICE_ROOT")}
    env["LLAISYS_PLUGIN_EXIT_TIMEOUT"] = timeout_s
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT.format(path=str(path), unload=unload)], env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start


def test_exit_does_not_hang_on_a_synchronize_that_never_returns(libs):
    proc, seconds = run_script(libs["hang_sync"], unload=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "exiting"
    assert "libhang_sync.so (hang_dev): synchronize_device did not return within 0.5 s" in proc.stderr
    assert "skipped deinit_device/finalize" in proc.stderr
    assert "hanging plugin: finalize" not in proc.stderr  # not finalized while work may still run
    assert seconds < 60


def test_unload_does_not_hang_on_a_synchronize_that_never_returns(libs):
    proc, _ = run_script(libs["hang_sync"], unload=True)
    assert proc.returncode == 0, proc.stderr
    first, last = proc.stdout.splitlines()
    assert first.startswith("unloaded in ") and float(first.split()[2]) < 30 and last == "exiting"
    assert proc.stderr.count("synchronize_device did not return within 0.5 s") == 1  # exit has nothing left to do


def test_exit_does_not_hang_on_a_finalize_that_never_returns(libs):
    proc, seconds = run_script(libs["hang_finalize"], unload=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("hanging plugin: finalize") == 1
    assert "libhang_finalize.so (hang_fin_dev): deinit_device/finalize did not return within 0.5 s" in proc.stderr
    assert seconds < 60


@pytest.mark.parametrize("value, expected", [("", DEFAULT_EXIT_TIMEOUT), ("2.5", 2.5), ("0", DEFAULT_EXIT_TIMEOUT),
                                             ("-1", DEFAULT_EXIT_TIMEOUT), ("soon", DEFAULT_EXIT_TIMEOUT),
                                             ("inf", DEFAULT_EXIT_TIMEOUT)])
def test_exit_timeout_comes_from_the_environment(monkeypatch, caplog, value, expected):
    monkeypatch.setenv("LLAISYS_PLUGIN_EXIT_TIMEOUT", value)
    with caplog.at_level(logging.WARNING, logger="llaisys.plugins.loader"):
        assert exit_timeout() == expected
    bad = value not in ("", "2.5")
    assert any("is not a positive number of seconds" in r.getMessage() for r in caplog.records) == bad
