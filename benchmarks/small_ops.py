"""The small F32 ops of a decoder layer, native (csrc/ops) next to the NumPy kernels.

rms_norm, add_rms_norm, rope, swiglu and self_attention at SmolLM2-135M shapes (hidden 576,
9 heads and 3 KV heads of dim 64, MLP width 1536) in the decoder's layouts: q and k rotated
out of a slice of the fused qkv buffer, gate and up column slices of one buffer, K and V the
first T rows of a preallocated cache. For S = 1 (decoding), 16 and 128 tokens:

- the median time of one call of each kernel, native and NumPy (both called directly);
- the time of one decoding step's worth of these calls (30 layers: rope, attention, two
  add_rms_norm and swiglu per layer, a separate cache per layer), replayed from an
  ``ops.Plan`` as the model runs them, with and without the attention calls;
- the per-call cost of the native kernels on one-element tensors: the Python and ctypes
  overhead around the C code.

    python3 benchmarks/small_ops.py [--kv 160] [--repeat 100] [--sizes 1,16,128]

``--kv`` is the number of keys a decoding query sees (the cache length T for S = 1; S > 1 runs
over T = kv + S keys, its queries the last S positions). Run it with one BLAS thread on a
quiet machine (OPENBLAS_NUM_THREADS=1): the NumPy attention calls BLAS.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable

from timing import median_seconds

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 30, 576, 9, 3, 64, 1536


class Layout:
    """The decoder's buffers for S tokens over T keys (one KV cache per layer)."""

    def __init__(self, s: int, t: int, rng):
        import numpy as np

        from llaisys import Tensor

        def rand(*shape):
            return Tensor.from_numpy(rng.standard_normal(shape).astype(np.float32))

        dq, dkv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.s, self.t = s, t
        self.x, self.h, self.proj = rand(s, HIDDEN), Tensor.empty((s, HIDDEN)), rand(s, HIDDEN)
        self.norm_w = [rand(HIDDEN) for _ in range(2 * LAYERS)]
        self.qkv = rand(s, dq + 2 * dkv)
        self.qk_in = self.qkv.slice(1, 0, dq + dkv).view(s, HEADS + KV_HEADS, HEAD_DIM)  # strided
        self.qk = Tensor.empty((s, HEADS + KV_HEADS, HEAD_DIM))
        self.q = self.qk.slice(1, 0, HEADS)  # (S, H, Dh) strided
        self.pos = Tensor.from_numpy(np.arange(t - s, t, dtype=np.int64))
        cache_rows = t + 64
        self.k = [rand(cache_rows, KV_HEADS, HEAD_DIM).slice(0, 0, t) for _ in range(LAYERS)]  # (T, KH, Dh)
        self.v = [rand(cache_rows, KV_HEADS, HEAD_DIM).slice(0, 0, t) for _ in range(LAYERS)]
        self.attn = Tensor.empty((s, HEADS, HEAD_DIM))
        self.gate_up = rand(s, 2 * MLP)
        self.gate, self.up = self.gate_up.slice(1, 0, MLP), self.gate_up.slice(1, MLP, 2 * MLP)  # strided
        self.act = Tensor.empty((s, MLP))

    def calls(self) -> dict[str, tuple]:
        """(outputs, inputs, attrs) of one call of each kernel."""
        return {
            "rms_norm": ((self.h,), (self.x, self.norm_w[0]), {"eps": 1e-5}),
            "add_rms_norm": ((self.h, self.x), (self.x, self.proj, self.norm_w[0]), {"eps": 1e-5}),
            "rope": ((self.qk,), (self.qk_in, self.pos), {"theta": 100000.0}),
            "swiglu": ((self.act,), (self.gate, self.up), {}),
            "self_attention": ((self.attn,), (self.q, self.k[0], self.v[0]), {"scale": HEAD_DIM ** -0.5}),
        }

    def step(self, with_attention: bool = True):
        """An ops.Plan of one pass's worth of these ops (the kernels registered now)."""
        from llaisys import ops

        plan = ops.Plan()
        ops.rms_norm(self.h, self.x, self.norm_w[0], 1e-5, plan=plan)
        for layer in range(LAYERS):
            ops.rope(self.qk, self.qk_in, self.pos, 100000.0, plan=plan)
            if with_attention:
                ops.self_attention(self.attn, self.q, self.k[layer], self.v[layer], HEAD_DIM ** -0.5, plan=plan)
            ops.add_rms_norm(self.h, self.x, self.x, self.proj, self.norm_w[2 * layer], 1e-5, plan=plan)
            ops.swiglu(self.act, self.gate, self.up, plan=plan)
            ops.add_rms_norm(self.h, self.x, self.x, self.proj, self.norm_w[2 * layer + 1], 1e-5, plan=plan)
        return plan


def overhead_cases(rng) -> dict[str, Callable[[], object]]:
    """Native kernel calls on one-element problems: what a call costs besides its arithmetic."""
    import numpy as np

    from llaisys import Tensor
    from llaisys.kernels.cpu import native_ops

    def rand(*shape):
        return Tensor.from_numpy(rng.standard_normal(shape).astype(np.float32))

    x, w, out, total = rand(1, 1), rand(1), Tensor.empty((1, 1)), Tensor.empty((1, 1))
    q, k, v, o = rand(1, 1, 2), rand(1, 1, 2), rand(1, 1, 2), Tensor.empty((1, 1, 2))
    pos = Tensor.from_numpy(np.zeros(1, np.int64))
    n = native_ops.KERNELS
    return {
        "rms_norm": lambda: n["rms_norm"]((out,), (x, w), {"eps": 1e-5}),
        "add_rms_norm": lambda: n["add_rms_norm"]((out, total), (x, x, w), {"eps": 1e-5}),
        "rope": lambda: n["rope"]((o,), (q, pos), {"theta": 10000.0}),
        "swiglu": lambda: n["swiglu"]((out,), (x, x), {}),
        "self_attention": lambda: n["self_attention"]((o,), (q, k, v), {"scale": 1.0}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="The small F32 ops, native next to NumPy.")
    parser.add_argument("--kv", type=int, default=160, help="keys a decoding query sees (default 160)")
    parser.add_argument("--repeat", type=int, default=100, help="timed batches per case (the median is shown)")
    parser.add_argument("--sizes", default="1,16,128", help="token counts S (default 1,16,128)")
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

    import numpy as np

    from llaisys.kernels.cpu import native_ops

    if not native_ops.available():
        raise SystemExit("the native library llaisys._native._ops is not built")
    rng = np.random.default_rng(0)
    load = "load average %.2f" % os.getloadavg()[0] if hasattr(os, "getloadavg") else ""
    print(f"SIMD level {native_ops.simd_level()}, {os.cpu_count()} cores, {load}; median of {args.repeat}")

    print("\nper-call cost on one-element tensors (Python + ctypes around the C code):")
    for name, fn in overhead_cases(rng).items():
        print(f"  {name:16} {median_seconds(fn, args.repeat) * 1e6:7.2f} us")

    for s in (int(x) for x in args.sizes.split(",")):
        t = args.kv if s == 1 else args.kv + s
        lay = Layout(s, t, rng)
        print(f"\nS = {s}, T = {t}: one call (native, NumPy, speed-up)")
        for name, call in lay.calls().items():
            ours = median_seconds(lambda: native_ops.KERNELS[name](*call), args.repeat)
            ref = median_seconds(lambda: native_ops.NUMPY_KERNELS[name](*call), args.repeat)
            print(f"  {name:16} {ours * 1e6:9.1f} us {ref * 1e6:9.1f} us {ref / ours:7.1f}x")
        steps = {}
        for native in (True, False):
            native_ops.register(native)
            for attention in (True, False):
                plan = lay.step(attention)
                steps[native, attention] = median_seconds(plan.run, max(5, args.repeat // 10), warmup=2)
        native_ops.register(True)
        print(f"  {LAYERS} layers of them, replayed from a plan: native {steps[True, True] * 1e3:.3f} ms, "
              f"NumPy {steps[False, True] * 1e3:.3f} ms; without attention: native "
              f"{steps[True, False] * 1e3:.3f} ms, NumPy {steps[False, False] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
