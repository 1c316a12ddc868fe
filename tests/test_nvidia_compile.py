"""Every NVIDIA kernel compiles for the GPUs we target (sm_80, sm_90) at the shapes and types
the models use, with no GPU present: ``llaisys.kernels.nvidia.aot`` in a process per target
(Triton must not be in interpreter mode there; the two run side by side), through ptxas to
cubins. This catches what Triton's interpreter forgives: types, layouts, shared-memory and
register limits. CI compiles the covering subset (``aot --cover``: every argument type and
constexpr value of each kernel, and its largest tiles per float type; 76 of 188 variants);
``LLAISYS_AOT_FULL=1`` compiles every variant."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

KERNELS = {"_attention", "_dequantize", "_rms_norm", "_layer_norm", "_elementwise", "_gelu", "_rope", "_rope_freqs",
           "_kv_write", "_embedding", "_argmax", "_qlinear", "_geglu_scale", "_route", "_group", "_gate_up", "_down",
           "_combine"}


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("compiling the nvidia kernels needs triton and torch (the cuda or test extra)")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LLAISYS_NVIDIA_SIMULATE")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cover = [] if os.environ.get("LLAISYS_AOT_FULL") == "1" else ["--cover"]
    procs = [subprocess.Popen([sys.executable, "-m", "llaisys.kernels.nvidia.aot", "--arch", arch, "--json", *cover],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for arch in ("80", "90")]
    rows, errors = [], []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=900)
            rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if proc.returncode:
                errors.append(err[-4000:])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    failed = [f"{r['kernel']} {r['arch']} {r['constexprs']}: {r['error']}" for r in rows if not r["ok"]]
    assert not errors and not failed, "\n".join(failed) or "\n".join(errors)
    return rows


def test_every_kernel_compiles_for_sm80_and_sm90(compiled):
    for arch in ("sm_80", "sm_90"):
        assert {r["kernel"] for r in compiled if r["arch"] == arch} == KERNELS
    assert all(r["cubin_bytes"] > 0 for r in compiled)


def test_in_every_float_type(compiled):
    for kernel in KERNELS - {"_dequantize", "_qlinear", "_group"}:  # (blocks: uint8; _group: expert ids only)
        kinds = {t for r in compiled if r["kernel"] == kernel for t in r["signature"].values() if t.startswith("*")}
        assert {"*fp32", "*fp16", "*bf16"} <= kinds, (kernel, kinds)


def test_attention_variants_fit_in_shared_memory(compiled):
    attention = [r for r in compiled if r["kernel"] == "_attention"]
    assert {r["constexprs"]["D"] for r in attention} == {64, 128}  # SmolLM2 and Qwen2.5-1.5B heads
    assert {r["constexprs"]["PAGED"] for r in attention} == {True, False}
    assert {r["constexprs"]["ENDS"] for r in attention} == {True, False}  # paged_attention_ends (key_ends)
    assert {r["constexprs"]["Q8"] for r in attention} == {True, False}  # paged_attention_q8: an 8-bit pool
    assert max(r["shared_bytes"] for r in attention) <= 99 * 1024  # sm_86/89 opt-in limit; sm_80/90 allow more


def test_the_8_bit_pool_kernels_compile(compiled):
    """kv_cache_write_q8 and paged_attention_q8 (kv_cache_dtype="int8"): int8 caches under
    queries of every float type, for both targets."""
    for kernel in ("_attention", "_kv_write"):
        q8 = [r for r in compiled if r["kernel"] == kernel and r["constexprs"]["Q8"]]
        assert {r["arch"] for r in q8} == {"sm_80", "sm_90"}, kernel
        assert all(r["signature"]["kc"] == "*i8" and r["signature"]["ks"] == "*fp32" for r in q8), kernel
    attention = {r["signature"]["q"] for r in compiled if r["kernel"] == "_attention" and r["constexprs"]["Q8"]}
    assert attention == {"*fp32", "*fp16", "*bf16"}
