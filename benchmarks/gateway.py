"""Replicas behind SGLang's model gateway: what prefix-aware routing buys against round robin.

Starts N ``llaisys serve`` replicas (1 thread each) and ``sglang-router`` in front of them,
then plays C conversations of T turns each through the gateway (K client threads, each
conversation a long system prompt of its own, every turn resending the whole conversation),
once per routing policy. Prints, per policy: the share of prompt tokens found in the replicas'
prefix caches (their ``vllm:prefix_cache_hits_total`` over ``..._queries_total``), how the
requests split over the replicas, and the wall time.

    python3 benchmarks/gateway.py [--replicas 2] [--conversations 8] [--turns 4] [--clients 4]
                                  [--policies cache_aware,round_robin] [--model PATH]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def counters(port: int) -> tuple[float, float]:
    """(prompt tokens looked up, tokens found) in the prefix cache of the replica on ``port``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    value = lambda n: float(re.search(rf"^vllm:{n}_total{{[^}}]*}} (\S+)$", text, re.M).group(1))  # noqa: E731
    return value("prefix_cache_queries"), value("prefix_cache_hits")


def conversation(client: openai.OpenAI, model: str, index: int, turns: int) -> None:
    system = f"Notebook {index}. " + " ".join(f"Entry {index * 100 + i}: keep answers short." for i in range(30))
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn} for notebook {index}?"})
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})


def run_policy(policy: str, ports: list[int], args: argparse.Namespace) -> dict:
    router_port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(router_port),
         "--worker-urls", *(f"http://127.0.0.1:{p}" for p in ports), "--policy", policy,
         "--prometheus-port", str(free_port()), "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                body = urllib.request.urlopen(f"{base}/workers", timeout=2).read()
                if body.count(b'"is_healthy":true') == len(ports):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not register the replicas")
            time.sleep(0.25)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300)
        model = client.models.list().data[0].id
        before = {p: counters(p) for p in ports}
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(lambda i: conversation(client, model, i + args.offset, args.turns),
                          range(args.conversations)))
        wall = time.perf_counter() - start
        after = {p: counters(p) for p in ports}
    finally:
        router.terminate()
        router.wait()
    args.offset += args.conversations  # the next policy's conversations are new to every cache
    queries = sum(after[p][0] - before[p][0] for p in ports)
    hits = sum(after[p][1] - before[p][1] for p in ports)
    split = [after[p][0] - before[p][0] for p in ports]
    return {"policy": policy, "hit_rate": hits / queries if queries else 0.0, "split": split, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--model", default=None, help="a model file or folder (default: the bundled SmolLM2)")
    args = p.parse_args()
    args.offset = 0
    ports = [free_port() for _ in range(args.replicas)]
    model = ["--model", args.model] if args.model else []
    replicas = [subprocess.Popen([sys.executable, "-m", "llaisys", "serve", "--port", str(port), "--threads", "1",
                                  *model], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
                for port in ports]
    try:
        deadline = time.monotonic() + 180
        while not all(ok(f"http://127.0.0.1:{port}/health") for port in ports):
            if time.monotonic() > deadline or any(r.poll() is not None for r in replicas):
                raise RuntimeError("a replica did not start")
            time.sleep(0.5)
        print(f"{args.replicas} replicas, {args.conversations} conversations x {args.turns} turns, "
              f"{args.clients} clients")
        print(f"{'policy':<14}{'prefix hits':>12}{'wall (s)':>10}  prompt tokens per replica")
        for policy in args.policies.split(","):
            r = run_policy(policy, ports, args)
            print(f"{r['policy']:<14}{r['hit_rate']:>11.1%}{r['wall_s']:>10.1f}  {[int(x) for x in r['split']]}")
    finally:
        for r in replicas:
            r.terminate()
        for r in replicas:
            r.wait()


if __name__ == "__main__":
    main()
