"""``llaisys serve`` under hostile or careless clients, over real sockets: text that is not
Unicode, deep JSON, huge bodies and prompts, bodies that take seconds to parse (sent with and
without the key), values no route may answer with a 500 (numbers that are not finite or not
in range, fields of the wrong shape), stalled connections, foreign Host headers, requests
asking for too many choices, and signals while requests run.

Servers run on loopback in a thread (``running`` from test_server.py) with small timeouts;
the shutdown and descriptor tests start ``python -m llaisys serve`` as a process.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

import openai
import pytest

from llaisys.server import ServerOptions, create_app
from test_server import client_for, get, post, running, wait_for

pytestmark = pytest.mark.timeout(180)

HELLO = [{"role": "user", "content": "Hi"}]
LIMIT = 8 << 20  # ServerOptions' default max_body_bytes


# ---- helpers ---------------------------------------------------------------------------------
def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def raw_request(url: str, data: bytes, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """Send ``data`` (a whole HTTP/1.1 request) on a new socket; the status, headers and body of
    the answer, read until the server closes or the body is complete."""
    with socket.create_connection(address(url), timeout=timeout) as sock:
        sock.sendall(data)
        return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response (Content-Length framed) read from ``sock``."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a response: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    size = int(headers.get("content-length", 0))
    while len(body) < size:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def post_raw(url: str, path: str, body: bytes, host: str = "127.0.0.1") -> tuple[int, dict, bytes]:
    """POST ``body`` as JSON with Content-Length on a raw socket."""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return raw_request(url, head + body)


def error_of(status_headers_body: tuple[int, dict, bytes]) -> tuple[int, dict]:
    status, headers, body = status_headers_body
    assert headers.get("content-type", "").startswith("application/json"), (status, headers, body[:200])
    return status, json.loads(body)["error"]


def closed_by_server(sock: socket.socket, within: float) -> bytes:
    """Wait until the server closes ``sock`` (what it sent before); fails after ``within`` s."""
    sock.settimeout(within)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        raise AssertionError(f"the server kept the connection open for {within} s (got {data[:80]!r})") from None
    except ConnectionResetError:
        pass
    return data


def health_gaps(url: str, while_running: threading.Thread, every: float = 0.05) -> list[float]:
    """GET /health again and again while ``while_running`` runs; the times between two answers
    (from the start). Gaps, not each request's time: a server in this process that held the GIL
    would stop this thread too, between two requests."""
    gaps, last = [], time.monotonic()
    while while_running.is_alive():
        assert get(f"{url}/health").status_code == 200
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        time.sleep(every)
    return gaps


@pytest.fixture(scope="module")
def url(smollm2_model, tmp_path_factory) -> Iterator[str]:
    """A server with the default body limit and short header/body timeouts."""
    options = ServerOptions(kv_cache_tokens=1024, header_timeout_s=1.0, body_timeout_s=1.5,
                            db_path=str(tmp_path_factory.mktemp("db") / "ui.sqlite3"))
    with running(create_app(options, model=smollm2_model)) as base:
        yield base


def test_options_are_checked():
    for bad in ({"max_body_bytes": 0}, {"header_timeout_s": 0}, {"body_timeout_s": -1}, {"max_connections": 0},
                {"max_choices": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerOptions(**bad)
    assert ServerOptions(allowed_hosts="myhost").allowed_hosts == ("myhost",)
    assert ServerOptions().choices_limit == 128 and ServerOptions(max_seqs=256).choices_limit == 256


# ---- 1. text that is not Unicode -------------------------------------------------------------
SURROGATE = r"x\ud800y"  # JSON's escape of a lone surrogate: valid JSON, not valid Unicode
SURROGATE_CASES = [  # (route, JSON body text, the param the error names)
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}', "messages[0].content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "system", "content": "{SURROGATE}"}}, '
                             '{"role": "user", "content": "Hi"}]}', "messages[0].content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": [{{"type": "text", '
                             f'"text": "{SURROGATE}"}}]}}]}}', "messages[0].content[0].text"),
    ("/v1/chat/completions", f'{{"model": "{SURROGATE}", "messages": [{{"role": "user", "content": "Hi"}}]}}', "model"),
    ("/v1/completions", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
    ("/v1/completions", f'{{"model": "{SURROGATE}", "prompt": "Hi"}}', "model"),
    ("/v1/completions", f'{{"prompt": "Hi", "stop": ["{SURROGATE}"]}}', "stop[0]"),
    ("/tokenize", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}', "messages[0].content"),
    ("/tokenize", f'{{"model": "{SURROGATE}", "prompt": "Hi"}}', "model"),
    ("/detokenize", f'{{"model": "{SURROGATE}", "tokens": [1]}}', "model"),
]


@pytest.mark.parametrize("route, body, param", SURROGATE_CASES, ids=[f"{r}:{p}" for r, _, p in SURROGATE_CASES])
def test_lone_surrogates_are_400(url, route, body, param):
    status, err = error_of(post_raw(url, route, body.encode()))
    assert status == 400 and err["param"] == param and err["code"] == "invalid_unicode", err
    assert param in err["message"] and "surrogate" in err["message"]


def test_surrogate_pairs_and_unknown_models_still_work(url):
    status, _, body = post_raw(url, "/tokenize", rb'{"prompt": "smile \ud83d\ude00"}')  # a pair: one emoji
    assert status == 200 and json.loads(body)["count"] > 1
    status, err = error_of(post_raw(url, "/v1/completions", b'{"model": "gpt-9", "prompt": "Hi"}'))
    assert status == 404 and err["code"] == "model_not_found"


# ---- 7. deep JSON ----------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [100, 100_000])
@pytest.mark.parametrize("content_type", ["application/json", None])
def test_deep_json_is_400(url, depth, content_type):
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "tools": ' + b"[" * depth + b"]" * depth + b"}"
    headers = {"Content-Type": content_type} if content_type else {}
    r = post(f"{url}/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 400, r.body[:300]
    err = r.json()["error"]
    assert err["code"] == "json_too_deep" and "nested too deeply" in err["message"], err


# ---- 2. large bodies and prompts -------------------------------------------------------------
def test_body_over_the_limit_by_content_length(url):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {10_000_000}\r\n\r\n").encode()
    with socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(head + b'{"prompt": "')  # refused from the headers: the rest is never sent
        status, err = error_of(read_response(sock))
        assert closed_by_server(sock, 5) == b""
    assert status == 413 and err["code"] == "request_too_large" and "--max-body-bytes" in err["message"]


def test_chunked_body_over_the_limit(url):
    with socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"a" * (1 << 20)
        for _ in range(LIMIT // len(piece)):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        sock.sendall(b"1\r\na\r\n")  # one byte over: the server counts it and answers, not waiting for the end
        status, err = error_of(read_response(sock))
    assert status == 413 and err["code"] == "request_too_large"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_health_answers_while_a_10mb_body_is_refused(url):
    """10 MB sent (chunked, as it comes) five times over while /health is polled: each is
    refused (a 413, or the connection reset under the rest of the upload), none kept whole."""
    outcomes = []

    def send_big() -> None:
        for _ in range(5):
            try:
                with socket.create_connection(address(url), timeout=10) as sock:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                 b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                    piece = b"b" * (1 << 20)
                    for _ in range(10):
                        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                    sock.sendall(b"0\r\n\r\n")
                    outcomes.append(read_response(sock)[0])
            except OSError:  # the server answered 413 and closed while we were still sending
                outcomes.append("reset")

    before = rss_bytes()
    sender = threading.Thread(target=send_big)
    sender.start()
    gaps = health_gaps(url, sender)
    sender.join()
    assert set(outcomes) <= {413, "reset"}, outcomes
    assert gaps and max(gaps) < 1.0, gaps
    assert rss_bytes() - before < 100 << 20  # the bodies were not kept


def test_health_answers_while_a_big_prompt_is_tokenized(url, smollm2_model):
    sentence = "The quick brown fox jumps over the lazy dog; 1234 déjà vu."
    text = " ".join([sentence] * 50_000)  # 3 MB, under the limit: seconds of tokenizing
    result = {}

    def tokenize() -> None:
        result["reply"] = post(f"{url}/tokenize", json_body={"prompt": text})

    worker = threading.Thread(target=tokenize)
    start = time.monotonic()
    worker.start()
    gaps = health_gaps(url, worker)
    worker.join()
    took = time.monotonic() - start
    reply = result["reply"].json()
    head = smollm2_model.tokenizer.encode(" ".join([sentence] * 3))
    assert result["reply"].status_code == 200 and reply["tokens"][:len(head)] == head
    assert reply["count"] > 500_000
    assert took > 1.0 and len(gaps) >= 5, (took, gaps)  # /health was asked while it was tokenized
    assert max(gaps) < 1.0, gaps


def test_prompt_longer_than_the_context_is_refused_at_once(url, smollm2_model):
    """A prompt with more characters than the context's tokens can hold is a 400 before any
    tokenizing (the message counts characters, not tokens)."""
    text = "word " * 600_000  # 3 MB
    client = client_for(url)
    for call in (lambda: client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=text, max_tokens=1),
                 lambda: client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=1,
                                                        messages=[{"role": "user", "content": text}])):
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert time.monotonic() - start < 2.0
        assert info.value.code == "context_length_exceeded" and "characters" in info.value.message
        assert str(smollm2_model.config.max_position_embeddings) in info.value.message


# ---- 3. stalled connections ------------------------------------------------------------------
def test_stalled_connections_are_closed(url):
    """Connections that send nothing, part of their headers, or part of their body are closed
    after the header (1 s) or body (1.5 s) timeout; meanwhile the server serves others."""
    host, port = address(url)
    idle, partial_head, partial_body = [], [], []
    for i in range(40):
        idle.append(socket.create_connection((host, port)))
        s = socket.create_connection((host, port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        partial_head.append(s)
        s = socket.create_connection((host, port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        partial_body.append(s)
    # a keep-alive connection that sends one request, then part of a second
    keep = socket.create_connection((host, port))
    keep.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert read_response(keep)[0] == 200
    keep.sendall(b"GET /health HTTP/1.1\r\nHo")
    start = time.monotonic()
    r = client_for(url).completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hi", max_tokens=2)
    assert r.choices and time.monotonic() - start < 1.0  # served meanwhile
    try:
        for s in idle + partial_head + [keep]:
            assert closed_by_server(s, 4.0) == b""
        for s in partial_body:
            status, err = error_of(read_response(s))
            assert status == 408 and err["code"] == "request_timeout" and "--body-timeout" in err["message"]
            assert closed_by_server(s, 2.0) == b""
        assert time.monotonic() - start < 6.0
    finally:
        for s in idle + partial_head + partial_body + [keep]:
            s.close()
    assert get(f"{url}/health").status_code == 200


def test_connection_cap_closes_the_longest_waiting(smollm2_model, caplog):
    """Above max_connections a new connection closes the one waiting longest without a request;
    when all have requests running, it gets a 503 at once. One log line, not one per connection."""
    options = ServerOptions(kv_cache_tokens=1024, max_connections=20, header_timeout_s=30, body_timeout_s=30)
    with caplog.at_level(logging.WARNING, logger="llaisys.server.runner"), \
            running(create_app(options, model=smollm2_model)) as base:
        host, port = address(base)
        idle = [socket.create_connection((host, port)) for _ in range(25)]
        try:
            for s in idle[:5]:  # the five oldest made room for the last five
                assert closed_by_server(s, 5.0) == b""
            assert get(f"{base}/health").status_code == 200  # and one more for this request
        finally:
            for s in idle:
                s.close()
        wait_for(lambda: get(f"{base}/metrics").status_code == 200, what="the idle ones to go")
        busy = []
        try:
            for _ in range(20):  # every connection has a request running (its body is still to come)
                s = socket.create_connection((host, port))
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 10\r\n\r\n{")
                busy.append(s)
            time.sleep(0.3)
            status, err = error_of(raw_request(base, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
            assert status == 503 and err["code"] == "too_many_connections"
        finally:
            for s in busy:
                s.close()
        wait_for(lambda: get(f"{base}/health").status_code == 200, what="room for a connection")
    notes = [r.getMessage() for r in caplog.records if "--max-connections" in r.getMessage()]
    assert len(notes) == 2 and "closing" in notes[0] and "refusing" in notes[1], notes  # once per kind


# ---- 4. the Host header ----------------------------------------------------------------------
def host_status(url: str, path: str, host: str) -> int:
    return raw_request(url, f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())[0]


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "LOCALHOST.", "127.0.0.1:1234", "[::1]:80",
                                  "10.1.2.3"])
def test_host_loopback_and_addresses_accepted(url, host):
    for path in ("/health", "/v1/models", "/api/conversations"):
        assert host_status(url, path, host) == 200, (path, host)


def test_host_foreign_name_refused(url):
    for path in ("/health", "/v1/models", "/api/conversations", "/"):
        status, err = error_of(raw_request(
            url, f"GET {path} HTTP/1.1\r\nHost: attacker.example:8000\r\nConnection: close\r\n\r\n".encode()))
        assert status == 421 and err["code"] == "invalid_host", (path, err)
        assert "--allowed-hosts attacker.example" in err["message"]
    r = post_raw(url, "/v1/completions", b'{"prompt": "Hi", "max_tokens": 1}', host="rebound.example")
    assert r[0] == 421


def test_allowed_hosts_and_all_interfaces(smollm2_model, tmp_path):
    db = str(tmp_path / "ui.sqlite3")
    options = ServerOptions(kv_cache_tokens=256, allowed_hosts=("myhost.lan", "*.corp.example"), db_path=db)
    with running(create_app(options, model=smollm2_model)) as base:
        for host, status in (("myhost.lan:8000", 200), ("a.b.corp.example", 200), ("corp.example.evil", 421),
                             ("evil.example", 421)):
            assert host_status(base, "/api/conversations", host) == status, host
    with running(create_app(ServerOptions(kv_cache_tokens=256, allowed_hosts=("*",), db_path=db),
                            model=smollm2_model)) as base:
        assert host_status(base, "/api/conversations", "anything.example") == 200
    # listening on every interface: any name for the API, but the UI's stored conversations
    # still want a name known to be this machine (or an address)
    app = create_app(ServerOptions(host="0.0.0.0", kv_cache_tokens=256, db_path=db), model=smollm2_model)
    with running(app) as base:
        assert host_status(base, "/v1/models", "gpu-box.example:8000") == 200
        assert host_status(base, "/api/conversations", "gpu-box.example:8000") == 421
        assert host_status(base, "/api/conversations", "192.168.1.20:8000") == 200


# ---- 5. prompts × n --------------------------------------------------------------------------
def test_prompts_times_n_is_capped(url, smollm2_model):
    client = client_for(url)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=["Hi"] * 64, n=8, max_tokens=1)
    err = info.value
    assert err.code == "too_many_choices" and err.param == "n" and "512" in err.message and "128" in err.message
    assert "--max-choices" in err.message
    with running(create_app(ServerOptions(kv_cache_tokens=256, max_choices=4), model=smollm2_model)) as base:
        small = client_for(base)
        r = small.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=["Hi", "Yo"], n=2, max_tokens=1)
        assert len(r.choices) == 4
        for call in (lambda: small.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=["a"] * 5,
                                                      max_tokens=1),
                     lambda: small.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=HELLO, n=5,
                                                           max_tokens=1)):
            with pytest.raises(openai.BadRequestError) as info:
                call()
            assert info.value.code == "too_many_choices" and "at most 4" in info.value.message


# ---- 8. bodies off the event loop, the key first --------------------------------------------
EMPTY_LISTS = b"[" + b",".join([b"[]"] * 2_700_000) + b"]"  # 8 MB of `[],[],...`: 2.7 million lists


@functools.cache
def hostile_bodies() -> list[tuple[str, bytes, str]]:
    """(route, body, what the 400 says): bodies that take seconds of Python to parse and check."""
    prompts = json.dumps({"prompt": [[1]] * 1_000_000}).encode()
    return [("/api/conversations", EMPTY_LISTS, "must be a JSON object"),
            ("/v1/completions", prompts, "1000000 prompts"),
            ("/v1/embeddings", json.dumps({"input": [[1]] * 1_000_000}).encode(), "1000000 prompts"),
            # two million wrong items: one error, not two million (pydantic collecting them took 25 s)
            ("/v1/chat/completions", json.dumps({"messages": [1] * 2_000_000}).encode(), "messages[0]")]


def post_all(url: str, bodies: list[tuple[str, bytes, str]], headers: dict | None = None) -> tuple[threading.Thread,
                                                                                                     dict]:
    """A thread that POSTs every body at once (one thread each) and waits for them; its results,
    by index: (status, error, seconds)."""
    results: dict[int, tuple[int, dict, float]] = {}

    def one(i: int, path: str, body: bytes) -> None:
        start = time.monotonic()
        r = post(f"{url}{path}", content=body, headers={"Content-Type": "application/json", **(headers or {})})
        results[i] = (r.status_code, r.json()["error"], time.monotonic() - start)

    def run() -> None:
        senders = [threading.Thread(target=one, args=(i, path, body)) for i, (path, body, _) in enumerate(bodies)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()

    return threading.Thread(target=run), results


def test_health_answers_while_hostile_bodies_are_parsed(url):
    """Five bodies of megabytes at once, each seconds of parsing and validation: /health is
    answered meanwhile (they are parsed off the event loop), and each gets its 400."""
    bodies = hostile_bodies()
    sender, results = post_all(url, bodies)
    sender.start()
    gaps = health_gaps(url, sender)
    sender.join()
    for i, (path, _, says) in enumerate(bodies):
        status, err, _ = results[i]
        assert status == 400 and says in err["message"], (path, err)
    assert len(gaps) >= 3 and max(gaps) < 1.0, gaps


def test_api_key_is_checked_before_the_body(smollm2_model, tmp_path):
    options = ServerOptions(api_key="sekrit", kv_cache_tokens=256, db_path=str(tmp_path / "ui.sqlite3"))
    with running(create_app(options, model=smollm2_model)) as base:
        bodies = hostile_bodies()
        sender, results = post_all(base, bodies, {"Authorization": "Bearer wrong"})
        sender.start()
        sender.join()
        for i, (path, _, _) in enumerate(bodies):
            status, err, took = results[i]
            assert status == 401 and err["code"] == "invalid_api_key", (path, err)
            assert took < 1.0, (path, took)  # the body is never parsed (that took seconds)
        for path in ("/v1/chat/completions", "/tokenize", "/api/conversations"):  # not a 400 for the JSON
            r = post(f"{base}{path}", content=b"{not json", headers={"Content-Type": "application/json"})
            assert r.status_code == 401, (path, r.body)


# ---- 9. values no route may answer with a 500 ------------------------------------------------
VOCAB = 49152  # SmolLM2's vocabulary (checked against the model below)
HI = [{"role": "user", "content": "Hi"}]
BAD_VALUES = [  # (route, body: a dict, or JSON text for what Python cannot write, the param named, words said)
    ("/v1/chat/completions", {"messages": HI, "stop_token_ids": [2**63]}, "stop_token_ids[0]", "2147483648"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 9000}, "messages",
     "your messages are 9000"),
    ("/v1/chat/completions", {"messages": HI, "stop_token_ids": [1, VOCAB]}, "stop_token_ids[1]", "vocabulary"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [-1]}, "stop_token_ids[0]", "greater than"),
    ("/v1/completions", {"prompt": [[1], [2**64]]}, "prompt", "outside [0, 2147483648)"),
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**70, "max_tokens": 1, "n": 0}, "n", "greater than"),
    ("/v1/embeddings", {"input": [2**63]}, "input", "outside [0, 2147483648)"),
    ("/detokenize", {"tokens": [1, 2**63]}, "tokens[1]", "less than"),
    ("/v1/responses", {"input": "Hi", "text": {"format": "json_object"}}, "text.format", "got a string"),
    ("/v1/responses", {"input": "Hi", "text": {"format": 3}}, "text.format", "got a number"),
    ("/v1/responses", {"input": "Hi", "text": {"format": ["json_schema"]}}, "text.format", "got an array"),
    ("/v1/responses", {"input": "Hi", "metadata": {"user": 7}}, "metadata", "must be strings"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text", "must be a string"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools", "at most 128"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
     "temperature", "NaN"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": '
                             '{"x": [Infinity]}}', "chat_template_kwargs.x[0]", "Infinity"),
    ("/v1/completions", '{"prompt": "Hi", "top_p": 1e999}', "top_p", "1e999"),
    ("/v1/responses", '{"input": "Hi", "temperature": -Infinity}', "temperature", "-Infinity"),
    ("/v1/embeddings", '{"input": "Hi", "dimensions": NaN}', "dimensions", "NaN"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": '
                  '{"name": "f", "parameters": {"maximum": 1e400}}}]}', "tools[0].function.parameters.maximum",
     "1e400"),
    ("/api/conversations/import", '{"conversation": {"created": NaN}}', None, "conversation.created: NaN"),
    ("/api/conversations/import", {"conversation": {"created": 10**400}}, None, "created must be in"),
    ("/api/conversations/import", {"conversation": {"messages": [{"id": "a", "role": "user", "content": "x",
                                                                   "created": "yesterday"}]}},
     None, "messages[0].created must be a number"),
    ("/api/conversations/import", {"conversation": {"settings": {"temperature": 10**400}}}, None, "out of range"),
    ("/api/conversations/import", {"conversations": [], "version": 10**400}, None, "000... is not one"),
    ("/api/conversations", '{"settings": {"top_p": Infinity}}', None, "settings.top_p: Infinity"),
]


@pytest.mark.parametrize("route, body, param, says", BAD_VALUES, ids=[f"{r}:{p or s}" for r, _, p, s in BAD_VALUES])
def test_bad_values_are_400_naming_them(url, smollm2_model, route, body, param, says):
    assert smollm2_model.config.vocab_size == VOCAB
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    status, err = error_of(post_raw(url, route, raw))
    assert status == 400 and err["param"] == param and says in err["message"], err
    if param is not None:
        assert param in err["message"]


def test_top_k_beyond_the_vocabulary_keeps_every_token(url):
    """top_k of at least the vocabulary is no filter at all (as 0 is), however large."""
    client = client_for(url)
    kwargs = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt="Once upon a time", max_tokens=8, temperature=1.0,
                  seed=5)
    off = client.completions.create(**kwargs, extra_body={"top_k": 0}).choices[0].text
    for top_k in (VOCAB, 2**63, 10**30):
        assert client.completions.create(**kwargs, extra_body={"top_k": top_k}).choices[0].text == off


# ---- 6. signals ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    """A ``llaisys serve`` process, its URL, and the file its stderr goes to."""

    proc: subprocess.Popen
    url: str
    log: IO[str]

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()


@contextmanager
def serve_process(*args: str, nofile: int | None = None) -> Iterator[Served]:
    """``python -m llaisys serve --port P ARGS`` with the bundled model (and at most ``nofile``
    descriptors), once /health is 200; killed at the end if it still runs."""
    port = free_port()
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    with tempfile.TemporaryFile("w+") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "llaisys", "serve", "--port", str(port), *args],
                                stdout=subprocess.DEVNULL, stderr=log_file, preexec_fn=limit)
        served = Served(proc, f"http://127.0.0.1:{port}", log_file)
        try:
            def up() -> bool:
                assert proc.poll() is None, served.stderr()
                try:
                    return get(f"{served.url}/health").status_code == 200
                except OSError:
                    return False
            wait_for(up, timeout=60, what="the server to load its model")
            yield served
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def long_stream(base: str, events: list[str], max_tokens: int = 4000) -> threading.Thread:
    """A streamed completion running in a thread; its data lines go to ``events``."""
    def run() -> None:
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(address(base), timeout=60) as sock:
            sock.sendall(head + body)
            buf = b""
            while chunk := sock.recv(65536):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                events.extend(line[6:].decode() for line in lines if line.startswith(b"data: "))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_second_sigint_ends_requests_with_errors():
    with serve_process("--shutdown-timeout", "60") as served:
        proc, base = served.proc, served.url
        events: list[str] = []
        stream = long_stream(base, events)
        wait_for(lambda: len(events) >= 3, timeout=30, what="the stream to start")
        whole: dict = {}

        def wait_whole() -> None:
            body = json.dumps({"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True}).encode()
            whole["reply"] = post_raw(base, "/v1/completions", body)

        waiter = threading.Thread(target=wait_whole)
        waiter.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None and not whole  # draining: both still running
        proc.send_signal(signal.SIGINT)
        stream.join(30)
        waiter.join(30)
        proc.wait(30)
        stderr = served.stderr()
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    status, err = error_of(whole["reply"])
    assert status == 503 and err["code"] == "server_shutting_down"
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
    assert proc.returncode in (0, 130), (proc.returncode, stderr)  # SIGINT: KeyboardInterrupt's 130


def test_sigterm_drains_and_exits_0():
    with serve_process("--shutdown-timeout", "1") as served:
        proc, base = served.proc, served.url
        events: list[str] = []
        stream = long_stream(base, events)
        wait_for(lambda: len(events) >= 3, timeout=30, what="the stream to start")
        proc.send_signal(signal.SIGTERM)
        stream.join(30)
        assert proc.wait(30) == 0, served.stderr()
        stderr = served.stderr()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in stderr, stderr


# ---- 3. file descriptors ---------------------------------------------------------------------
def test_stalled_connections_under_a_low_descriptor_limit():
    """256 descriptors, 300 stalled connections: the cap (3/4 of the limit less 3 x 64, at least 16) keeps the
    server below the limit and makes room for a normal request; nothing floods the log."""
    with serve_process("--header-timeout", "30", nofile=256) as served:
        proc, base = served.proc, served.url
        host, port = address(base)
        stalled = [socket.create_connection((host, port), timeout=10) for _ in range(300)]
        try:
            assert get(f"{base}/health").status_code == 200
            assert client_for(base).completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hi",
                                                       max_tokens=1).choices
        finally:
            for s in stalled:
                s.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        stderr = served.stderr()
    assert "Traceback" not in stderr and "Too many open files" not in stderr, stderr[-3000:]


def test_running_out_of_descriptors_is_logged_once():
    with serve_process("--header-timeout", "2", "--max-connections", "10000", nofile=128) as served:
        proc, base = served.proc, served.url
        host, port = address(base)
        stalled = []
        try:
            for _ in range(200):
                stalled.append(socket.create_connection((host, port), timeout=10))
        except OSError:
            pass
        try:
            time.sleep(1.5)  # accepts keep failing while the connections stay
            wait_for(lambda: get(f"{base}/health").status_code == 200, timeout=20, what="the stalled ones to go")
        finally:
            for s in stalled:
                s.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        stderr = served.stderr()
    assert stderr.count("out of file descriptors") == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
