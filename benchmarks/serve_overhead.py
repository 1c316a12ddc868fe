"""What the HTTP server costs the engine: the same workload in-process and behind a live server.

The workload: 16 requests arriving together, each a distinct prompt of about 60 tokens, 64
output tokens (end-of-sequence ignored), temperature 0.8 with a fixed seed per request.

- **in-process**: the requests go straight to an ``EngineThread`` (what the server runs),
  submitted together from 16 threads, and one thread reads the streams;
- **http**: the same requests to a live ``create_app`` server on 127.0.0.1 (uvicorn, as
  ``llaisys serve`` runs it, in this process), as 16 streaming ``/v1/completions`` clients in a
  separate process, so the clients' work does not share the server's interpreter (GIL).

For each it reports the engine's own step time (``EngineThread.step_log``: the median over
decode-only steps with all 16 requests in the batch, and over every step), the number of
steps, the engine's busy fraction (step seconds over the wall time), the aggregate output
tokens/s (all output tokens over the time from the first request to the last token), the
engine thread's time between two steps (handing the outputs on, metrics, waiting for the GIL
or a core) and the CPU time per step of the thread that reads the outputs: the server's event
loop (requests, SSE chunks, socket writes), or the one reader thread in-process. The two
modes alternate ``--runs`` times (each run with prompts of its own, so the prefix cache does not
carry over); the last lines give the medians and the gap. ``--src`` measures another copy of
the package (a checkout from before a change) under the same load; ``--profile`` writes a
cProfile of the event loop.

    python benchmarks/serve_overhead.py                  # 3 alternating runs of each
    python benchmarks/serve_overhead.py --runs 5 --json
    python benchmarks/serve_overhead.py --src /tmp/before/src   # another version of the package
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("river stone light market garden winter letter window quiet number orange travel story mountain "
         "engine paper silver morning forest signal castle harbor pencil meadow lantern thunder velvet "
         "compass theory bridge candle marble planet violin whisper canyon").split()


def make_prompts(count: int, words: int, seed: int) -> list[str]:
    """``count`` distinct prompts of ``words`` words (48 words: about 60 tokens for SmolLM2)."""
    rng = random.Random(seed)
    return [f"Request {seed}-{i}. Continue this list of words: " + " ".join(rng.choice(WORDS) for _ in range(words))
            for i in range(count)]


# ---- the clients (a separate process) ----------------------------------------------------------
async def _stream(host: str, port: int, body: bytes) -> tuple[int, float]:
    """POST one streamed completion over a raw connection; (tokens, time of the last text)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), port, len(body)) + body)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"the server answered {status!r}")
    while (await reader.readline()) not in (b"\r\n", b""):  # headers (the body is chunked)
        pass
    tokens, last, buffer = 0, 0.0, b""
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            break
        buffer += (await reader.readexactly(size + 2))[:-2]  # the chunk less its CRLF
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            data = event.removeprefix(b"data: ")
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    writer.close()
    return tokens, last


async def _clients(url: str, bodies: list[dict]) -> dict:
    host, port = url.rsplit("/", 1)[-1].split(":")
    await _stream(host, int(port), json.dumps({**bodies[0], "max_tokens": 2}).encode())  # warm up
    start = time.perf_counter()
    results = await asyncio.gather(*(_stream(host, int(port), json.dumps(b).encode()) for b in bodies))
    # perf_counter is the system's monotonic clock on Linux: the server's step times compare with it
    return {"start": start, "wall_s": max(last for _, last in results) - start, "tokens": [n for n, _ in results]}


def client_main() -> int:
    """``--client URL``: read the request bodies (JSON) on stdin, print the figures as JSON."""
    url = sys.argv[sys.argv.index("--client") + 1]
    print(json.dumps(asyncio.run(_clients(url, json.load(sys.stdin)))))
    return 0


# ---- the two modes -----------------------------------------------------------------------------
def step_figures(records: list, n: int, wall_s: float, tokens: int, reader_cpu_s: float) -> dict:
    """Figures of one run from its steps (``StepRecord``s) and the CPU seconds of the thread
    that hands the outputs on (the server's event loop, or the in-process reader)."""
    full = [r.seconds for r in records if r.outputs == n and r.prompt_tokens == 0]
    busy = sum(r.seconds for r in records)
    # the engine thread's time from one step's end to the next one's start: handing outputs on,
    # metrics, commands, waiting for the GIL
    between = [b.start - a.end for a, b in zip(records, records[1:])]
    return {"wall_s": wall_s, "tokens": tokens, "tok_s": tokens / wall_s, "steps": len(records),
            "decode_step_ms": statistics.median(full) * 1000 if full else float("nan"),
            "step_ms": statistics.median(r.seconds for r in records) * 1000 if records else float("nan"),
            "busy": busy / wall_s, "between_ms": statistics.median(between) * 1000 if between else float("nan"),
            "reader_ms_per_step": reader_cpu_s * 1000 / max(len(records), 1)}


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds ``thread`` has used (Linux, macOS)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def steps_since(thread, start: float) -> list:
    """The steps of ``thread`` that ended after ``start``."""
    return [r for r in list(thread.step_log) if r.end > start]


def record_steps(thread) -> None:
    """Give an EngineThread of an older checkout (no ``step_log``) one, by timing its engine's steps."""
    if hasattr(thread, "step_log"):
        return
    from collections import deque
    from types import SimpleNamespace

    engine, step = thread.engine, thread.engine.step
    thread.step_log = deque(maxlen=4096)

    def timed():
        before, start = engine.prompt_tokens, time.perf_counter()
        outputs = step()
        end = time.perf_counter()
        thread.step_log.append(SimpleNamespace(start=start, end=end, seconds=end - start, outputs=len(outputs),
                                               prompt_tokens=engine.prompt_tokens - before))
        return outputs

    engine.step = timed


def run_in_process(thread, prompts: list[str], args: argparse.Namespace) -> dict:
    from llaisys.generation import GenerationConfig

    configs = [GenerationConfig(max_new_tokens=args.output_tokens, temperature=0.8, top_p=1.0, top_k=0, seed=i,
                                ignore_eos=True) for i in range(len(prompts))]
    streams: list = [None] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def submit(i: int) -> None:  # all at once, as the HTTP clients send them
        gate.wait()
        streams[i] = thread.submit(prompts[i], configs[i])

    submitters = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in submitters:
        t.start()
    for t in submitters:
        t.join()
    # one reader, woken once a step (by the first stream), as little beside the engine as can be
    counts, lasts = [0] * len(prompts), [0.0] * len(prompts)
    cpu = time.thread_time()
    for i, stream in enumerate(streams):
        for out in stream:
            counts[i] += len(out.token_ids)
            lasts[i] = out.times.last_token or lasts[i]
    cpu = time.thread_time() - cpu
    wall = max(lasts) - start
    return step_figures(steps_since(thread, start), len(prompts), wall, sum(counts), cpu)


def run_http(url: str, thread, event_loop: threading.Thread, prompts: list[str], args: argparse.Namespace) -> dict:
    bodies = [{"prompt": p, "max_tokens": args.output_tokens, "temperature": 0.8, "top_p": 1.0, "top_k": 0,
               "seed": i, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}} for i, p in enumerate(prompts)]
    cpu = thread_cpu_s(event_loop)  # includes the warm-up request's (2 tokens) and the client's start
    proc = subprocess.run([sys.executable, __file__, "--client", url], input=json.dumps(bodies), text=True,
                          capture_output=True)
    cpu = thread_cpu_s(event_loop) - cpu
    if proc.returncode:
        raise RuntimeError(f"the clients failed: {proc.stderr.strip()}")
    result = json.loads(proc.stdout)
    return step_figures(steps_since(thread, result["start"]), len(prompts), result["wall_s"], sum(result["tokens"]),
                        cpu)


def start_server(model, args: argparse.Namespace):
    """A live server over ``model`` on a free port, in a thread of this process: (url, server,
    its EngineThread, the thread of its event loop)."""
    from llaisys.server import ServerOptions, create_app, make_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = ServerOptions(port=port, max_seqs=args.requests, kv_cache_tokens=args.kv_cache_tokens)
    app = create_app(options, model=model)
    server = make_server(app, options, log_level="warning")
    run = server.run
    if args.profile:  # cProfile of the event loop's thread, written when the server stops
        import cProfile

        def run() -> None:
            profile = cProfile.Profile()
            try:
                profile.runcall(server.run)
            finally:
                profile.dump_stats(args.profile)
    event_loop = threading.Thread(target=run, name="uvicorn", daemon=True)
    event_loop.start()
    service = app.state.service
    deadline = time.monotonic() + 60
    while not (server.started and service.ready.is_set()):
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not start within 60 s")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, service.engine, event_loop


def main() -> int:
    if "--client" in sys.argv:
        return client_main()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M)")
    p.add_argument("--requests", type=int, default=16, help="requests arriving together (default 16)")
    p.add_argument("--prompt-words", type=int, default=48, help="words per prompt (default 48: ~60 tokens)")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="alternating runs of each mode (default 3)")
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--src", default=str(ROOT / "src"), help="the llaisys tree to import (to measure another version)")
    p.add_argument("--switch-interval", type=float, default=None, metavar="S",
                   help="sys.setswitchinterval(S) for this process (the GIL hand-off; Python's default 0.005)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="write a cProfile of the server's event loop thread to FILE (pstats)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    sys.path.insert(0, args.src)
    from llaisys.engine import EngineThread, LLMEngine
    from llaisys.models import load_model

    model = load_model(args.model)
    local = EngineThread(LLMEngine(model, kv_cache_tokens=args.kv_cache_tokens, max_seqs=args.requests))
    url, server, remote, event_loop = start_server(model, args)
    for thread in (local, remote):
        record_steps(thread)
    run_in_process(local, make_prompts(args.requests, args.prompt_words, seed=10_000), args)  # warm up
    rows: dict[str, list[dict]] = {"in-process": [], "http": []}
    try:
        for r in range(args.runs):
            prompts = make_prompts(args.requests, args.prompt_words, seed=r)
            rows["in-process"].append(run_in_process(local, prompts, args))
            rows["http"].append(run_http(url, remote, event_loop, prompts, args))
            if not args.json:
                for mode in rows:
                    f = rows[mode][-1]
                    print(f"run {r + 1} {mode:>10}: decode step {f['decode_step_ms']:6.1f} ms (all steps "
                          f"{f['step_ms']:6.1f}, {f['steps']} steps), busy {f['busy']:5.1%}, "
                          f"{f['tok_s']:6.1f} tok/s, between steps {f['between_ms']:.3f} ms, "
                          f"reader {f['reader_ms_per_step']:.2f} ms CPU/step",
                          file=sys.stderr, flush=True)
    finally:
        server.should_exit = True
        local.stop()
        if args.profile:
            event_loop.join(30)
    med = {mode: {k: statistics.median(f[k] for f in fs) for k in fs[0]} for mode, fs in rows.items()}
    gap = {"decode_step": med["http"]["decode_step_ms"] / med["in-process"]["decode_step_ms"] - 1,
           "tok_s": med["http"]["tok_s"] / med["in-process"]["tok_s"] - 1}
    if args.json:
        print(json.dumps({"runs": rows, "median": med, "gap": gap}, indent=2))
        return 0
    print(f"medians of {args.runs} alternating runs ({args.requests} requests, {args.output_tokens} tokens each)")
    print(f"{'mode':>10} {'decode step ms':>15} {'step ms':>8} {'steps':>6} {'busy':>6} {'tok/s':>7} "
          f"{'between ms':>11} {'reader CPU ms/step':>19}")
    for mode, f in med.items():
        print(f"{mode:>10} {f['decode_step_ms']:>15.1f} {f['step_ms']:>8.1f} {f['steps']:>6.0f} "
              f"{f['busy']:>6.1%} {f['tok_s']:>7.1f} {f['between_ms']:>11.3f} {f['reader_ms_per_step']:>19.2f}")
    print(f"behind HTTP against in-process: decode steps {gap['decode_step']:+.1%}, tokens/s {gap['tok_s']:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
