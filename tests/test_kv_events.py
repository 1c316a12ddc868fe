"""Prefix-cache events (engine/kv_events.py): the blocks an engine stores and drops, published
over ZeroMQ in vLLM's KV-event format for routers that index them.

- the block manager reports each full block made findable (hash, parent, its tokens) and each
  prefix forgotten when its block goes to new content; hashes equal a BLAKE2b chain computed
  here with hashlib;
- an engine with a publisher sends them, and a ZeroMQ subscriber (pyzmq) sees a request's
  blocks stored and, once other requests need the pool, removed; every payload decodes with
  plain msgpack (no extension types: nothing pickled), and a replay request returns them again;
- ``llaisys serve --kv-events`` publishes a chat request's blocks.
"""
from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from llaisys.engine import LLMEngine
from llaisys.engine.blocks import KVBlockManager
from llaisys.engine.kv_events import KVEventLog, KVEventPublisher, check_endpoint
from llaisys.generation import GenerationConfig

ROOT = Path(__file__).resolve().parents[1]


def chain(token_ids, block_size: int) -> list[int]:
    """The events' hashes of the full blocks of ``token_ids``: BLAKE2b-128 of (parent digest,
    the block's ids as little-endian int64), chained, each cut to its first 8 bytes."""
    out, parent = [], b""
    for i in range(len(token_ids) // block_size):
        block = np.asarray(token_ids[i * block_size:(i + 1) * block_size], "<i8").tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(int.from_bytes(parent[:8], "big"))
    return out


def decode(payload: bytes) -> list:
    """A payload through plain msgpack: any extension type (a pickled object would need one) fails."""
    def refuse(code, data):
        raise AssertionError(f"msgpack extension type {code} on the wire")
    return msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=refuse)


def test_block_manager_reports_stored_and_removed_blocks():
    blocks = KVBlockManager(num_blocks=4, block_size=4)
    log = blocks.events = KVEventLog()
    ids = list(range(100, 111))  # 2 full blocks and 3 tokens
    blocks.match_prefix("a", ids)
    assert blocks.grow("a", len(ids))
    blocks.commit("a", ids, 6)  # the first block is written
    blocks.commit("a", ids, 11)  # then the second
    want = chain(ids, 4)
    assert log.drain() == [["BlockStored", want[:1], None, ids[:4], 4, None, "CPU", None],
                           ["BlockStored", want[1:2], want[0], ids[4:8], 4, None, "CPU", None]]
    blocks.commit("a", ids, 11)  # nothing new
    assert log.drain() == []
    blocks.free("a")
    other = list(range(7, 23))  # 4 blocks: every block of the pool goes to new content
    blocks.match_prefix("b", other)
    assert blocks.grow("b", len(other))
    removed = [e for e in log.drain() if e[0] == "BlockRemoved"]
    assert sorted(h for e in removed for h in e[1]) == sorted(want[:2]) and all(e[2] == "CPU" for e in removed)


def test_a_block_already_cached_is_not_stored_twice():
    blocks = KVBlockManager(num_blocks=8, block_size=4)
    log = blocks.events = KVEventLog()
    ids = list(range(40, 49))
    for seq in ("a", "b"):  # both compute the same prompt side by side (no prefix found yet)
        blocks.match_prefix(seq, ids)
        assert blocks.grow(seq, len(ids))
    blocks.commit("a", ids, 9)
    blocks.commit("b", ids, 9)
    stored = [e for e in log.drain() if e[0] == "BlockStored"]
    assert [h for e in stored for h in e[1]] == chain(ids, 4)


def test_endpoints_are_checked():
    assert check_endpoint("tcp://*:5557") == "tcp://*:5557"
    for bad in ("5557", "http://host:5557", "tcp://host", "udp://x:1"):
        with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
            check_endpoint(bad)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def receive(sub, until, timeout: float = 30.0) -> list[tuple[bytes, int, list]]:
    """(topic, sequence, payload) messages until ``until(messages)`` holds."""
    got, deadline = [], time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, f"timed out; received {len(got)} messages"
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            got.append((topic, int.from_bytes(seq, "big"), decode(payload)))
    return got


def stored_blocks(messages) -> dict[int, list[int]]:
    """hash -> its block's token ids, from the BlockStored events of ``messages``."""
    out = {}
    for _, _, (_, events, _) in messages:
        for e in events:
            if e[0] == "BlockStored":
                for i, h in enumerate(e[1]):
                    out[h] = e[3][i * e[4]:(i + 1) * e[4]]
    return out


def test_engine_publishes_a_requests_blocks_then_their_removal(smollm2_model):
    port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic="kv")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
        engine = LLMEngine(smollm2_model, kv_cache_tokens=48, block_size=4, kv_events=publisher)  # 12 blocks
        prompt = smollm2_model.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice over.")
        out = engine.generate([prompt], GenerationConfig(max_new_tokens=4))[0]
        want = chain(prompt, 4)
        first = receive(sub, lambda m: set(want) <= set(stored_blocks(m)))
        assert all(topic == b"kv" for topic, _, _ in first)
        assert [seq for _, seq, _ in first] == list(range(len(first)))
        held = stored_blocks(first)
        assert [held[h] for h in want] == [prompt[i * 4:(i + 1) * 4] for i in range(len(want))]
        assert all(isinstance(ts, float) and rank == 0 for _, _, (ts, _, rank) in first)
        full = prompt + out.token_ids
        # other requests take the whole pool: the first request's blocks go to new content
        for n in range(4):  # one after another, each taking the least recently released free blocks
            other = smollm2_model.tokenizer.encode(f"Count from {n} to {n + 20} in words, slowly, please.")
            engine.generate([other], GenerationConfig(max_new_tokens=8))
        later = receive(sub, lambda m: set(want) <= {h for _, _, (_, ev, _) in m for e in ev
                                                      if e[0] == "BlockRemoved" for h in e[1]})
        assert later[0][1] == first[-1][1] + 1
        assert len(full) > len(prompt)

        dealer = context.socket(zmq.DEALER)  # replay from the first message
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append((int.from_bytes(seq, "big"), decode(payload)))
        dealer.close(linger=0)
        sent = first + later
        assert [s for s, _ in replayed][:len(sent)] == [s for _, s, _ in sent]
        assert [p for _, p in replayed][:len(sent)] == [p for _, _, p in sent]
    finally:
        sub.close(linger=0)
        context.term()
        publisher.close()


def test_serve_publishes_a_chat_requests_blocks(smollm2_path):
    import openai

    port, events_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    server = subprocess.Popen([sys.executable, "-m", "llaisys", "serve", "--model", str(smollm2_path), "--port",
                               str(port), "--threads", "1", "--kv-cache-tokens", "4096",
                               "--kv-events", f"tcp://127.0.0.1:{events_port}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.25)
        time.sleep(0.3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        messages = [{"role": "user", "content": "Name three rivers of Europe and one fact about each of them."}]
        root = openai.OpenAI(base_url=f"http://127.0.0.1:{port}", api_key="none")
        ids = root.post("/tokenize", body={"model": "SmolLM2-135M-Instruct.Q4_1", "messages": messages},
                        cast_to=object)["tokens"]
        client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=4)
        want = chain(ids, 16)
        assert want
        got = stored_blocks(receive(sub, lambda m: set(want) <= set(stored_blocks(m))))
        assert [got[h] for h in want] == [ids[i * 16:(i + 1) * 16] for i in range(len(want))]
    finally:
        sub.close(linger=0)
        context.term()
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_serve_refuses_events_options_that_cannot_work(smollm2_path):
    for args, message in ((["--kv-events", "5557"], "expected tcp://HOST:PORT"),
                          (["--kv-events-replay", "tcp://127.0.0.1:5999"], "needs --kv-events")):
        proc = subprocess.run([sys.executable, "-m", "llaisys", "serve", "--model", str(smollm2_path), *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
