"""Per-call cost of the core ops on the CPU, next to PyTorch in the same run.

Decoding one token of a 135M model runs about 30 layers x 13 ops, so besides the big matrix
products the fixed cost of one op call (argument checks, kernel dispatch, NumPy views) counts.
Shapes follow SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49152, 9 query heads and 3
key/value heads of dim 64.

    python3 benchmarks/ops_bench.py [--repeat 200] [--kv 512] [--threads N]

Prints the median time per call of each case for llaisys and torch and their ratio
(llaisys / torch: above 1 means llaisys is slower). ``--threads`` sets the BLAS and torch
thread counts before either library loads; on a busy machine one thread gives steadier
figures, because a BLAS thread that loses its core stalls the whole product.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable

from timing import median_seconds


def cases(kv_len: int, torch) -> list[tuple[str, float, Callable[[], object], Callable[[], object] | None]]:
    """(name, flops per call, llaisys call, torch call or None) for each benchmark case."""
    import numpy as np

    import llaisys
    from llaisys import ops
    from llaisys.ops import functional as F

    rng = np.random.default_rng(0)

    def pair(shape):
        host = rng.standard_normal(shape, dtype=np.float32)  # shape
        return llaisys.Tensor.from_numpy(host), (torch.from_numpy(host.copy()) if torch else None)

    ref = (lambda fn: fn) if torch else (lambda fn: None)
    out = []

    a, ta = pair((4,))
    b, tb = pair((4,))
    c, tc = pair((4,))
    out.append(("add (4,) into out", 0.0, lambda: ops.add(c, a, b), ref(lambda: torch.add(ta, tb, out=tc))))
    out.append(("add (4,) functional", 0.0, lambda: F.add(a, b), ref(lambda: torch.add(ta, tb))))

    x, tx = pair((1, 576))
    nrm, tnrm = pair((576,))
    y, ty = pair((1, 576))
    out.append(("rms_norm (1, 576)", 0.0, lambda: ops.rms_norm(y, x, nrm, 1e-5),
                ref(lambda: torch.nn.functional.rms_norm(tx, (576,), tnrm, 1e-5))))

    q, tq = pair((1, 9, 64))
    qo, _ = pair((1, 9, 64))
    pos = llaisys.Tensor.from_numpy(np.array([kv_len - 1], dtype=np.int64))
    if torch:
        tpos = torch.tensor([kv_len - 1])
        inv = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float32) / 64)  # (32,)

        def torch_rope():
            phi = (tpos[:, None] * inv)[:, None, :]  # (1, 1, 32)
            cos, sin = phi.cos(), phi.sin()
            a_, b_ = tq[..., :32], tq[..., 32:]
            return torch.cat([a_ * cos - b_ * sin, b_ * cos + a_ * sin], dim=-1)
    out.append(("rope (1, 9, 64)", 0.0, lambda: ops.rope(qo, q, pos, 10000.0), ref(torch_rope) if torch else None))

    g, tg = pair((1, 1536))
    u, tu = pair((1, 1536))
    h, _ = pair((1, 1536))
    out.append(("swiglu (1, 1536)", 0.0, lambda: ops.swiglu(h, g, u),
                ref(lambda: torch.nn.functional.silu(tg) * tu)))

    for n in (576, 1536, 49152):
        wn, twn = pair((n, 576))
        yn, _ = pair((1, n))
        out.append((f"linear 1x576 @ {n}x576^T", 2.0 * n * 576,
                    (lambda wn=wn, yn=yn: ops.linear(yn, x, wn)),
                    ref(lambda twn=twn: torch.nn.functional.linear(tx, twn))))

    k, tk = pair((kv_len, 3, 64))
    v, tv = pair((kv_len, 3, 64))
    att, _ = pair((1, 9, 64))
    scale = 64 ** -0.5
    if torch:
        tq4, tk4, tv4 = tq.transpose(0, 1), tk.transpose(0, 1), tv.transpose(0, 1)  # (heads, len, 64)

        def torch_attention():
            return torch.nn.functional.scaled_dot_product_attention(tq4, tk4, tv4, scale=scale, enable_gqa=True)
    out.append((f"self_attention decode T={kv_len}", 4.0 * 9 * 64 * kv_len,
                lambda: ops.self_attention(att, q, k, v, scale), torch_attention if torch else None))

    logits, tlogits = pair((49152,))
    idx = llaisys.Tensor.empty((1,), "i64")
    val = llaisys.Tensor.empty((1,), "f32")
    out.append(("argmax (49152,)", 0.0, lambda: ops.argmax(idx, val, logits),
                ref(lambda: torch.max(tlogits, dim=-1))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Per-call cost of the core ops next to PyTorch.")
    parser.add_argument("--repeat", type=int, default=200, help="timed batches per case (the median is shown)")
    parser.add_argument("--kv", type=int, default=512, help="KV length of the attention decode step")
    parser.add_argument("--threads", type=int, default=0, help="BLAS and torch threads (default: the libraries' own)")
    args = parser.parse_args()
    if args.threads:  # before NumPy's BLAS and torch start their thread pools
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)

    import numpy as np

    import llaisys

    try:
        import torch
    except ImportError:  # the torch column stays empty
        torch = None
    if torch and args.threads:
        torch.set_num_threads(args.threads)
    threads = f"torch threads {torch.get_num_threads()}" if torch else "torch not installed"
    load = "load average %.2f" % os.getloadavg()[0] if hasattr(os, "getloadavg") else ""
    print(f"llaisys {llaisys.__version__}, numpy {np.__version__}, {threads}, {os.cpu_count()} cores, "
          f"{load}; median of {args.repeat}")
    print(f"{'case':34} {'llaisys':>11} {'torch':>11} {'ratio':>7} {'GFLOP/s':>8}")
    for name, flops, ours, theirs in cases(args.kv, torch):
        t_ours = median_seconds(ours, args.repeat)
        t_ref = median_seconds(theirs, args.repeat) if theirs is not None else float("nan")
        gflops = f"{flops / t_ours / 1e9:8.2f}" if flops else ""
        print(f"{name:34} {t_ours * 1e6:9.1f}us {t_ref * 1e6:9.1f}us {t_ours / t_ref:7.2f} {gflops}")


if __name__ == "__main__":
    main()
