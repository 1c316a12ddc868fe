"""The serving engine's batching curve: time per decode step and aggregate decode tokens/s as
the number of sequences decoding together grows.

For each N, N distinct prompts of ``--prompt-tokens`` tokens are prefilled through one
``LLMEngine``, then ``--steps`` decode steps (every sequence one token per step) are timed;
the table gives the median step time, aggregate tokens/s, the ratio to N = 1 and the step
time per sequence. Weights are read once per step whatever N is, so a step should grow far
slower than N until the arithmetic, not the memory, is the limit.

    python3 benchmarks/engine_curve.py                          # N = 1, 2, 4, 8, 16, 32
    python3 benchmarks/engine_curve.py --sizes 1,16 --threads 2 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def measure(model, n: int, prompt_tokens: int, steps: int) -> dict[str, float]:
    """Median decode-step time with ``n`` sequences decoding together."""
    from llaisys.cli.bench import distinct_prompts, prompt_ids
    from llaisys.engine import LLMEngine
    from llaisys.generation import GenerationConfig

    engine = LLMEngine(model, max_seqs=max(n, 1))
    config = GenerationConfig(max_new_tokens=1 << 20, ignore_eos=True)  # capped by the context: none ends early
    for p in distinct_prompts(prompt_ids(model.tokenizer, prompt_tokens), n, model.config.vocab_size):
        engine.add_request(None, p, config)
    while any(s.prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()  # the first all-decode step records its pass
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - t)
        assert len(outputs) == n, f"expected {n} sequences decoding, got {len(outputs)}"
    step = statistics.median(times)
    return {"sequences": n, "step_ms": step * 1000, "tok_s": n / step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M)")
    parser.add_argument("--sizes", default="1,2,4,8,16,32", help="numbers of sequences, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per size")
    parser.add_argument("--threads", type=int, default=None, help="kernel and BLAS threads (default: all)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from llaisys.cli.main import apply_threads
    from llaisys.models import load_model

    if args.threads:
        apply_threads(args.threads)  # the BLAS pools and the quantized kernels' own
    model = load_model(args.model)
    rows = [measure(model, int(n), args.prompt_tokens, args.steps) for n in args.sizes.split(",")]
    base = rows[0]["tok_s"]
    for r in rows:
        r["speedup"] = r["tok_s"] / base
        r["ms_per_sequence"] = r["step_ms"] / r["sequences"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'N':>4} {'step ms':>9} {'tok/s':>8} {'x N=1':>7} {'ms/seq':>8}")
    for r in rows:
        print(f"{r['sequences']:>4} {r['step_ms']:>9.1f} {r['tok_s']:>8.1f} {r['speedup']:>7.2f} "
              f"{r['ms_per_sequence']:>8.2f}")


if __name__ == "__main__":
    main()
