"""Speculative decoding by prompt lookup against plain decoding, single sequence: decode
tokens/s with and without ``speculative_tokens`` on copying workloads (chat requests to edit a
code file given in the message: the reply repeats most of it) and non-copying ones (a story,
asked for in a chat message or continued from raw text), greedy.

    python benchmarks/speculative.py                   # bundled SmolLM2-135M, 2 threads, k = 1, 2, 4
    python benchmarks/speculative.py --k 4 --tokens 128 --repeat 5
    python benchmarks/speculative.py --engine --k 2,4 --concurrency 1,4   # the serving engine

The two ways alternate, ``--repeat`` runs each; figures are medians of whole-request tokens/s
(generated tokens over wall time, the same prefill included) and of decode tokens/s (the
tokens after the first over the time after it). Both give the same tokens (checked).

``--engine`` measures the serving engine instead (``LLMEngine(speculative_tokens=k)``): N
requests of the renaming workload at once (N from ``--concurrency``; each names its own file), engine tokens/s = all generated tokens
over the wall time of ``engine.generate`` (prefill included), median of the alternating runs.
"""
from __future__ import annotations

import argparse
import statistics
import time

CODE = '''import math


def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    mu = mean(values)
    total = 0
    for v in values:
        total += (v - mu) ** 2
    return total / len(values)


def stddev(values):
    return math.sqrt(variance(values))


def zscores(values):
    mu, sd = mean(values), stddev(values)
    return [(v - mu) / sd for v in values]
'''
EDIT = "Rename the function `mean` to `average` in {name} and show the whole file.\n\n```python\n" + CODE + "```"
HINTS = "Add type hints to this Python file. Reply with the whole file.\n\n```python\n" + CODE + "```"
WORKLOADS = {  # chat messages (through the model's chat template), or raw text
    "copying (chat: rename)": [{"role": "user", "content": EDIT.format(name="this file")}],
    "copying (chat: type hints)": [{"role": "user", "content": HINTS}],
    "non-copying (chat: story)": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
    "non-copying (raw: story)": "Once upon a time, in a small village by the sea, there lived",
}


def prompt_of(model, workload) -> "str | list[int]":
    """The prompt of a workload: raw text, or the ids of its chat messages."""
    from llaisys.generation.chat import chat_prompt_ids

    return workload if isinstance(workload, str) else chat_prompt_ids(model, workload)


def run(model, prompt: str, cfg) -> tuple[float, float, object]:
    """Whole-request tokens/s, decode tokens/s and the result of one generation."""
    from llaisys.engine import generate

    t = time.perf_counter()
    r = generate(model, prompt, cfg)
    return len(r.token_ids) / (time.perf_counter() - t), r.timings.decode_tokens_per_s, r


def engine_prompts(model, n: int) -> list[list[int]]:
    """``n`` renaming requests, each naming its own file."""
    names = ["stats", "numbers", "measures", "summary", "figures", "moments", "averages", "spread"]
    return [prompt_of(model, [{"role": "user", "content": EDIT.format(name=f"{names[i % len(names)]}_{i}.py")}])
            for i in range(n)]


def run_engine(engine, prompts: list[str], cfg) -> tuple[float, list]:
    """Engine tokens/s of ``prompts`` run together, and their results."""
    t = time.perf_counter()
    results = engine.generate(prompts, cfg)
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - t), results


def bench_engine(model, args, base) -> None:
    """Engine tokens/s with and without speculation, at each concurrency of ``args``."""
    from llaisys.engine import LLMEngine

    plain_engine = LLMEngine(model, prefix_caching=False)
    print(f"engine: {args.threads} threads, {args.tokens} tokens a request, greedy, copying workload, "
          f"median of {args.repeat} alternating runs")
    for n in [int(x) for x in args.concurrency.split(",")]:
        prompts = engine_prompts(model, n)
        run_engine(plain_engine, prompts, base)  # warm up: the recorded passes of these shapes
        for k in [int(x) for x in args.k.split(",")]:
            spec_engine = LLMEngine(model, prefix_caching=False, speculative_tokens=k)
            run_engine(spec_engine, prompts, base)
            plain_runs, spec_runs = [], []
            for _ in range(args.repeat):
                plain_runs.append(run_engine(plain_engine, prompts, base))
                spec_runs.append(run_engine(spec_engine, prompts, base))
            assert ([r.token_ids for r in spec_runs[-1][1]] == [r.token_ids for r in plain_runs[-1][1]]), \
                "speculation changed the output"
            a, b = (statistics.median(r[0] for r in runs) for runs in (plain_runs, spec_runs))
            s = spec_engine.stats()
            print(f"{n} request(s) k={k}: {a:6.1f} -> {b:6.1f} tok/s x{b / a:.2f} "
                  f"(accepted {s.accepted_tokens}/{s.drafted_tokens} drafted, all runs)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", default="2,4,8", help="draft lengths, comma separated (default 2,4,8)")
    p.add_argument("--tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each way (default 3)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M)")
    p.add_argument("--engine", action="store_true", help="measure the serving engine (see --concurrency)")
    p.add_argument("--concurrency", default="1,4", help="--engine: requests at once, comma separated (default 1,4)")
    args = p.parse_args()

    from llaisys.cli.main import apply_threads
    from llaisys.generation import GenerationConfig
    from llaisys.models import load_model

    apply_threads(args.threads)
    model = load_model(args.model)
    base = GenerationConfig(max_new_tokens=args.tokens, ignore_eos=True)
    if args.engine:
        bench_engine(model, args, base)
        return 0
    print(f"{args.threads} threads, {args.tokens} tokens, greedy, median of {args.repeat} alternating runs")
    for name, workload in WORKLOADS.items():
        prompt = prompt_of(model, workload)
        run(model, prompt, base)  # warm up: the recorded passes, the workspaces
        for k in [int(x) for x in args.k.split(",")]:
            spec = base.replace(speculative_tokens=k)
            run(model, prompt, spec)
            plain_runs, spec_runs = [], []
            for _ in range(args.repeat):
                plain_runs.append(run(model, prompt, base))
                spec_runs.append(run(model, prompt, spec))
            plain, fast = plain_runs[-1][2], spec_runs[-1][2]
            assert fast.token_ids == plain.token_ids, "speculation changed the output"
            a, b = (statistics.median(r[0] for r in runs) for runs in (plain_runs, spec_runs))
            da, db = (statistics.median(r[1] for r in runs) for runs in (plain_runs, spec_runs))
            t = fast.timings
            print(f"{name:26s} k={k}: whole {a:6.1f} -> {b:6.1f} tok/s x{b / a:.2f}; decode {da:6.1f} -> "
                  f"{db:6.1f} tok/s x{db / da:.2f} (accepted {t.accepted_tokens}/{t.drafted_tokens} drafted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
