"""paged_attention against self_attention on the CPU: the same attention, paged or contiguous.

Each case is B sequences with S query tokens each over a context of T keys (its last S keys
the queries' own), for one model's attention shape: SmolLM2-135M (H = 9 query heads, KH = 3
KV heads, Dh = 64) or Qwen2.5-1.5B (H = 12, KH = 2, Dh = 128). ``self`` runs
ops.self_attention once per sequence on contiguous (T, KH, Dh) keys and values; ``paged``
runs ops.paged_attention once over a pool of blocks of BS slots holding the same keys (block
tables shuffled, as a serving engine's block manager leaves them; BS 4096 puts each sequence
in one block; the ``long`` cases read more K/V than the caches hold). Both are recorded in an
``ops.Plan`` and timed by replaying it, as the engine runs a step, so the Python cost per call
is the same small one; the two take turns batch by batch. Prints the median (and min) time
per replay in ms and paged / self (medians).

    python3 benchmarks/paged_attention.py [--cases smol,qwen,batch,long] [--threads N] [--simd LEVEL]
                                          [--repeat 30]
"""
from __future__ import annotations

import argparse
import math
import statistics
from typing import Callable

import numpy as np

from llaisys import Tensor, ops
from llaisys.kernels.cpu import paged_native
from llaisys.kernels.quant import native as quant_native
from timing import per_call_seconds

MODELS = {"smol": (9, 3, 64), "qwen": (12, 2, 128)}  # H, KH, Dh
# (model, B, S, T, BS) per case list
CASES = {
    "smol": [("smol", 1, s, t, bs) for bs in (4096, 16)
             for s, t in ((1, 512), (1, 2048), (256, 256), (256, 512), (64, 512))],
    "qwen": [("qwen", 1, s, t, 16) for s, t in ((1, 512), (1, 2048), (256, 256), (256, 512), (64, 512))],
    "batch": [(m, b, s, t, 16) for m in ("smol", "qwen") for b, s, t in ((4, 1, 512), (16, 1, 512), (4, 5, 1024))],
    # decoding over more keys than the caches hold (about 100 MB of K/V), as a model's layers see them
    "long": [("smol", 8, 1, 8192, 16), ("qwen", 4, 1, 8192, 16)],
}


def timings(fns: list[Callable[[], object]], repeat: int) -> list[tuple[float, float]]:
    """(median, min) wall time of one call of each of ``fns`` over ``repeat`` timed batches
    (each about 2 ms or one call, whichever is longer), the functions taking turns batch by
    batch so that whatever else the machine runs weighs on them alike."""
    for fn in fns:
        per_call_seconds(fn, 1, warmup=3, batch_s=2e-3)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times):
            out += per_call_seconds(fn, 1, warmup=0, batch_s=2e-3)
    return [(statistics.median(t), min(t)) for t in times]


def plans(model: str, b: int, s: int, t: int, bs: int, rng: np.random.Generator) -> tuple[ops.Plan, ops.Plan]:
    """The self_attention plan (one call per sequence) and the paged_attention plan (one call)
    of a case, on the same random queries, keys and values."""
    h, kh, d = MODELS[model]
    scale = 1 / math.sqrt(d)
    q = rng.standard_normal((b, s, h, d), np.float32)  # (B, S, H, D)
    k = rng.standard_normal((b, t, kh, d), np.float32)  # (B, T, KH, D)
    v = rng.standard_normal((b, t, kh, d), np.float32)
    contiguous = ops.Plan()  # a plan holds the tensors of its calls
    for i in range(b):
        ops.self_attention(Tensor.empty((s, h, d)), *(Tensor.from_numpy(x[i]) for x in (q, k, v)), scale,
                           plan=contiguous)

    per_seq = math.ceil(t / bs)
    tables = rng.permutation(b * per_seq).reshape(b, per_seq)  # (B, MB)
    pos = np.arange(t)
    k_pool = np.zeros((b * per_seq, bs, kh, d), np.float32)  # (NB, BS, KH, D)
    v_pool = np.zeros_like(k_pool)
    for i in range(b):
        k_pool[tables[i, pos // bs], pos % bs] = k[i]
        v_pool[tables[i, pos // bs], pos % bs] = v[i]
    index = [Tensor.from_numpy(np.asarray(x, np.int64)) for x in (tables, np.arange(b + 1) * s, np.full(b, t))]
    q_flat, out = Tensor.from_numpy(q.reshape(b * s, h, d)), Tensor.empty((b * s, h, d))  # (N, H, D)
    paged = ops.Plan()
    ops.paged_attention(out, q_flat, Tensor.from_numpy(k_pool), Tensor.from_numpy(v_pool), *index, scale, plan=paged)
    return contiguous, paged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="smol,qwen,batch", help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--threads", type=int, default=0, help="native pool threads (0: one per CPU)")
    parser.add_argument("--simd", choices=paged_native.SIMD_LEVELS,
                        help="paged_attention's SIMD level (default: the best)")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    if not paged_native.available():
        raise SystemExit("the native library is not built (pip install -e . with a C compiler)")
    threads = quant_native.set_threads(args.threads)
    if args.simd:
        paged_native.set_simd(paged_native.SIMD_LEVELS.index(args.simd))
    rng = np.random.default_rng(0)
    print(f"{threads} thread(s), paged_attention on its {paged_native.SIMD_LEVELS[paged_native.set_simd(-1)]} path")
    header = (f"{'model':>5} {'B':>3} {'S':>4} {'T':>5} {'BS':>5} {'self ms':>8} {'(min)':>7} {'paged ms':>9} "
              f"{'(min)':>7} {'paged/self':>10}")
    print(header)
    print("-" * len(header))
    for name in args.cases.split(","):
        for model, b, s, t, bs in CASES[name]:
            contiguous, paged = plans(model, b, s, t, bs, rng)
            (self_med, self_min), (paged_med, paged_min) = timings([contiguous.run, paged.run], args.repeat)
            print(f"{model:>5} {b:>3} {s:>4} {t:>5} {bs:>5} {self_med * 1e3:>8.3f} {self_min * 1e3:>7.3f} "
                  f"{paged_med * 1e3:>9.3f} {paged_min * 1e3:>7.3f} {paged_med / self_med:>10.2f}")


if __name__ == "__main__":
    main()
