"""Replicas behind a gateway: two ``llaisys serve`` processes (the bundled model, loopback ports)
behind SGLang's model gateway (``sglang-router`` from the test extra, a Rust binary that fronts
any OpenAI-compatible server), driven by the official ``openai`` client through the gateway.

- the gateway learns the workers' model from ``/server_info`` and ``/model_info``, so its
  ``/v1/models`` names the real model, not ``unknown``;
- a conversation's follow-up turns land on the replica holding its prefix: that replica's
  prefix-cache hit counter (``vllm:prefix_cache_hits_total`` in ``/metrics``) grows by the
  conversation's cached turns, the other's not at all;
- killing one replica leaves the other serving through the gateway.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def wait_until(check, what: str, timeout: float = START_TIMEOUT, procs: tuple = ()) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for p in procs:
            if p.poll() is not None:
                out = p.stdout.read() if p.stdout else ""
                pytest.fail(f"{what}: a process ended with status {p.returncode} first:\n{out[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def prefix_counters(port: int) -> tuple[float, float]:
    """(prompt tokens looked up, tokens found) in the prefix cache of the replica on ``port``."""
    status, body = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    text = body.decode()

    def value(name: str) -> float:
        return float(re.search(rf"^vllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M).group(1))
    return value("prefix_cache_queries"), value("prefix_cache_hits")


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def gateway(smollm2_path):
    """(the gateway's base URL, {port: replica process}), everything stopped at the end."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    ports = [free_port(), free_port()]
    replicas = {port: subprocess.Popen(
        [sys.executable, "-m", "llaisys", "serve", "--model", str(smollm2_path), "--port", str(port),
         "--threads", "1", "--kv-cache-tokens", "8192"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for port in ports}
    procs = list(replicas.values())
    try:
        for port in ports:
            wait_until(lambda: get(f"http://127.0.0.1:{port}/health")[0] == 200, f"replica {port}", procs=procs)
        router_port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(router_port),
             "--worker-urls", *(f"http://127.0.0.1:{p}" for p in ports), "--policy", "cache_aware",
             "--prometheus-port", str(free_port()), "--health-check-interval-secs", "1",
             "--health-failure-threshold", "1", "--cb-failure-threshold", "1", "--log-level", "warn"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(router)
        base = f"http://127.0.0.1:{router_port}"

        def both_registered() -> bool:
            status, body = get(f"{base}/workers")
            return status == 200 and body.count(b'"is_healthy":true') == 2
        wait_until(both_registered, "the gateway to register both replicas", procs=procs)
        yield base, replicas
    finally:
        stop(procs)


def test_the_gateway_lists_the_replicas_model(gateway):
    base, replicas = gateway
    port = next(iter(replicas))
    direct = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none").models.list().data[0].id
    assert direct == "SmolLM2-135M-Instruct.Q4_1"
    through = openai.OpenAI(base_url=f"{base}/v1", api_key="none").models.list()
    assert [m.id for m in through.data] == [direct]
    info = openai.OpenAI(base_url=f"http://127.0.0.1:{port}", api_key="none").get("/server_info", cast_to=object)
    assert info["served_model_name"] == direct and info["tp_size"] == 1 and info["max_total_tokens"] >= 8192
    model = openai.OpenAI(base_url=f"http://127.0.0.1:{port}", api_key="none").get("/model_info", cast_to=object)
    assert model["model_type"] == "llama" and model["is_generation"] is True
    assert model["model_path"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_follow_up_turns_land_on_the_replica_holding_the_prefix(gateway):
    """Each conversation starts with a long system prompt of its own; every later turn resends
    the whole conversation. The replica that computed a conversation's first turn finds the
    previous turn's prompt in its prefix cache at every later turn (its whole 16-token blocks,
    but for the last one, which held the first token to compute); the other finds none of it."""
    base, replicas = gateway
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    for conv, word in enumerate(("harbor", "meadow", "glacier")):
        system = f"{word.title()} notes. " + " ".join(f"Rule {conv * 50 + i} of the {word}: answer briefly."
                                                    for i in range(30))
        messages = [{"role": "system", "content": system}]
        holder, previous = None, 0
        for turn in range(3):
            before = {p: prefix_counters(p) for p in replicas}
            messages.append({"role": "user", "content": f"Question {turn} about the {word}?"})
            reply = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=messages,
                                                   max_tokens=6, temperature=0)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            prompt = reply.usage.prompt_tokens
            after = {p: prefix_counters(p) for p in replicas}
            served = [p for p in replicas if after[p][0] > before[p][0]]
            assert len(served) == 1, f"conversation {conv}, turn {turn}: looked up on {served}"
            if turn == 0:
                holder, previous = served[0], prompt
                continue
            assert served == [holder], f"conversation {conv}, turn {turn} left the replica holding its prefix"
            hits = after[holder][1] - before[holder][1]
            assert (previous // 16 - 1) * 16 <= hits < prompt, (conv, turn, hits, previous, prompt)
            previous = prompt
            other = next(p for p in replicas if p != holder)
            assert after[other][1] == before[other][1]


def test_killing_a_replica_leaves_the_other_serving(gateway):
    base, replicas = gateway
    victim, survivor = list(replicas)
    replicas[victim].kill()
    replicas[victim].wait()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)
    before = prefix_counters(survivor)[0]
    answered, deadline = 0, time.monotonic() + 60
    while answered < 5:  # the gateway notices within its health-check interval; then every request is answered
        assert time.monotonic() < deadline, "the surviving replica did not take over"
        try:
            reply = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=4,
                                                   messages=[{"role": "user", "content": f"Hello {answered}"}])
            assert reply.choices[0].message.content is not None
            answered += 1
        except openai.APIError:
            assert answered == 0, "a request failed after the survivor had taken over"
            time.sleep(0.5)
    assert prefix_counters(survivor)[0] > before
