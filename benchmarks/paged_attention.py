"""paged_attention on the CPU: the native kernel next to the NumPy reference, one decoding step.

SmolLM2-135M's attention shape (H = 9 query heads, KH = 3 KV heads, D = 64), B sequences each
decoding one token over a context of C keys, in blocks of BS slots scattered over the pool
(shuffled block tables, as a serving engine's block manager leaves them). One call is one
layer of one step. Prints median (and min) times per call, the native speedup (medians), the
K/V bytes a call reads (B * C * KH * (D + Dv) * 4), the bandwidth the native median makes of
them and the time the call would take at the ``--bandwidth`` figure (default 20 GB/s), next to
the machine's copy bandwidth (a large NumPy copy, measured in the same run). The native column
runs through a recorded ``ops.Plan`` (as the engine replays a step), so it includes the
per-call Python cost; ``kv_write`` is the native kv_cache_write of the step's B tokens.

    python3 benchmarks/paged_attention.py [--batches 1,4,16,32] [--context 512] [--block-size 16]
                                          [--threads N] [--repeat 30]
"""
from __future__ import annotations

import argparse
import math
import statistics
from typing import Callable

import numpy as np

from llaisys import Tensor, ops
from timing import per_call_seconds
from llaisys.kernels.cpu import paged, paged_native
from llaisys.kernels.quant import native as quant_native

H, KH, D = 9, 3, 64


def timings(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median, min) wall time of one call of ``fn`` over ``repeat`` timed batches (each about
    2 ms or one call, whichever is longer)."""
    times = per_call_seconds(fn, repeat, warmup=2, batch_s=2e-3)
    return statistics.median(times), min(times)


def copy_bandwidth(repeat: int) -> float:
    """Bytes per second of a 64 MB NumPy copy (read + write counted)."""
    src, dst = np.ones(16 << 20, np.float32), np.empty(16 << 20, np.float32)
    median, _ = timings(lambda: np.copyto(dst, src), repeat)
    return 2 * src.nbytes / median


def decode_step(b: int, context: int, bs: int, rng: np.random.Generator):
    """Tensors of one decoding step of ``b`` sequences with ``context`` keys each."""
    per_seq = math.ceil(context / bs)
    nb = b * per_seq
    tables = rng.permutation(nb).reshape(b, per_seq)  # (B, MB)
    k_cache = Tensor.from_numpy(rng.standard_normal((nb, bs, KH, D), np.float32))  # (NB, BS, KH, D)
    v_cache = Tensor.from_numpy(rng.standard_normal((nb, bs, KH, D), np.float32))
    q = Tensor.from_numpy(rng.standard_normal((b, H, D), np.float32))  # (N, H, D), one token each
    index = [Tensor.from_numpy(np.asarray(a, np.int64)) for a in (tables, np.arange(b + 1), np.full(b, context))]
    pos = context - 1  # the new token's slot
    slots = Tensor.from_numpy((tables[:, pos // bs] * bs + pos % bs).astype(np.int64))
    kv = Tensor.from_numpy(rng.standard_normal((b, KH, D), np.float32))
    return q, k_cache, v_cache, index, slots, kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,4,16,32", help="decoding sequences per call, comma-separated")
    parser.add_argument("--context", type=int, default=512, help="keys per sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="native pool threads (0: one per CPU)")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--bandwidth", type=float, default=20.0, help="GB/s figure to compare with")
    args = parser.parse_args()
    if not paged_native.available():
        raise SystemExit("the native library is not built (pip install -e . with a C compiler)")
    threads = quant_native.set_threads(args.threads)
    rng = np.random.default_rng(0)
    copy_bw = copy_bandwidth(args.repeat)
    simd = "avx2" if paged_native.set_simd(-1) else "portable"
    print(f"paged_attention, H={H} KH={KH} D={D}, context {args.context}, block size {args.block_size}, "
          f"{threads} thread(s), {simd} path; copy bandwidth {copy_bw / 1e9:.1f} GB/s")
    header = (f"{'B':>4} {'native ms':>10} {'(min)':>7} {'numpy ms':>9} {'(min)':>7} {'speedup':>8} {'K/V MB':>7} "
              f"{'native GB/s':>11} {'@{:g} GB/s ms'.format(args.bandwidth):>13} {'kv_write us':>11}")
    print(header)
    print("-" * len(header))
    for b in (int(x) for x in args.batches.split(",")):
        q, k_cache, v_cache, index, slots, kv = decode_step(b, args.context, args.block_size, rng)
        out = Tensor.empty((b, H, D))
        plan = ops.Plan()
        ops.paged_attention(out, q, k_cache, v_cache, *index, 1 / math.sqrt(D), plan=plan)
        native_med, native_min = timings(plan.run, args.repeat)
        inputs, attrs = (q, k_cache, v_cache, *index), {"scale": 1 / math.sqrt(D)}
        numpy_med, numpy_min = timings(lambda: paged.paged_attention((out,), inputs, attrs), max(5, args.repeat // 3))
        write = ops.Plan()
        ops.kv_cache_write(k_cache, v_cache, kv, kv, slots, plan=write)
        write_med, _ = timings(write.run, args.repeat)
        kv_bytes = b * args.context * KH * 2 * D * 4
        print(f"{b:>4} {native_med * 1e3:>10.3f} {native_min * 1e3:>7.3f} {numpy_med * 1e3:>9.3f} "
              f"{numpy_min * 1e3:>7.3f} "
              f"{numpy_med / native_med:>7.1f}x {kv_bytes / 1e6:>7.2f} {kv_bytes / native_med / 1e9:>11.1f} "
              f"{kv_bytes / (args.bandwidth * 1e9) * 1e3:>13.3f} {write_med * 1e6:>11.1f}")


if __name__ == "__main__":
    main()
