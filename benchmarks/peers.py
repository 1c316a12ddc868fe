"""Run one workload through llaisys and its peers and compare.

The same model file, prompt (the same token ids), generation length and thread count go to
each engine, each in its own subprocess so that peak memory is per engine:

  llaisys       llaisys.generation on the model llaisys.models loads
  transformers  AutoModelForCausalLM.from_pretrained(folder, gguf_file=...), dequantized to f32
  llama.cpp     llama_cpp.Llama(model_path=...), when llama-cpp-python is installed

Decoding is greedy with end-of-sequence ignored, so every engine makes the same number of
tokens. Figures are medians over --repeats runs after one warm-up run.

On a shared machine a slow spell can fall on one engine's turn. ``--rounds N`` runs every
engine N times, taking turns (llaisys, the peers, llaisys, ...), and reports each figure's
median over the rounds and the median of the rounds' own ratios, with the decode ratio of each
round beside it.

    python benchmarks/peers.py --prompt-tokens 512 --gen-tokens 128 --threads 2 [--rounds 5]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENGINES = ("llaisys", "transformers", "llama.cpp")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# (key, label, unit, higher is better)
FIGURES = (("decode_tok_s", "decode", "tok/s", True), ("prefill_tok_s", "prefill", "tok/s", True),
           ("ttft_ms", "time to first token", "ms", False), ("load_s", "load time", "s", False),
           ("peak_rss_mb", "peak memory", "MiB", False))


def peak_rss_mb() -> float:
    """Peak resident memory of this process, MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def measure(run: Callable[[], tuple[float, float, float]], prompt_tokens: int, gen_tokens: int,
            repeats: int) -> dict[str, float]:
    """Median figures of ``run``, which returns (prefill_s, ttft_s, decode_s) for one generation."""
    run()  # warm-up
    results = [run() for _ in range(repeats)]
    return {
        "prefill_tok_s": statistics.median(prompt_tokens / r[0] for r in results),
        "ttft_ms": statistics.median(r[1] for r in results) * 1000,
        "decode_tok_s": statistics.median((gen_tokens - 1) / r[2] for r in results),
    }


# ---------------------------------------------------------------- workers (one per subprocess)

def work_llaisys(args: argparse.Namespace) -> dict[str, Any]:
    from llaisys.cli.bench import prompt_ids, run_once
    from llaisys.models import load_model

    t0 = time.perf_counter()
    model = load_model(args.model)
    load_s = time.perf_counter() - t0
    ids = prompt_ids(model.tokenizer, args.prompt_tokens)
    Path(args.prompt_file).write_text(json.dumps(ids))

    def run() -> tuple[float, float, float]:
        t = run_once(model, ids, args.gen_tokens)
        return t.prefill_s, t.ttft_s, t.decode_s
    return {"load_s": load_s, **measure(run, len(ids), args.gen_tokens, args.repeats)}


def work_transformers(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    ids = json.loads(Path(args.prompt_file).read_text())
    path = Path(args.model)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    prompt = torch.tensor([ids])  # (1, S)

    @torch.inference_mode()
    def run() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        out = model(prompt, use_cache=True, logits_to_keep=1)
        t1 = time.perf_counter()
        token = out.logits[0, -1].argmax().view(1, 1)  # (1, 1)
        t2 = time.perf_counter()
        past = out.past_key_values
        for _ in range(args.gen_tokens - 1):
            out = model(token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[0, -1].argmax().view(1, 1)
        return t1 - t0, t2 - t0, time.perf_counter() - t2
    return {"load_s": load_s, **measure(run, len(ids), args.gen_tokens, args.repeats)}


def work_llama_cpp(args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp

    ids = json.loads(Path(args.prompt_file).read_text())
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(args.model), n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=len(ids) + args.gen_tokens + 16, n_batch=max(len(ids), 8), verbose=False)
    load_s = time.perf_counter() - t0

    def run() -> tuple[float, float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        token = llm.sample(top_k=1, temp=0.0)
        t2 = time.perf_counter()
        for _ in range(args.gen_tokens - 1):
            llm.eval([token])
            token = llm.sample(top_k=1, temp=0.0)
        return t1 - t0, t2 - t0, time.perf_counter() - t2
    return {"load_s": load_s, **measure(run, len(ids), args.gen_tokens, args.repeats)}


WORKERS = {"llaisys": work_llaisys, "transformers": work_transformers, "llama.cpp": work_llama_cpp}
REQUIRES = {"llaisys": "llaisys", "transformers": "transformers", "llama.cpp": "llama_cpp"}


# ---------------------------------------------------------------- parent

def run_engine(engine: str, args: argparse.Namespace, prompt_file: str) -> dict[str, Any] | str:
    """Figures of one engine from its own subprocess, or a string saying why there are none."""
    env = {**os.environ, **{v: str(args.threads) for v in THREAD_VARS}}
    cmd = [sys.executable, __file__, "--worker", engine, "--model", str(args.model), "--prompt-file", prompt_file,
           "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
           "--threads", str(args.threads), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"failed: {tail}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def format_table(rounds: list[dict[str, dict[str, Any] | str]]) -> str:
    """One row per figure, one column per engine (the median over rounds), then llaisys's ratio
    to each peer, the median of the rounds' ratios (above 1 means llaisys is better: faster, or
    less time / memory)."""
    engines = list(rounds[0])
    ok = [e for e in engines if all(isinstance(r[e], dict) for r in rounds)]
    peers = [e for e in ok if e != "llaisys"]
    head = ["figure"] + ok + [f"llaisys vs {p}" for p in peers if "llaisys" in ok]
    rows = [head]
    for key, label, unit, higher in FIGURES:
        row = [f"{label} ({unit})"] + [f"{statistics.median(r[e][key] for r in rounds):.1f}" for e in ok]
        if "llaisys" in ok:
            for p in peers:
                ratios = [r["llaisys"][key] / r[p][key] if higher else r[p][key] / r["llaisys"][key] for r in rounds]
                row.append(f"{statistics.median(ratios):.2f}x")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    if len(rounds) > 1 and "llaisys" in ok:
        for p in peers:
            each = ", ".join(f"{r['llaisys']['decode_tok_s'] / r[p]['decode_tok_s']:.2f}" for r in rounds)
            lines.append(f"decode llaisys vs {p}, round by round: {each}")
    for e in engines:
        failed = [r[e] for r in rounds if isinstance(r[e], str)]
        if failed:
            lines.append(f"{e}: {failed[0]}")
    return "\n".join(lines)


def default_model() -> Path:
    from llaisys.models import default_model_path

    return default_model_path()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a .gguf file (default: the bundled SmolLM2-135M)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="run every engine this many times, taking turns")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {', '.join(ENGINES)}")
    p.add_argument("--json", action="store_true", help="print all figures as JSON")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.prompt_tokens < 1 or args.gen_tokens < 2 or args.threads < 1 or args.repeats < 1 or args.rounds < 1:
        p.error("--prompt-tokens, --threads, --repeats and --rounds must be >= 1, --gen-tokens >= 2")
    if args.worker:
        figures = WORKERS[args.worker](args)
        print(json.dumps({**figures, "peak_rss_mb": peak_rss_mb()}))
        return 0
    args.model = (args.model or default_model()).resolve()
    if args.model.suffix != ".gguf" or not args.model.is_file():
        p.error(f"--model must be an existing .gguf file, got {args.model}")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        p.error(f"unknown engines {unknown}; expected some of {', '.join(ENGINES)}")
    if "llaisys" not in engines:
        engines.insert(0, "llaisys")  # it writes the prompt the others read
    rounds: list[dict[str, dict[str, Any] | str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = os.path.join(tmp, "prompt.json")
        for i in range(args.rounds):
            results: dict[str, dict[str, Any] | str] = {}
            for engine in sorted(engines, key=ENGINES.index):
                if importlib.util.find_spec(REQUIRES[engine]) is None:
                    results[engine] = f"skipped: {REQUIRES[engine]} is not installed"
                    continue
                print(f"round {i + 1}/{args.rounds}: running {engine}...", file=sys.stderr, flush=True)
                results[engine] = run_engine(engine, args, prompt_file)
            rounds.append(results)
    print(f"{args.model.name}: {args.prompt_tokens} prompt tokens, {args.gen_tokens} generated, "
          f"{args.threads} threads, median of {args.repeats}" + (f", {args.rounds} rounds" if args.rounds > 1 else ""))
    print(json.dumps(rounds if args.rounds > 1 else rounds[0], indent=2) if args.json else format_table(rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
