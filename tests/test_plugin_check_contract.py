"""The plugin check judges by the contract, and the CPU fallback copies activations, not weights.

The devices are tests/plugins/contract_devices.c built with different macros: valid under the
contract but narrow (a strict allocation granularity, little memory, a synchronize that never
returns) or bare (devices, memory and synchronous copies only, no kernels).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import llaisys
from llaisys import Tensor
from llaisys.plugins import PluginAPIError, load_plugin
from llaisys.runtime.interface import AllocatorSizes
from llaisys.tensor import FrozenTensorError
from llaisys.tools.plugin_check import FAIL, FALLBACK, SKIP, random_model_run, reserved_for, run_check, write_random_qwen2
from conftest import plugin_libraries

F = llaisys.ops.functional
SOURCE = Path(__file__).parent / "plugins" / "contract_devices.c"
VARIANTS = {  # name -> macros
    "strict": ['DEVICE_TYPE="contract_strict"', "STRICT_CHUNK", "EXTRA_PADDING=32"],
    "tiny": ['DEVICE_TYPE="contract_tiny"', "CAPACITY_KB=1024", "MAX_ALLOC_KB=256"],
    "wee": ['DEVICE_TYPE="contract_wee"', "CAPACITY_KB=32", "MAX_ALLOC_KB=16", "MIN_CHUNK=4096", "STRICT_CHUNK"],
    "no_stats": ['DEVICE_TYPE="contract_no_stats"', "NO_STATS", "CAPACITY_KB=1024", "MAX_ALLOC_KB=256"],
    "hang": ['DEVICE_TYPE="contract_hang"', "HANG_SYNC"],
    "bare": ['DEVICE_TYPE="contract_bare"'],
}
BARE = "contract_bare:0"


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    yield from plugin_libraries(tmp_path_factory.mktemp("contract_plugins"),
                                {name: (SOURCE, defines) for name, defines in VARIANTS.items()})


@pytest.fixture(scope="module")
def bare(libs):
    return load_plugin(libs["bare"])


def record_allocations(monkeypatch, plugin) -> list[int]:
    """The sizes the plugin's device_memory_allocate is asked for from now on."""
    sizes: list[int] = []
    real = plugin.backend.allocate

    def allocate(index: int, nbytes: int) -> int:
        sizes.append(nbytes)
        return real(index, nbytes)

    monkeypatch.setattr(plugin.backend, "allocate", allocate)
    return sizes


def record_d2h(monkeypatch, plugin) -> list[tuple[int, int]]:
    """(device pointer, bytes) of each D2H copy from the plugin's device from now on."""
    copies: list[tuple[int, int]] = []
    real = plugin.backend.copy_d2h

    def copy_d2h(index: int, dst: int, src: int, nbytes: int) -> None:
        copies.append((src, nbytes))
        real(index, dst, src, nbytes)

    monkeypatch.setattr(plugin.backend, "copy_d2h", copy_d2h)
    return copies


def failures(report) -> list[str]:
    return [f"{r.name}: {r.detail}" for r in report.rows if r.status == FAIL]


# ---- the check asks only what the contract allows -----------------------------------------------
def test_device_refusing_unaligned_sizes_passes(libs, monkeypatch):
    plugin = load_plugin(libs["strict"])
    with pytest.raises(PluginAPIError, match="device_memory_allocate on contract_strict:0 returned C_ERROR"):
        plugin.backend.allocate(0, 1001)  # the device really is strict
    asked = record_allocations(monkeypatch, plugin)
    report = run_check(libs["strict"])
    assert not failures(report), report.table()
    assert asked and all(n % 256 == 0 for n in asked), sorted(set(asked))
    odd = next(r for r in report.rows if r.name == "allocate/free odd sizes")
    assert "requests of 1, 3, 17, 4097, 1048589 bytes (allocated as 256, 256, 256, 4352, 1048832)" in odd.detail


def test_small_device_has_no_failures_and_stays_within_its_limits(libs, monkeypatch):
    plugin = load_plugin(libs["tiny"])  # 1 MiB, at most 256 KiB held
    asked = record_allocations(monkeypatch, plugin)
    report = run_check(libs["tiny"])
    assert not failures(report), report.table()
    assert max(asked) <= 256 << 10 and all(n % 256 == 0 for n in asked)
    rows = {r.name: r for r in report.rows}
    assert "1048589 left out: above the 256 KiB (1 MiB free, max_alloc_size 256 KiB)" in rows["allocate/free odd sizes"].detail
    assert "131072 bytes through async" in rows["copies (async)"].detail  # scaled down from 2 MiB + 7
    assert rows["model vs CPU"].status != SKIP  # the model is small enough to run


def test_rows_that_cannot_fit_are_skipped_with_the_reason(libs):
    report = run_check(libs["wee"])  # 32 KiB, 16 KiB held at most, 4 KiB granularity
    assert not failures(report), report.table()
    skipped = {r.name: r.detail for r in report.rows if r.status == SKIP}
    assert set(skipped) == {"decoder layer vs CPU", "model vs CPU", "dispatch per token"}, report.table()
    assert "the smallest random model (1 layer) needs more than 16 KiB of device memory; the device offers 16 KiB " \
           "(32 KiB free, max_alloc_size 16 KiB)" in skipped["model vs CPU"]


def test_device_without_memory_stats_is_sized_by_max_alloc_size(libs, monkeypatch):
    plugin = load_plugin(libs["no_stats"])
    asked = record_allocations(monkeypatch, plugin)
    report = run_check(libs["no_stats"])
    assert not failures(report), report.table()
    assert max(asked) <= 256 << 10
    rows = {r.name: r for r in report.rows}
    assert rows["memory stats"].status == FALLBACK and "total and free memory unknown" in rows["memory stats"].detail
    assert "(free memory not reported, max_alloc_size 256 KiB)" in rows["allocate/free odd sizes"].detail


def test_model_row_picks_a_model_the_device_holds():
    sizes = AllocatorSizes(min_chunk_size=256, max_chunk_size=64 << 10, max_alloc_size=64 << 10,
                           extra_padding_size=0, init_alloc_size=64 << 10, realloc_size=64 << 10)
    assert reserved_for(sizes, [1000, 5000]) == 64 << 10  # one chunk holds both
    assert reserved_for(sizes, [40 << 10, 40 << 10]) is None  # beyond max_alloc_size


@pytest.mark.parametrize("options, detail", [
    (["--timeout", "2"], "synchronize_device did not return within 2 s (the row timeout): the plugin hangs"),
    (["--timeout", "0", "--deadline", "3"], "not finished within the check's deadline of 3 s (--deadline)"),
])
def test_hanging_plugin_fails_its_row_in_bounded_time(libs, options, detail):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "llaisys.cli.plugin", "check", str(libs["hang"]), *options],
                          capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 60, proc.stdout
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    row = next(line for line in lines if line.split()[:2] == ["synchronize", "device"])
    assert row.split()[2] == FAIL and detail in row, proc.stdout
    assert any(line.split()[:2] == ["stream", "order"] for line in lines)  # the rows before it were kept
    assert lines[-1].startswith("FAILED:")


# ---- the fallback copies activations, not weights ---------------------------------------------------
def test_fallback_copies_a_frozen_weight_to_the_host_once(bare, monkeypatch):
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((3, 32)).astype(np.float32)
    weight = Tensor.from_numpy(w, BARE).freeze()
    copies = record_d2h(monkeypatch, bare)
    want = F.linear(Tensor.from_numpy(x), Tensor.from_numpy(w)).numpy()
    for step in range(3):
        copies.clear()
        got = F.linear(Tensor.from_numpy(x, BARE), weight)
        np.testing.assert_array_equal(got.numpy(), want)  # the CPU kernel on the same bytes
        from_weight = sum(n for src, n in copies if src == weight.data_ptr)
        assert from_weight == (w.nbytes if step == 0 else 0)


def test_fallback_keeps_the_bytes_between_a_strided_outputs_elements(bare):
    rng = np.random.default_rng(1)
    gate, up = (rng.standard_normal((6, 4)).astype(np.float32) for _ in range(2))
    results = []
    for device in (BARE, "cpu"):
        base = Tensor.from_numpy(np.full((6, 8), 7.0, np.float32), device)
        llaisys.ops.swiglu(base.slice(1, 2, 6), Tensor.from_numpy(gate, device), Tensor.from_numpy(up, device))
        results.append(base.numpy())  # (6, 8): columns 2..5 written, the others kept
    np.testing.assert_array_equal(results[0], results[1])
    assert (results[0][:, :2] == 7).all() and (results[0][:, 6:] == 7).all()

def test_frozen_weight_on_a_device_refuses_writes(bare):
    weight = Tensor.from_numpy(np.ones((2, 3), np.float32), BARE).freeze()
    with pytest.raises(FrozenTensorError, match="op add: cannot write into a frozen .* on contract_bare:0"):
        llaisys.ops.add(weight, weight, weight)
    with pytest.raises(FrozenTensorError, match="copy_"):
        weight.copy_(Tensor.zeros((2, 3)))
    with pytest.raises(FrozenTensorError, match="load"):
        weight.slice(1, 0, 2).load(np.zeros((2, 2), np.float32))
    np.testing.assert_array_equal(weight.numpy(), np.ones((2, 3)))


def test_model_on_a_kernelless_device_copies_no_weight_while_decoding(bare, monkeypatch, tmp_path):
    write_random_qwen2(tmp_path)
    model = llaisys.models.load_model(tmp_path, device=BARE)
    params = [t for layer in model.params.layers for t in vars_of(layer)] + [model.params.embed, model.params.norm]
    assert all(t.frozen for t in params)
    cache = model.new_cache(16)
    token = int(np.argmax(model.forward([3, 17, 42], cache)))  # the host copies are made here
    copies = record_d2h(monkeypatch, bare)
    model.forward([token], cache)
    spans = [(t.storage.ptr, t.storage.ptr + t.storage.nbytes) for t in params]
    assert copies and not [c for c in copies if any(lo <= c[0] < hi for lo, hi in spans)]


def test_model_on_a_kernelless_device_matches_the_cpu(bare):
    logits, tokens = random_model_run(BARE)
    want_logits, want_tokens = random_model_run("cpu")
    # the CPU attends through its paged kernel, a device without paged kernels with self_attention
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert tokens == want_tokens


def vars_of(layer) -> list[Tensor]:
    """The weight tensors of a layer's parameters."""
    return [getattr(layer, f.name) for f in dataclasses.fields(layer) if isinstance(getattr(layer, f.name), Tensor)]
