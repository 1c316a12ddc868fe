"""geglu (up * gelu_tanh(gate)) and scale (x * factor), the two ops Gemma 3 adds to a decoder:
against PyTorch per dtype and layout, the native F32 kernels against their NumPy reference at
every SIMD level, replayed from a recorded plan inside a native stretch, served on a plugin
device by the CPU fallback, the NVIDIA kernels through Triton's interpreter (or the GPU) and
compiled ahead of time for sm_80/sm_90, and bad arguments."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import llaisys
from llaisys import DataType, Tensor, ops
from llaisys.kernels import find_kernel
from llaisys.kernels.cpu import elementwise, native_calls, native_ops
from llaisys.ops.plan import ReplayStats

from conftest import TOLERANCE, assert_close, dtype_params, to_torch
from test_native_ops import simd  # noqa: F401  (fixture: each SIMD level this CPU runs)

F = ops.functional
native = pytest.mark.skipif(not native_ops.available(), reason="llaisys._native._ops is not built")
native_registered = pytest.mark.skipif(os.environ.get("LLAISYS_NATIVE_OPS", "1").lower() in ("0", "false", "no", "off"),
                                       reason="LLAISYS_NATIVE_OPS=0 keeps the NumPy kernels")
NATIVE, NUMPY = native_ops.KERNELS, native_ops.NUMPY_KERNELS
TORCH_TYPES = {DataType.F32: torch.float32, DataType.F16: torch.float16, DataType.BF16: torch.bfloat16}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(2025)




def gelu_tanh_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return TF.gelu(gate, approximate="tanh") * up


def halves(rows: int, n: int, dtype: DataType, rng, scale: float = 3.0) -> tuple[Tensor, Tensor]:
    """gate and up as the column halves of one (rows, 2n) buffer, as the decoder's MLP has them."""
    buf = Tensor.from_numpy(rng.standard_normal((rows, 2 * n)) * scale, dtype=dtype)
    return buf.slice(1, 0, n), buf.slice(1, n, 2 * n)


def f32(shape, rng, scale: float = 1.0) -> Tensor:
    return Tensor.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))


def run(kernel, out: Tensor, inputs: tuple, attrs: dict) -> np.ndarray:
    kernel((out,), inputs, attrs)
    return out.numpy()


def geglu_bound(gate: np.ndarray, up: np.ndarray, result: np.ndarray, ulps: float) -> np.ndarray:
    """``ulps`` float32 ulps of the terms of 0.5 g (1 + tanh) u: an error of tanh, next to 1,
    counts at |0.5 g u|, however small the result is where tanh is near -1."""
    eps = np.finfo(np.float32).eps
    return ulps * eps * (np.abs(0.5 * gate.astype(np.float64) * up) + np.abs(result))


# ---- the ops against PyTorch --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("shape", [(1, 1536), (5, 17), (2, 3, 33)])
def test_geglu_matches_torch(dtype, shape, rng):
    n, rows = shape[-1], math.prod(shape[:-1])
    gate, up = (t.view(*shape) for t in halves(rows, n, dtype, rng))
    out = Tensor.empty(shape, dtype)
    assert ops.geglu(out, gate, up) is out
    want = gelu_tanh_ref(to_torch(gate), to_torch(up))
    assert_close(out, want)
    assert_close(F.geglu(gate, up), want)


@pytest.mark.parametrize("dtype", dtype_params())
def test_geglu_on_transposed_views_and_a_strided_output(dtype, rng):
    gate = Tensor.from_numpy(rng.standard_normal((7, 4)) * 3, dtype=dtype).permute(1, 0)  # (4, 7), last dim strided
    up = Tensor.from_numpy(rng.standard_normal((4, 7)), dtype=dtype)
    out = Tensor.zeros((4, 10), dtype).slice(1, 2, 9)
    ops.geglu(out, gate, up)
    assert_close(out, gelu_tanh_ref(to_torch(gate), to_torch(up)))


@pytest.mark.parametrize("dtype", dtype_params())
def test_geglu_rounds_once_like_torch_in_float32(dtype, rng):
    """F16/BF16: computed in float32 and rounded once, so within one rounding of torch's float32."""
    gate, up = halves(8, 64, dtype, rng)
    got = F.geglu(gate, up).numpy().astype(np.float64)
    g32, u32 = (to_torch(t, torch.float32) for t in (gate, up))
    want = gelu_tanh_ref(g32, u32).to(TORCH_TYPES[dtype]).double().numpy()
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", dtype_params())
def test_scale_matches_torch(dtype, rng):
    x = Tensor.from_numpy(rng.standard_normal((6, 10)), dtype=dtype).slice(1, 1, 9)  # rows 10 apart
    out = Tensor.empty((6, 8), dtype)
    assert ops.scale(out, x, 0.3) is out
    assert_close(out, to_torch(x) * 0.3)
    assert_close(F.scale(x.permute(1, 0), -2.5), to_torch(x).T * -2.5)


@pytest.mark.parametrize("dtype", dtype_params())
def test_scale_in_place_with_gemmas_rounded_factor_is_torchs_bits(dtype, rng):
    """Gemma multiplies its embeddings by sqrt(hidden_size) cast to their dtype: passed so
    rounded, the product of two values of the dtype is exact in float32, so one rounding gives
    torch's bits."""
    hidden = 640
    tdt = TORCH_TYPES[dtype]
    normalizer = torch.tensor(hidden ** 0.5, dtype=tdt)
    x = Tensor.from_numpy(rng.standard_normal((3, hidden)), dtype=dtype)
    want = (to_torch(x, tdt) * normalizer).float().numpy()
    assert ops.scale(x, x, float(normalizer)) is x  # in place
    np.testing.assert_array_equal(x.numpy().astype(np.float32), want)


def test_empty_tensors_compute_nothing():
    e = Tensor.empty((0, 4))
    assert F.geglu(e, e).shape == (0, 4)
    assert F.scale(e, 2.0).shape == (0, 4)


def test_cpu_kernels_for_the_three_float_types():
    for name in ("geglu", "scale"):
        for dt in (DataType.F16, DataType.BF16):
            assert find_kernel(name, "cpu", dt) is getattr(elementwise, name)
        assert find_kernel(name, "cpu", DataType.F32) is not None


# ---- bad arguments ------------------------------------------------------------------------------
def t(shape, dtype="f32") -> Tensor:
    return Tensor.zeros(shape, dtype)


BAD_CALLS = {
    "geglu up shape": (lambda: ops.geglu(t((2, 3)), t((2, 3)), t((2, 4))), ValueError,
                       r"geglu: up has shape \(2, 4\); expected \(2, 3\)"),
    "geglu gate shape": (lambda: ops.geglu(t((2, 3)), t((3, 2)), t((2, 3))), ValueError,
                         r"geglu: gate has shape \(3, 2\); expected \(2, 3\)"),
    "geglu dtype mismatch": (lambda: ops.geglu(t((2, 3), "f16"), t((2, 3), "f16"), t((2, 3), "bf16")), TypeError,
                             "geglu: up has data type BF16 but out has F16"),
    "geglu integer": (lambda: ops.geglu(t((2,), "i64"), t((2,), "i64"), t((2,), "i64")), TypeError,
                      "geglu: out has data type I64; expected one of BF16, F16, F32"),
    "geglu not a tensor": (lambda: ops.geglu(t((2,)), np.zeros(2), t((2,))), TypeError,
                           "geglu: gate must be a llaisys Tensor, got ndarray"),
    "functional geglu": (lambda: F.geglu(t((2,)), [1.0, 2.0]), TypeError,
                         "geglu: up must be a llaisys Tensor, got list"),
    "scale shape": (lambda: ops.scale(t((2, 3)), t((3, 2)), 2.0), ValueError,
                    r"scale: in has shape \(3, 2\); expected \(2, 3\)"),
    "scale dtype mismatch": (lambda: ops.scale(t((2,)), t((2,), "bf16"), 2.0), TypeError,
                             "scale: in has data type BF16 but out has F32"),
    "scale integer": (lambda: ops.scale(t((2,), "i64"), t((2,), "i64"), 2.0), TypeError,
                      "scale: out has data type I64; expected one of BF16, F16, F32"),
    "scale factor type": (lambda: ops.scale(t((2,)), t((2,)), "2"), TypeError,
                          "scale: factor must be a real number, got str"),
    "scale factor bool": (lambda: ops.scale(t((2,)), t((2,)), True), TypeError,
                          "scale: factor must be a real number, got bool"),
    "scale factor nan": (lambda: ops.scale(t((2,)), t((2,)), float("nan")), ValueError,
                         "scale: factor must be finite, got nan"),
    "scale factor inf": (lambda: F.scale(t((2,)), float("inf")), ValueError, "scale: factor must be finite, got inf"),
    "functional scale": (lambda: F.scale(np.zeros(2), 2.0), TypeError,
                         "scale: in must be a llaisys Tensor, got ndarray"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_name_the_argument(case):
    call, exc, message = BAD_CALLS[case]
    with pytest.raises(exc, match=message):
        call()


def test_device_mismatch_is_named(fake_device):
    with pytest.raises(ValueError, match="geglu: up is on fakedev:0 but out is on cpu:0; all must share a device"):
        ops.geglu(t((2,)), t((2,)), t((2,)).to("fakedev:0"))
    with pytest.raises(ValueError, match="scale: in is on fakedev:0 but out is on cpu:0"):
        ops.scale(t((2,)), t((2,)).to("fakedev:0"), 2.0)


# ---- the native F32 kernels against the NumPy reference -----------------------------------------
@native
@pytest.mark.parametrize("shape", [(1, 6912), (16, 1536), (3, 1), (5, 17), (2, 3, 33)])
def test_native_geglu_matches_numpy_and_torch(shape, simd, rng):
    n, rows = shape[-1], math.prod(shape[:-1])
    gate, up = (t.view(*shape) for t in halves(rows, n, DataType.F32, rng))
    ours = run(NATIVE["geglu"], Tensor.empty(shape), (gate, up), {})
    ref = run(NUMPY["geglu"], Tensor.empty(shape), (gate, up), {})
    g, u = gate.numpy(), up.numpy()
    torch32 = gelu_tanh_ref(torch.from_numpy(g.copy()), torch.from_numpy(u.copy())).numpy()
    for want in (ref, torch32):
        assert (np.abs(ours - want) <= geglu_bound(g, u, want, 4)).all()
    assert_close(Tensor.from_numpy(ours), gelu_tanh_ref(to_torch(gate), to_torch(up)))


@native
def test_native_geglu_accuracy_over_the_float_range(simd):
    """Against float64 on the same float32 inputs, with up = 1, over every magnitude of gate
    (the polynomial below |inner| = 0.625, the exponential above, both tails)."""
    g = np.concatenate([np.linspace(-12, 12, 200001), np.linspace(-1, 1, 20001), np.geomspace(1e-30, 1e4, 2001),
                        -np.geomspace(1e-30, 1e4, 2001)]).astype(np.float32)
    ones = np.ones_like(g)
    ours = run(NATIVE["geglu"], Tensor.empty(g.shape), (Tensor.from_numpy(g), Tensor.from_numpy(ones)), {})
    x = g.astype(np.float64)
    exact = 0.5 * x * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    assert (np.abs(ours - exact) <= geglu_bound(g, ones, exact, 2)).all()


@native
def test_native_geglu_extreme_gates_match_numpy(simd):
    values = [-1e30, -1e4, -100.0, -20.0, -5.0, -0.7, -1e-30, -0.0, 0.0, 1e-30, 0.7, 5.0, 20.0, 100.0, 1e4, 1e30,
              np.inf, -np.inf, np.nan]
    gate = Tensor.from_numpy(np.array(values, np.float32))
    up = Tensor.from_numpy(np.full(len(values), 0.75, np.float32))
    with np.errstate(invalid="ignore", over="ignore"):
        ours = run(NATIVE["geglu"], Tensor.empty((len(values),)), (gate, up), {})
        ref = run(NUMPY["geglu"], Tensor.empty((len(values),)), (gate, up), {})
        want = gelu_tanh_ref(torch.tensor(values, dtype=torch.float32), torch.full((len(values),), 0.75)).numpy()
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref))
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(want))
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(ours), finite)
    bound = geglu_bound(gate.numpy()[finite], up.numpy()[finite], ref[finite], 4)
    assert (np.abs(ours[finite] - ref[finite]) <= bound).all()


@native
@pytest.mark.parametrize("factor", [0.3, -2.5, 25.298221281347036, 1e-30])
def test_native_scale_is_the_numpy_bits(factor, simd, rng):
    x = f32((5, 40), rng, 10.0).slice(1, 3, 37)
    ours = run(NATIVE["scale"], Tensor.empty((5, 34)), (x,), {"factor": factor})
    ref = run(NUMPY["scale"], Tensor.empty((5, 34)), (x,), {"factor": factor})
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(ours, (torch.from_numpy(x.numpy().copy()) * factor).numpy())


@native
def test_every_simd_level_gives_the_same_bits(rng):
    levels = native_ops.simd_levels()
    before = native_ops.simd_level()
    gate, up = halves(4, 77, DataType.F32, rng, 4.0)
    x = f32((4, 77), rng)
    results = {}
    try:
        for level in levels:
            native_ops.set_simd_level(level)
            results[level] = (run(NATIVE["geglu"], Tensor.empty((4, 77)), (gate, up), {}),
                              run(NATIVE["scale"], Tensor.empty((4, 77)), (x,), {"factor": 1.7}))
    finally:
        native_ops.set_simd_level(before)
    for level in levels[1:]:
        for got, want in zip(results[level], results[levels[0]]):
            np.testing.assert_array_equal(got, want, err_msg=level)


@native
def test_native_kernels_run_in_place_and_fall_back_where_they_must(rng, monkeypatch):
    calls = []
    for name in ("geglu", "scale"):
        original = getattr(elementwise, name)
        monkeypatch.setattr(elementwise, name, lambda *a, _f=original, _n=name: (calls.append(_n), _f(*a))[1])
    g, u = f32((3, 40), rng, 3.0), f32((3, 40), rng)
    want = gelu_tanh_ref(to_torch(g), to_torch(u))
    native_ops.geglu((g,), (g, u), {})  # in place over gate: each element read before it is written
    assert_close(g, want)
    x = f32((3, 40), rng)
    want = to_torch(x) * 3.0
    native_ops.scale((x,), (x,), {"factor": 3.0})
    assert_close(x, want)
    assert calls == []
    gs = f32((5, 3), rng).permute(1, 0)  # (3, 5), last dim strided: NumPy
    out = Tensor.empty((3, 5))
    native_ops.geglu((out,), (gs, f32((3, 5), rng)), {})
    buf = f32((5, 16), rng)  # the output one row behind the input in one buffer: NumPy
    want = to_torch(buf.slice(0, 1, 5)) * 0.5
    native_ops.scale((buf.slice(0, 0, 4),), (buf.slice(0, 1, 5),), {"factor": 0.5})
    assert_close(buf.slice(0, 0, 4), want)
    assert calls == ["geglu", "scale"]


@native_registered
def test_native_kernels_registered_for_f32():
    for name in ("geglu", "scale"):
        assert find_kernel(name, "cpu", DataType.F32) is NATIVE[name]
        assert NUMPY[name] is getattr(elementwise, name)


# ---- recorded plans -----------------------------------------------------------------------------
@native
@native_registered
def test_plan_replays_geglu_and_scale_in_one_native_stretch(rng):
    """An embedding scaled in place, a norm, Gemma's MLP activation: one stretch, no Python,
    the bits of the calls made one by one; the blocks follow new values in the same memory."""
    if not native_calls.available():
        pytest.fail("the native ops library is not built; the test suite runs against a built package")
    d, inter = 64, 96
    x, w = f32((3, d), rng), f32((d,), rng)
    gate_up = f32((3, 2 * inter), rng, 3.0)
    h, act = Tensor.empty((3, d)), Tensor.empty((3, inter))
    factor = float(np.float32(d ** 0.5))
    plan = ops.Plan()
    ops.scale(x, x, factor, plan=plan)
    ops.rms_norm(h, x, w, 1e-6, plan=plan)
    ops.geglu(act, gate_up.slice(1, 0, inter), gate_up.slice(1, inter, 2 * inter), plan=plan)
    assert plan.stats() == ReplayStats(calls=3, native=3, stretches=1, python=0)
    for _ in range(2):
        x0, gu0 = x.numpy().copy(), gate_up.numpy().copy()
        plan.run()
        x1 = Tensor.from_numpy(x0)
        ops.scale(x1, x1, factor)
        np.testing.assert_array_equal(x.numpy(), x1.numpy())
        np.testing.assert_array_equal(h.numpy(), F.rms_norm(x1, w, 1e-6).numpy())
        gu1 = Tensor.from_numpy(gu0)
        want = F.geglu(gu1.slice(1, 0, inter), gu1.slice(1, inter, 2 * inter))
        np.testing.assert_array_equal(act.numpy(), want.numpy())
        gate_up.load(rng.standard_normal((3, 2 * inter)).astype(np.float32))


@pytest.mark.parametrize("dtype", [DataType.F16, DataType.BF16])
def test_plan_runs_half_types_from_python(dtype, rng):
    """F16/BF16 have no native form: their calls replay from Python, with the same values."""
    gate, up = halves(2, 24, dtype, rng)
    out, x = Tensor.empty((2, 24), dtype), Tensor.from_numpy(rng.standard_normal((2, 24)), dtype=dtype)
    want_x = F.scale(x, 0.125).numpy()
    plan = ops.Plan()
    ops.geglu(out, gate, up, plan=plan)
    ops.scale(x, x, 0.125, plan=plan)
    plan.run()
    assert plan.stats().python == 2
    np.testing.assert_array_equal(out.numpy(), F.geglu(gate, up).numpy())
    np.testing.assert_array_equal(x.numpy(), want_x)


# ---- a plugin device: no kernels for these, the CPU fallback serves them ------------------------
PLUGIN_DEV = "custom_cpu:1"


@pytest.fixture(scope="module")
def plugin():
    from llaisys.plugins import load_plugin, unload_plugin
    from llaisys.plugins.build import build_reference_plugin

    loaded = load_plugin(build_reference_plugin())
    yield loaded
    llaisys.get_runtime(PLUGIN_DEV).synchronize()
    unload_plugin("custom_cpu")


def test_plugin_device_runs_them_on_the_cpu_fallback(plugin, rng):
    assert find_kernel("geglu", "custom_cpu", DataType.F32) is None
    assert find_kernel("scale", "custom_cpu", DataType.F32) is None
    gate_up = f32((3, 40), rng, 3.0)
    x = f32((3, 20), rng)
    dgu, dx = (Tensor.from_numpy(a.numpy(), device=PLUGIN_DEV) for a in (gate_up, x))
    out = Tensor.zeros((3, 30), device=PLUGIN_DEV).slice(1, 5, 25)  # a strided output: its gaps survive
    ops.geglu(out, dgu.slice(1, 0, 20), dgu.slice(1, 20, 40))
    np.testing.assert_array_equal(out.numpy(), F.geglu(gate_up.slice(1, 0, 20), gate_up.slice(1, 20, 40)).numpy())
    ops.scale(dx, dx, 0.75)
    np.testing.assert_array_equal(dx.numpy(), F.scale(x, 0.75).numpy())


@native_registered
def test_plugin_plan_replays_the_fallback_in_a_native_stretch(plugin, rng):
    if not native_calls.available():
        pytest.fail("the native ops library is not built; the test suite runs against a built package")
    gate_up, x = f32((2, 64), rng, 3.0), f32((2, 32), rng)
    dgu, dx = (Tensor.from_numpy(a.numpy(), device=PLUGIN_DEV) for a in (gate_up, x))
    act = Tensor.empty((2, 32), DataType.F32, PLUGIN_DEV)
    plan = ops.Plan()
    ops.scale(dx, dx, 2.0, plan=plan)
    ops.geglu(act, dgu.slice(1, 0, 32), dx, plan=plan)
    plan.run()
    stats = plan.stats()
    assert (stats.native, stats.stretches, stats.python) == (2, 1, 0), stats
    x2 = F.scale(x, 2.0)
    np.testing.assert_array_equal(dx.numpy(), x2.numpy())
    np.testing.assert_array_equal(act.numpy(), F.geglu(gate_up.slice(1, 0, 32), x2).numpy())


# ---- NVIDIA: Triton through the interpreter (or on the GPU) ----------------------------------------
def close(got: Tensor, want: Tensor, dtype: DataType, what: str = "") -> None:
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(got.numpy().astype(np.float64), want.numpy().astype(np.float64),
                               atol=atol, rtol=rtol, err_msg=what)


def test_nvidia_kernels_registered_for_every_float_type(nvidia_device):
    for name in ("geglu", "scale"):
        for dt in (DataType.F32, DataType.F16, DataType.BF16):
            assert find_kernel(name, "nvidia", dt) is not None, (name, dt)


@pytest.mark.parametrize("dtype", dtype_params())
def test_nvidia_geglu_and_scale_match_the_cpu(nvidia_device, rng, dtype):
    host = rng.standard_normal((4, 66)) * 3
    cpu = Tensor.from_numpy(host, dtype=dtype)
    dev = Tensor.from_numpy(cpu.numpy(), device=nvidia_device)
    outs = []
    for gu, where in ((cpu, "cpu"), (dev, nvidia_device)):
        out = Tensor.empty((4, 33), dtype, where)
        ops.geglu(out, gu.slice(1, 0, 33), gu.slice(1, 33, 66))  # gate and up: strided halves
        outs.append(out)
    close(outs[1], outs[0], dtype, what="geglu")
    g32, u32 = (to_torch(cpu.slice(1, a, a + 33), torch.float32) for a in (0, 33))
    assert_close(outs[1], gelu_tanh_ref(g32.double(), u32.double()), dtype)
    factor = 1 / 3
    want = F.scale(cpu.permute(1, 0), factor)
    close(F.scale(dev.permute(1, 0), factor), want, dtype, what="scale of a transposed view")
    ops.scale(dev, dev, factor)  # in place
    close(dev, F.scale(cpu, factor), dtype, what="scale in place")


def test_nvidia_scale_with_a_rounded_factor_in_a_plan(nvidia_device, rng):
    x = Tensor.from_numpy(rng.standard_normal((2, 640)), dtype=DataType.BF16)
    dx = Tensor.from_numpy(x.numpy(), device=nvidia_device)
    factor = float(torch.tensor(640 ** 0.5, dtype=torch.bfloat16))
    plan = ops.Plan()
    ops.scale(dx, dx, factor, plan=plan)
    plan.run()
    close(dx, F.scale(x, factor), DataType.BF16)


_AOT_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llaisys.kernels.nvidia import aot
for kernel, sig, consts, options in aot.recorded_launches():
    if kernel.__name__ != "_geglu_scale":
        continue
    for arch in (80, 90):
        row = {"arch": arch, "op": consts["OP"], "out": sig["out"]}
        try:
            compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                                      options=options)
            row.update(ok=True, cubin=len(compiled.asm["cubin"]))
        except Exception as exc:
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        print(json.dumps(row))
"""


def test_nvidia_kernel_compiles_for_sm80_and_sm90():
    """``_geglu_scale`` at the models' shapes, both ops, every float type, through ptxas (a
    process without Triton's interpreter)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("compiling the nvidia kernels needs triton and torch (the cuda or test extra)")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LLAISYS_NVIDIA_SIMULATE")}
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    assert {(r["arch"], r["op"], r["out"]) for r in rows} == {
        (arch, op, kind) for arch in (80, 90) for op in (0, 1) for kind in ("*fp32", "*fp16", "*bf16")}
    assert all(r["cubin"] > 0 for r in rows)
