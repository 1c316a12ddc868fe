"""Sampling cost of one engine step: R requests' logits (R, V) to R tokens, row by row
(``Sampler.sample`` each, as the engine did) against ``sample_batch``, which picks the same tokens.

    python benchmarks/sampling.py                      # 16 rows of SmolLM2's 49152 vocabulary
    python benchmarks/sampling.py --rows 1,16,32 --repeat 31

Settings: the CLI defaults (temperature 0.3, top-p 0.9, frequency penalty 0.3) and greedy; each
row has a 128-token prompt and 64 generated tokens (penalties over them). The logits are
``--scale`` times standard normal (a model's are of that order). The two ways take turns,
and each figure is the median over ``--repeat`` timed batches of calls.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import per_call_seconds  # noqa: E402

from llaisys.generation import GenerationConfig, Sampler  # noqa: E402
from llaisys.generation import sample_batch  # noqa: E402

SETTINGS = {"cli defaults": dict(temperature=0.3, top_p=0.9, frequency_penalty=0.3),
            "greedy": dict(temperature=0.0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="16", help="batch sizes, comma separated (default 16)")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--scale", type=float, default=3.0, help="standard deviation of the logits")
    p.add_argument("--repeat", type=int, default=21, help="timed batches per figure")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    print(f"vocabulary {args.vocab}, ms per step (median of {args.repeat}), row by row -> batch")
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = (rng.standard_normal((rows, args.vocab)) * args.scale).astype(np.float32)  # (R, V)
        prompts = [list(rng.integers(0, args.vocab, 128)) for _ in range(rows)]
        generated = [list(rng.integers(0, args.vocab, 64)) for _ in range(rows)]
        contexts = [a + b for a, b in zip(prompts, generated)]
        for name, knobs in SETTINGS.items():
            samplers = [Sampler(GenerationConfig(seed=i, **knobs), stop_token_ids=(2,)) for i in range(rows)]

            def each() -> list:
                return [s.sample(logits[r], contexts[r], generated[r]) for r, s in enumerate(samplers)]

            def batch() -> list:
                return sample_batch(samplers, logits, contexts, generated)

            times: dict[str, list[float]] = {"each": [], "batch": []}
            for _ in range(args.repeat):  # take turns: a busy spell falls on both
                times["each"] += per_call_seconds(each, 1, warmup=1)
                times["batch"] += per_call_seconds(batch, 1, warmup=1)
            a, b = (statistics.median(times[k]) * 1e3 for k in ("each", "batch"))
            print(f"R = {rows:>3}  {name:<13} {a:7.2f} -> {b:6.2f} ms  ({a / b:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
