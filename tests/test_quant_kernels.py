"""Quantized linear kernels (llaisys.kernels.quant) against the gguf package and PyTorch, in
the f32 arithmetic (pinned here; the int16 arithmetic, the default where the CPU has the
integer units, is tested in test_quant_int16.py).

- formats: ids, names and block geometry agree with gguf's table and with the C library;
- reference.dequantize (NumPy) is bit-exact with gguf.quants.dequantize;
- native.dequantize is bit-exact with the reference at every SIMD level this CPU has;
- native.linear matches a float64 PyTorch matmul of gguf's dequantized weights at every level,
  for M in {1, 3, 16, 64, 130} and an odd N (a partial row tile). Tolerance: for each output,
  |y - ref| <= 1e-5 * sum_k |x_k * w_k| (+ 1e-6 for the bias): float32 sums in a blocked order
  stay well inside that (f32 epsilon is 1.2e-7), while a decoding slip is off by ~1e-2 or more;
- batch invariance, at every level and for every format: a row of Y computed alone (M = 1) has
  the same bits as that row inside a call of any M (2 ... 300), wherever it sits in X, with 1
  or 2 threads; 1 and 2 threads give bit-identical outputs; bad inputs raise ValueError;
- the same for every M around the switches between paths (2 ... 65: decoded in registers for a
  few rows, then fused tiles: a few rows of W decoded in registers for the first rows of X and
  kept for the others) on awkward shapes: one block per row, N of 1, 3 and 23 rows (no whole
  tile), M = 63; the batch also matches the NumPy reference (float64 PyTorch product of
  ``reference.dequantize``). Decoded tiles (M = 300 of K = 608 above: X past 512 KB) are in the
  test before.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import gguf

from llaisys.kernels.quant import FORMATS, get_format, native, reference  # noqa: E402

T = gguf.GGMLQuantizationType
ALL_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
N_ODD = 37  # 2 full tiles of 16 rows (3 of 8 for AVX2) and a partial one
# K per format: several blocks and a partial gather group for the 32-element formats (19
# blocks), two super-blocks for the K-quants, an odd length for the plain float formats.
K_OF = {"F32": 77, "F16": 77, "BF16": 77, "Q4_K": 512, "Q5_K": 512, "Q6_K": 512}
K_DEFAULT = 608

pytestmark = pytest.mark.usefixtures("f32_quant_math")  # the float kernels (int16: test_quant_int16.py)
RTOL_ABS = 1e-5  # of sum |x_k * w_k|, see the module docstring

NOT_BUILT = "llaisys._native._kernels was not built: pip install -e . needs a C compiler"


@pytest.fixture
def native_built():
    """The native library must exist wherever the suite runs (the install builds it)."""
    assert native.available(), NOT_BUILT


needs_native = pytest.mark.usefixtures("native_built")


def k_of(name: str) -> int:
    return K_OF.get(name, K_DEFAULT)


def make_weights(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row_bytes) uint8 in format ``name``: gguf's quantization of normal samples where gguf
    can quantize the format; random codes with realistic f16 scales for the K-quants."""
    w = rng.standard_normal((n, k), dtype=np.float32)
    if name == "F32":
        return w.view(np.uint8)
    if name in ("Q4_K", "Q5_K", "Q6_K"):
        fmt = get_format(name)
        raw = rng.integers(0, 256, (n, fmt.row_bytes(k)), dtype=np.uint8)
        blocks = raw.reshape(-1, fmt.block_bytes)
        for at in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[name]:  # d (and dmin)
            blocks[:, at:at + 2] = rng.uniform(1e-3, 1e-2, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
        return raw
    return np.ascontiguousarray(gguf.quants.quantize(w, T[name])).view(np.uint8).reshape(n, -1)


def gguf_dequantize(name: str, raw: np.ndarray) -> np.ndarray:
    """gguf's dequantization of (N, row_bytes) bytes -> float32 (N, K)."""
    if name == "F32":
        return raw.view(np.float32).copy()
    if name == "F16":
        return raw.view(np.float16).astype(np.float32)
    return np.asarray(gguf.quants.dequantize(raw, T[name]), np.float32).reshape(raw.shape[0], -1)


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    return {name: make_weights(name, N_ODD, k_of(name), rng) for name in ALL_TYPES}


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def simd(request):
    """Each SIMD level this CPU runs (the others are skipped); the level in use is restored."""
    assert native.available(), NOT_BUILT
    if request.param not in native.available_simd_levels():
        pytest.skip(f"this CPU lacks {request.param}")
    before = native.simd_level()
    native.set_simd_level(request.param)
    yield request.param
    native.set_simd_level(before)


def assert_linear_close(y: np.ndarray, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, what: str) -> None:
    """y (M, N) against the float64 PyTorch product x @ w^T + bias, under RTOL_ABS."""
    import torch

    x64, w64 = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(w.astype(np.float64))
    ref = (x64 @ w64.T).numpy()
    if bias is not None:
        ref = ref + bias.astype(np.float64)
    scale = (x64.abs() @ w64.abs().T).numpy()  # sum_k |x_k w_k|
    err = np.abs(y.astype(np.float64) - ref)
    worst = float((err - RTOL_ABS * scale - 1e-6).max())
    assert worst <= 0, f"{what}: error exceeds the bound by {worst:.3g} (max error {err.max():.3g})"


# ---- formats -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_TYPES)
def test_format_matches_gguf(name):
    fmt = get_format(name)
    assert fmt.type_id == int(T[name]) and fmt.name == name
    assert (fmt.block_size, fmt.block_bytes) == tuple(gguf.GGML_QUANT_SIZES[T[name]])
    assert get_format(T[name]) is fmt and get_format(name.lower()) is fmt and get_format(int(T[name])) is fmt
    assert fmt.row_bytes(fmt.block_size * 3) == 3 * fmt.block_bytes


@needs_native
@pytest.mark.parametrize("name", ALL_TYPES)
def test_format_matches_native_library(name):
    lib, fmt = native._library(), get_format(name)
    assert (lib.llaisys_quant_block_size(fmt.type_id), lib.llaisys_quant_block_bytes(fmt.type_id)) == \
        (fmt.block_size, fmt.block_bytes)


def test_format_errors():
    with pytest.raises(ValueError, match="Q2_K"):
        get_format(T.Q2_K)
    with pytest.raises(ValueError, match="unsupported"):
        get_format("Q9_9")
    with pytest.raises(ValueError, match="blocks of 256"):
        get_format("Q4_K").row_bytes(576)
    with pytest.raises(ValueError, match="blocks of 20 bytes"):
        get_format("Q4_1").row_elements(30)
    assert set(FORMATS) == {int(T[n]) for n in ALL_TYPES}


# ---- dequantization ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_TYPES)
def test_reference_dequantize_bit_exact_with_gguf(name, weights):
    raw = weights[name]
    got = reference.dequantize(name, raw)
    want = gguf_dequantize(name, raw)
    assert got.dtype == np.float32 and got.shape == (N_ODD, k_of(name))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", ALL_TYPES)
def test_reference_dequantize_any_bytes(name):
    """Arbitrary bytes (inf and nan scales included) decode like gguf's, nan for nan."""
    fmt = get_format(name)
    raw = np.random.default_rng(7).integers(0, 256, (5, fmt.row_bytes(k_of(name))), dtype=np.uint8)
    with np.errstate(all="ignore"):
        got, want = reference.dequantize(name, raw), gguf_dequantize(name, raw)
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_native_dequantize_bit_exact(name, simd, weights):
    raw = weights[name]
    got = native.dequantize(name, raw)
    want = reference.dequantize(name, raw)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{name} at {simd}"
    fmt = get_format(name)
    any_bytes = np.random.default_rng(8).integers(0, 256, (3, fmt.row_bytes(k_of(name))), dtype=np.uint8)
    with np.errstate(all="ignore"):
        assert np.array_equal(native.dequantize(name, any_bytes), reference.dequantize(name, any_bytes),
                              equal_nan=True), f"{name} at {simd}, arbitrary bytes"


@needs_native
def test_rows_for_embedding_lookup(weights):
    weight = native.prepare("Q8_0", weights["Q8_0"])
    ids = np.array([[3, 0], [36, 3]])
    got = weight.rows(ids)
    assert got.shape == (2, 2, K_DEFAULT)
    assert np.array_equal(got, reference.dequantize("Q8_0", weights["Q8_0"])[ids])
    with pytest.raises(ValueError, match=r"\[0, 37\)"):
        weight.rows([37])
    with pytest.raises(ValueError, match="integers"):
        weight.rows([1.0])


# ---- linear ------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 3, 16, 64, 130])
@pytest.mark.parametrize("name", ALL_TYPES)
def test_native_linear_matches_torch(name, m, simd, weights):
    raw = weights[name]
    w = gguf_dequantize(name, raw)
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, w.shape[1]), dtype=np.float32)
    bias = rng.standard_normal(N_ODD, dtype=np.float32) if m != 3 else None
    y = native.linear(x, name, raw, bias=bias)
    assert y.shape == (m, N_ODD) and y.dtype == np.float32
    assert_linear_close(y, x, w, bias, f"{name} M={m} at {simd}")


INVARIANCE_M = (2, 3, 5, 16, 17, 64, 130, 300)
N_INVARIANCE = 150  # two 64-row tiles (the M > 32 path) and a partial one; 9 + 6 rows of 16


@pytest.mark.parametrize("name", ALL_TYPES)
def test_rows_are_batch_invariant(name, simd):
    """Row r of Y has the same bits computed alone, inside a call of any M, at any position of
    X, with 1 or 2 threads: every path (M = 1 in registers, M > 1 from decoded tiles, any
    block and tile shape, any split over threads) follows one arithmetic per output."""
    k = k_of(name)
    rng = np.random.default_rng(21)
    weight = native.prepare(name, make_weights(name, N_INVARIANCE, k, rng))
    x = rng.standard_normal((max(INVARIANCE_M) + 7, k), dtype=np.float32)
    bias = rng.standard_normal(N_INVARIANCE, dtype=np.float32)
    before = native.threads()
    try:
        native.set_threads(1)
        alone = np.concatenate([weight.linear(x[r:r + 1], bias) for r in range(len(x))])  # (R, N)
        for threads in (1, 2):
            native.set_threads(threads)
            for m in INVARIANCE_M:
                start = m % 7  # the rows sit at another offset in each call
                got = weight.linear(x[start:start + m], bias)
                same = got.view(np.uint32) == alone[start:start + m].view(np.uint32)
                assert same.all(), (f"{name} at {simd}, M={m}, {threads} thread(s): rows "
                                    f"{sorted(set(np.nonzero(~same)[0] + start))[:5]} differ from their M = 1 result")
    finally:
        native.set_threads(before)


@pytest.mark.parametrize("name", ["BF16", "F16", "Q4_0", "Q6_K"])
def test_wide_rows_keep_their_bits_in_shorter_tiles(name, simd):
    """A K wide enough that the many-rows path cuts its tiles of W to fit L2 (4864: 24 rows of
    W, not 64): every row still has its M = 1 bits, and lies near the float64 product."""
    k = 4864
    rng = np.random.default_rng(22)
    raw = make_weights(name, 53, k, rng)
    weight = native.prepare(name, raw)
    x = rng.standard_normal((160, k), dtype=np.float32)
    before = native.threads()
    try:
        for threads in (1, 2):
            native.set_threads(threads)
            got = weight.linear(x)
            alone = np.concatenate([weight.linear(x[r:r + 1]) for r in range(0, 160, 23)])
            assert np.array_equal(got[::23].view(np.uint32), alone.view(np.uint32)), f"{name}, {threads} thread(s)"
    finally:
        native.set_threads(before)
    assert_linear_close(got, x, gguf_dequantize(name, raw), None, f"{name}, K = {k}")


SWITCH_M = (2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65)


def awkward_shapes(name: str) -> list[tuple[int, int]]:
    """(N, K): one block per row with fewer rows than any tile (1, 3) and a partial tile (23),
    then a few blocks per row (an odd length for the plain float formats)."""
    block = get_format(name).block_size
    k_min, k_more = (1, 35) if block == 1 else (block, 3 * block)
    return [(1, k_min), (3, k_min), (23, k_min), (23, k_more)]


@pytest.mark.parametrize("name", ALL_TYPES)
def test_every_batched_path_matches_one_row_bitwise(name, simd):
    """Each path for M > 1 (registers for a few rows, then the fused tiles where the level has
    them, or decoded tiles) gives a row the bits it has alone, on shapes that leave partial
    tiles everywhere; the batch agrees with the NumPy reference within tolerance."""
    rng = np.random.default_rng(31)
    for n, k in awkward_shapes(name):
        raw = make_weights(name, n, k, rng)
        weight = native.prepare(name, raw)
        x = rng.standard_normal((max(SWITCH_M) + 2, k), dtype=np.float32)
        bias = rng.standard_normal(n, dtype=np.float32)
        alone = np.concatenate([weight.linear(x[r:r + 1], bias) for r in range(len(x))])  # (R, N)
        for m in SWITCH_M:
            start = m % 3
            got = weight.linear(x[start:start + m], bias)
            same = got.view(np.uint32) == alone[start:start + m].view(np.uint32)
            assert same.all(), (f"{name} at {simd}, N={n} K={k} M={m}: rows "
                                f"{sorted(set(np.nonzero(~same)[0] + start))[:5]} differ from their M = 1 result")
        assert_linear_close(alone, x, reference.dequantize(name, raw), bias, f"{name} at {simd}, N={n} K={k}")


@needs_native
def test_fma_peak_is_measured():
    """The benchmark's yardstick: multiply-adds per second of FMA chains in registers."""
    assert native.fma_peak(repeat=1, rounds=1000) > 1e8


def test_portable_path_is_batch_invariant():
    """Without the native library (kernels.cpu.quantized.PortableWeight) each row is still
    computed alone: its bits do not depend on M."""
    from llaisys.kernels.cpu.quantized import PortableWeight

    rng = np.random.default_rng(22)
    weight = PortableWeight("Q4_1", make_weights("Q4_1", N_ODD, K_DEFAULT, rng))
    x = rng.standard_normal((9, K_DEFAULT), dtype=np.float32)
    bias = rng.standard_normal(N_ODD, dtype=np.float32)
    batch = weight.linear(x, bias)
    for r in range(len(x)):
        assert np.array_equal(weight.linear(x[r:r + 1], bias).view(np.uint32), batch[r:r + 1].view(np.uint32))
    assert_linear_close(batch, x, gguf_dequantize("Q4_1", weight.raw), bias, "portable path")


@needs_native
def test_native_linear_strided_rows_and_out(weights):
    """x and out may be row slices of wider arrays; out receives the result in place."""
    raw, w = weights["Q4_1"], gguf_dequantize("Q4_1", weights["Q4_1"])
    rng = np.random.default_rng(6)
    wide_x = rng.standard_normal((5, K_DEFAULT + 40), dtype=np.float32)
    x = wide_x[:, 8:8 + K_DEFAULT]  # (5, K) with row stride K + 40
    wide_out = np.full((5, N_ODD + 3), 7.0, np.float32)
    y = native.prepare("Q4_1", raw).linear(x, out=wide_out[:, :N_ODD])
    assert np.shares_memory(y, wide_out) and np.all(wide_out[:, N_ODD:] == 7.0)
    assert_linear_close(wide_out[:, :N_ODD], x, w, None, "strided")
    x1 = wide_x[2:3, 8:8 + K_DEFAULT]
    assert_linear_close(native.linear(x1, "Q4_1", raw), x1, w, None, "one strided row")


@needs_native
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K", "F16"])
@pytest.mark.parametrize("m", [1, 16])
def test_thread_count_does_not_change_results(name, m):
    """Work is split by rows of W only, so 1 and 2 threads give the same bits."""
    k = k_of(name)
    raw = make_weights(name, 3000, k, np.random.default_rng(9))  # over 1 MB: M = 1 is split too
    x = np.random.default_rng(10).standard_normal((m, k), dtype=np.float32)
    before = native.threads()
    try:
        native.set_threads(1)
        one = native.linear(x, name, raw)
        native.set_threads(2)
        two = [native.linear(x, name, raw) for _ in range(3)]
    finally:
        native.set_threads(before)
    for y in two:
        assert np.array_equal(one.view(np.uint32), y.view(np.uint32))


@needs_native
def test_concurrent_callers():
    """Two Python threads calling into the pool at once both get correct results."""
    raw = make_weights("Q8_0", 600, 576, np.random.default_rng(11))
    weight = native.prepare("Q8_0", raw)
    xs = [np.random.default_rng(s).standard_normal((m, 576), dtype=np.float32) for s, m in ((1, 1), (2, 8))]
    expected = [weight.linear(x) for x in xs]
    failures = []

    def worker(i):
        for _ in range(30):
            if not np.array_equal(weight.linear(xs[i]), expected[i]):
                failures.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@needs_native
def test_smollm2_weight(smollm2_path):
    """A real Q4_1 projection of SmolLM2-135M (K = 576, N = 1536)."""
    from llaisys.models.loaders.gguf import open_gguf  # the project's fast metadata reader

    reader = open_gguf(str(smollm2_path))
    tensor = next(t for t in reader.tensors if t.tensor_type == T.Q4_1 and tuple(t.shape) == (576, 1536))
    raw = np.asarray(tensor.data)  # (1536, row_bytes) uint8
    w = gguf_dequantize("Q4_1", raw)
    x = np.random.default_rng(12).standard_normal((4, 576), dtype=np.float32)
    for m in (1, 4):
        assert_linear_close(native.linear(x[:m], "Q4_1", raw), x[:m], w, None, f"{tensor.name} M={m}")


# ---- errors and settings -----------------------------------------------------------------------

@needs_native
def test_bad_inputs_raise_value_error(weights):
    raw = weights["Q4_1"]
    x = np.zeros((2, K_DEFAULT), np.float32)
    cases = {
        "float32": lambda: native.linear(x.astype(np.float64), "Q4_1", raw),
        "K=": lambda: native.linear(np.zeros((2, 64), np.float32), "Q4_1", raw),
        "2-D": lambda: native.linear(np.zeros(K_DEFAULT, np.float32), "Q4_1", raw),
        "contiguous": lambda: native.linear(np.zeros((K_DEFAULT, 2), np.float32).T, "Q4_1", raw),
        "non-overlapping": lambda: native.linear(np.broadcast_to(x[:1], x.shape), "Q4_1", raw),
        "C-contiguous": lambda: native.linear(x, "Q4_1", np.asfortranarray(raw)),
        "blocks of 20 bytes": lambda: native.linear(x, "Q4_1", raw[:, :30].copy()),
        "unsupported": lambda: native.linear(x, 10, raw),
        "bias": lambda: native.linear(x, "Q4_1", raw, bias=np.zeros(N_ODD + 1, np.float32)),
        "out must have shape": lambda: native.linear(x, "Q4_1", raw, out=np.zeros((2, N_ODD + 1), np.float32)),
        "overlap": lambda: native.linear(x, "Q4_1", raw, out=x[:, :N_ODD]),
        "even address": lambda: native.linear(x, "Q4_1", np.zeros(raw.size + 1, np.uint8)[1:].reshape(raw.shape)),
        "uint8": lambda: native.linear(x, "Q4_1", raw.view(np.int8)),
        "NumPy array": lambda: native.dequantize("Q4_1", raw.tolist()),
        "out must be C-contiguous": lambda: native.dequantize("Q4_1", raw, out=np.zeros((N_ODD, 3), np.float32)),
    }
    for expected, call in cases.items():
        with pytest.raises(ValueError, match=expected):
            call()
    with pytest.raises(ValueError, match="not available"):
        native.set_simd_level("avx9000")
    with pytest.raises(ValueError, match="non-negative"):
        native.set_threads(-1)


@needs_native
def test_float_weights_in_their_own_dtype(weights):
    """F16/BF16/F32 weights may be passed as (N, K) arrays of their dtype, not only bytes."""
    w16 = weights["F16"].view(np.float16)  # (N, K)
    x = np.random.default_rng(13).standard_normal((2, w16.shape[1]), dtype=np.float32)
    assert np.array_equal(native.linear(x, "F16", w16), native.linear(x, "F16", weights["F16"]))
    with pytest.raises(ValueError, match="uint8"):
        native.linear(x, "Q8_0", w16)


@needs_native
def test_simd_env_variable_forces_a_level():
    code = "from llaisys.kernels.quant import native; print(native.simd_level())"
    for want in ("scalar", "nonsense"):
        env = dict(os.environ, LLAISYS_SIMD=want, LLAISYS_QUANT_MATH="f32")
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        assert got.strip() == (want if want == "scalar" else native.available_simd_levels()[-1])


def _linear_in_child(queue, raw, x):
    queue.put(native.prepare("Q4_1", raw).linear(x))


def test_a_forked_child_starts_its_own_thread_pool():
    """A fork child has the pool's memory but not its worker threads: its calls still give the
    parent's results, on workers of its own (started at its first call)."""
    import multiprocessing

    rng = np.random.default_rng(5)
    raw = make_weights("Q4_1", 4096, 256, rng)  # large enough to be split over threads
    x = rng.standard_normal((1, 256), dtype=np.float32)
    before = native.threads()
    try:
        native.set_threads(2)
        want = native.prepare("Q4_1", raw).linear(x)  # the parent's pool is running
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_linear_in_child, args=(queue, raw, x))
        child.start()
        got = queue.get(timeout=60)
        child.join(timeout=60)
        assert child.exitcode == 0
        np.testing.assert_array_equal(got, want)
        assert_linear_close(got, x, gguf_dequantize("Q4_1", raw), None, "forked child")
    finally:
        native.set_threads(before)
