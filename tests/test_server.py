"""``llaisys serve``: the official openai client against a live server on loopback.

One server over the session's SmolLM2 runs for the module; tests that need other options
start their own for a moment. Greedy requests (temperature 0) are compared with each other
(streamed with whole, batched with alone), sampled ones by seed. Token counts stay small.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.message import Message

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llaisys.server import ServerOptions, create_app, make_server

pytestmark = pytest.mark.timeout(180)


# ---- helpers ---------------------------------------------------------------------------------
@contextmanager
def running(app) -> Iterator[str]:
    """Serve ``app`` on a free loopback port in a thread; yields its base URL."""
    server = make_server(app, app.state.models.options, log_level="warning", access_log=False)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop"


@dataclass
class Reply:
    status_code: int
    headers: Message
    body: bytes

    def json(self):
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


def http(method: str, url: str, *, json_body=None, content: bytes | None = None, headers=None) -> Reply:
    """One plain HTTP request (urllib); any status comes back as a Reply."""
    headers = dict(headers or {})
    if json_body is not None:
        content = json.dumps(json_body).encode()
        headers.setdefault("Content-Type", "application/json")
    request = urllib.request.Request(url, data=content, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return Reply(r.status, r.headers, r.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, err.headers, err.read())


get = functools.partial(http, "GET")
post = functools.partial(http, "POST")


def client_for(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics."""
    text = get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(f"{name} {labels} not in /metrics")


def wait_for(check, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """Send a POST on a plain socket (to hang up at will); returns the socket."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def sse_events(url: str, body: dict) -> list[str]:
    """POST ``body`` for a stream; the data fields of its events, in order."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return [line[len(b"data: "):].decode().strip() for line in r if line.startswith(b"data: ")]


class WithoutChatTemplate:
    """The model with a tokenizer that has no chat template (everything else shared)."""

    def __init__(self, model) -> None:
        self._model = model
        self.tokenizer = copy.copy(model.tokenizer)
        self.tokenizer.chat_template = None

    def __getattr__(self, name: str):
        return getattr(self._model, name)


# ---- the module's server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(smollm2_model) -> Iterator[str]:
    with running(create_app(ServerOptions(), model=smollm2_model)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return client_for(url)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


HELLO = [{"role": "user", "content": "What is the capital of France?"}]


def test_health_version_models(url, client, model_name, smollm2_model):
    assert get(f"{url}/health").status_code == 200
    assert get(f"{url}/version").json()["version"]
    (entry,) = client.models.list().data
    assert entry.id == model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert entry.max_model_len == smollm2_model.config.max_position_embeddings


def test_chat_streamed_equals_whole(client, model_name, url):
    kwargs = dict(model=model_name, messages=HELLO, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    prompt_ids = post(f"{url}/tokenize", json_body={"messages": HELLO}).json()["tokens"]
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert 1 <= whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_streamed_whole_and_token_ids(client, model_name, smollm2_model):
    prompt = "The capital of France is"
    whole = client.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    streamed = client.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    ids = smollm2_model.tokenizer.encode(prompt)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text
    several = client.completions.create(model=model_name, prompt=[prompt, "Once upon a time"], max_tokens=4,
                                        temperature=0)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text == whole.choices[0].text[:len(several.choices[0].text)]


def test_n_and_seed(client, model_name):
    kwargs = dict(model=model_name, messages=HELLO, max_tokens=10, temperature=0.8)
    both = client.chat.completions.create(**kwargs, n=2, seed=1234)
    assert [c.index for c in both.choices] == [0, 1]
    again = client.chat.completions.create(**kwargs, n=2, seed=1234)
    assert [c.message.content for c in again.choices] == [c.message.content for c in both.choices]
    # choice i samples with seed + i: the same as a single request with that seed
    for i, seed in enumerate((1234, 1235)):
        single = client.chat.completions.create(**kwargs, seed=seed)
        assert single.choices[0].message.content == both.choices[i].message.content
    streamed = client.chat.completions.create(**kwargs, n=2, seed=1234, stream=True)
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in both.choices]


def test_usage_sums_the_choices(client, model_name):
    r = client.completions.create(model=model_name, prompt="Hello", max_tokens=6, temperature=0.8, n=2, seed=1,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and all(c.finish_reason == "length" for c in r.choices)
    default = client.completions.create(model=model_name, prompt="Hello", temperature=0,
                                        extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_chat_logprobs(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content)
    streamed = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=6, temperature=0,
                                              logprobs=True, stream=True)
    tokens = [e.token for c in streamed for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert tokens == [e.token for e in content]
    plain = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and top[token] == pytest.approx(logprob) and logprob == max(top.values())


def test_stop_string_never_leaks(client, model_name):
    prompt = "The capital of France is"
    base = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0, logprobs=0)
    tokens, text = base.choices[0].logprobs.tokens, base.choices[0].text
    start = next(i for i in range(2, len(tokens) - 2) if text.find(tokens[i] + tokens[i + 1]) ==
                 sum(map(len, tokens[:i])) and tokens[i].strip() and tokens[i + 1].strip())
    stop = tokens[start] + tokens[start + 1]  # spans two tokens
    expected = text[:text.find(stop)]
    streamed = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0,
                                         stop=[stop, "never seen"], stream=True)
    pieces = [c.choices[0].text for c in streamed]
    assert "".join(pieces) == expected and stop not in "".join(pieces)
    whole = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0, stop=stop)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"


def test_concurrent_streams_equal_sequential(client, url, model_name):
    topics = ["the sea", "a cat", "winter", "music", "a city at night", "bread", "the moon", "a library"]
    prompts = [f"Write one sentence about {t}." for t in topics]
    sequential = [client.completions.create(model=model_name, prompt=p, max_tokens=10, temperature=0).choices[0].text
                  for p in prompts]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(together()) == sequential


def test_shared_system_prompt_hits_the_prefix_cache(client, url, model_name):
    system = ("You are a careful assistant for a small bakery. Answer questions about bread, opening hours and "
              "prices politely, in one short sentence, and never invent products the bakery does not sell. ") * 2
    hits = metric(url, "vllm:prefix_cache_hits_total")
    first = client.chat.completions.create(model=model_name, max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "When do you open?"}])
    second = client.chat.completions.create(model=model_name, max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Do you sell rye bread?"}])
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens > 64 and cached >= 48 and cached % 16 == 0
    assert metric(url, "vllm:prefix_cache_hits_total") - hits >= cached
    assert metric(url, "vllm:prefix_cache_queries_total") > 0


def test_metrics_names(url, client, model_name):
    client.completions.create(model=model_name, prompt="Hi", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    text = get(f"{url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_sum"):
        assert f"\n{name}{{" in text, name
    assert metric(url, "vllm:request_success_total", finished_reason="length") >= 1
    assert metric(url, "vllm:inter_token_latency_seconds_count") >= 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_disconnect_aborts_and_frees_blocks(url, client, model_name, stream):
    aborted = metric(url, "vllm:request_success_total", finished_reason="abort")
    sock = raw_post(url, "/v1/completions", {"model": model_name, "prompt": "Tell me a long story.",
                                             "max_tokens": 2000, "ignore_eos": True, "stream": stream})
    try:
        if stream:
            seen = b""
            while seen.count(b"data: ") < 3:
                seen += sock.recv(4096)
        else:
            wait_for(lambda: metric(url, "vllm:num_requests_running") == 1, what="the request to run")
        assert metric(url, "vllm:kv_cache_usage_perc") > 0
    finally:
        sock.close()
    wait_for(lambda: metric(url, "vllm:num_requests_running") == 0, what="the request to end")
    assert metric(url, "vllm:kv_cache_usage_perc") == 0
    assert metric(url, "vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(url, "vllm:generation_tokens_total") < 1e6
    r = client.completions.create(model=model_name, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices[0].text  # still serving


def test_tokenize_detokenize(url, smollm2_model):
    text = "Hello, world! Déjà vu."
    tok = post(f"{url}/tokenize", json_body={"prompt": text}).json()
    assert tok["tokens"] == smollm2_model.tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == smollm2_model.config.max_position_embeddings and tok["token_strs"] is None
    assert post(f"{url}/detokenize", json_body={"tokens": tok["tokens"]}).json() == {"prompt": text}
    strs = post(f"{url}/tokenize", json_body={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert "".join(strs) == text
    chat = post(f"{url}/tokenize", json_body={"messages": HELLO}).json()
    rendered = smollm2_model.tokenizer.apply_chat_template(HELLO)
    assert chat["tokens"] == smollm2_model.tokenizer.encode(rendered, add_special_tokens=False)
    bad = post(f"{url}/detokenize", json_body={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ---- errors ----------------------------------------------------------------------------------
CHAT_ERRORS = [  # (request fields, status, param)
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": 2.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"n": 0}, 400, "n"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ({"presence_penalty": 3}, 400, "presence_penalty"),
    ({"seed": 1.5}, 400, "seed"),
    ({"stop": ["ok", ""]}, 400, "stop"),
    ({"stream": "yes"}, 400, "stream"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),  # a text model: no vision encoder
    ({"messages": [{"role": "user", "content": [{"type": "audio", "data": "x"}]}]}, 400, "messages[0].content"),
    ({"model": "gpt-9"}, 404, "model"),
    ({"max_tokens": 8190}, 400, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
]


@pytest.mark.parametrize("fields, status, param", CHAT_ERRORS, ids=[p for _, _, p in CHAT_ERRORS])
def test_chat_errors(client, model_name, fields, status, param):
    body = {"model": model_name, "messages": HELLO, "max_tokens": 4, **fields}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**{k: body.pop(k) for k in ("model", "messages")}, extra_body=body)
    err = info.value
    assert err.status_code == status
    assert set(err.body) == {"message", "type", "param", "code"} and err.body["message"]
    assert err.param == param, err.body
    assert err.type == "invalid_request_error"


def test_unknown_fields_are_ignored(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=2, temperature=0,
                                       extra_body={"no_such_field": {"x": 1}, "user": "someone"})
    assert r.choices[0].message.content


def test_context_length_errors(client, model_name, smollm2_model):
    context = smollm2_model.config.max_position_embeddings
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt=[1] * (context + 10), max_tokens=4)
    assert info.value.param == "prompt" and info.value.code == "context_length_exceeded"
    assert str(context) in info.value.message and str(context + 10) in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt=[1] * 100, max_tokens=context)
    assert info.value.param == "max_tokens"
    assert str(context) in info.value.message and str(context + 100) in info.value.message


def test_malformed_json(url):
    for body, headers in ((b'{"prompt": "x",', {"content-type": "application/json"}), (b"{not json", {})):
        r = post(f"{url}/v1/completions", content=body, headers=headers)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json" and "JSON" in err["message"]
    for body in (b"[1, 2]", b"5", b"null", b'"text"'):
        r = post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"], body
    r = get(f"{url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


# ---- servers with other options --------------------------------------------------------------
def test_api_key(smollm2_model):
    with running(create_app(ServerOptions(api_key="sekrit", kv_cache_tokens=256), model=smollm2_model)) as base:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = post(f"{base}/v1/completions", json_body={"prompt": "Hi", "max_tokens": 1}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client_for(base, "wrong").models.list()
        assert post(f"{base}/tokenize", json_body={"prompt": "Hi"}).status_code == 401
        good = client_for(base, "sekrit")
        assert good.completions.create(model=good.models.list().data[0].id, prompt="Hi", max_tokens=1).choices
        assert get(f"{base}/health").status_code == 200  # probes need no key
        assert get(f"{base}/metrics").status_code == 200


def test_metrics_require_key(smollm2_model, monkeypatch):
    options = ServerOptions(api_key="sekrit", kv_cache_tokens=256, metrics_require_key=True)
    with running(create_app(options, model=smollm2_model)) as base:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = get(f"{base}/metrics", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = get(f"{base}/metrics", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and "vllm:num_requests_running" in r.text
        assert get(f"{base}/health").status_code == 200
    with pytest.raises(ValueError, match="metrics_require_key needs an api_key"):
        ServerOptions(metrics_require_key=True)
    from llaisys.cli.common import UsageError
    from llaisys.cli.main import build_parser

    monkeypatch.delenv("LLAISYS_API_KEY", raising=False)
    args = build_parser().parse_args(["serve", "--metrics-require-key"])
    with pytest.raises(UsageError, match="--metrics-require-key needs an API key"):
        args.func(args)


def test_openapi_documents_the_bodies(url):
    doc = get(f"{url}/openapi.json").json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = body["$ref"].rsplit("/", 1)[1]
    schema = doc["components"]["schemas"][name]
    assert "messages" in schema["required"] and "temperature" in schema["properties"]
    assert doc["components"]["schemas"]["ChatMessage"]["properties"]["role"]


# ---- sampling defaults: the model's generation_config.json, else the CLI's fallback ----------
class WithDefaults:
    """The model with another generation_config.json (everything else shared)."""

    def __init__(self, model, defaults: dict) -> None:
        self._model = model
        self.generation_defaults = defaults

    def __getattr__(self, name: str):
        return getattr(self._model, name)


@pytest.mark.parametrize("defaults, expected", [
    ({}, None),  # SmolLM2's GGUF says nothing about sampling: FALLBACK_SAMPLING, as the CLI and the page
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 3},
     {"temperature": 0.6, "top_p": 0.95, "top_k": 20}),
])
def test_omitted_sampling_fields_take_the_models_defaults(smollm2_model, defaults, expected):
    from llaisys.generation.defaults import FALLBACK_SAMPLING

    expected = expected or FALLBACK_SAMPLING
    with running(create_app(ServerOptions(kv_cache_tokens=512), model=WithDefaults(smollm2_model, defaults))) as base:
        c = client_for(base)
        name = c.models.list().data[0].id
        story = [{"role": "user", "content": "Tell me a story."}]
        kwargs = dict(model=name, messages=story, max_tokens=12, seed=11)
        omitted = c.chat.completions.create(**kwargs).choices[0].message.content
        given = dict(expected)
        extra = {"top_k": given.pop("top_k")} if "top_k" in given else {}  # vLLM's field: not the client's
        explicit = c.chat.completions.create(**kwargs, **given, extra_body=extra).choices[0].message.content
        assert omitted == explicit
        hot = [c.chat.completions.create(**{**kwargs, "seed": s}, temperature=1.5, top_p=1.0,
                                         frequency_penalty=0).choices[0].message.content for s in (11, 12)]
        cold = [c.chat.completions.create(**{**kwargs, "seed": s}).choices[0].message.content for s in (11, 12)]
        assert hot != cold  # explicit values win over the defaults
        text = c.completions.create(model=name, prompt="Once upon a time", max_tokens=8, seed=3).choices[0].text
        assert text == c.completions.create(model=name, prompt="Once upon a time", max_tokens=8, seed=3, **given,
                                            extra_body=extra).choices[0].text


def test_omitted_temperature_is_greedy_when_the_model_says_so(smollm2_model):
    with running(create_app(ServerOptions(kv_cache_tokens=512),
                            model=WithDefaults(smollm2_model, {"do_sample": False}))) as base:
        c = client_for(base)
        name = c.models.list().data[0].id
        greedy = c.chat.completions.create(model=name, messages=HELLO, max_tokens=10, temperature=0)
        for seed in (1, 2):
            r = c.chat.completions.create(model=name, messages=HELLO, max_tokens=10, seed=seed)
            assert r.choices[0].message.content == greedy.choices[0].message.content
        r = c.responses.create(model=name, input=HELLO[0]["content"], max_output_tokens=10)
        assert r.output_text == greedy.choices[0].message.content


def test_the_configs_the_service_builds(smollm2_model):
    """Omitted fields: the model's defaults (FALLBACK_SAMPLING here) and, for chat, CHAT_MAX_TOKENS
    (the CLI's chat and the page's); given ones win; top_k past the vocabulary is off."""
    from llaisys.generation.defaults import CHAT_MAX_TOKENS, FALLBACK_SAMPLING
    from llaisys.server.protocol import ChatCompletionRequest

    app = create_app(ServerOptions(), model=smollm2_model)
    with running(app):
        service = app.state.service
        context = service.max_model_len
        assert service.completion_budget(30, None, "max_tokens", "messages") == CHAT_MAX_TOKENS
        assert service.completion_budget(context - 100, None, "max_tokens", "messages") == 100
        assert service.completion_budget(30, 2000, "max_tokens", "messages") == 2000

        def config(**fields):
            req = ChatCompletionRequest.model_validate({"messages": HELLO, **fields})
            return service.generation_config(req, 16, None, 0)

        cfg = config()
        assert (cfg.temperature, cfg.top_p, cfg.frequency_penalty) == (
            FALLBACK_SAMPLING["temperature"], FALLBACK_SAMPLING["top_p"], FALLBACK_SAMPLING["frequency_penalty"])
        cfg = config(temperature=0.0, top_p=1.0, frequency_penalty=0.0, top_k=smollm2_model.config.vocab_size)
        assert (cfg.temperature, cfg.top_p, cfg.frequency_penalty, cfg.top_k) == (0.0, 1.0, 0.0, 0)
        assert config(top_k=2**70).top_k == 0 and config(top_k=5).top_k == 5 and config(top_k=-1).top_k == 0


def test_engine_refusal_is_a_400(smollm2_model):
    with running(create_app(ServerOptions(kv_cache_tokens=64), model=smollm2_model)) as base:
        c = client_for(base)
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=c.models.list().data[0].id, prompt=[1] * 40, max_tokens=100)
        assert "more than the whole pool holds" in info.value.message
        r = c.completions.create(model=c.models.list().data[0].id, prompt=[1] * 40, max_tokens=2)
        assert r.usage.completion_tokens >= 1


def test_chat_template_missing_or_given(smollm2_model, tmp_path):
    model = WithoutChatTemplate(smollm2_model)
    with running(create_app(ServerOptions(kv_cache_tokens=256), model=model)) as base:
        c = client_for(base)
        name = c.models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=name, messages=HELLO, max_tokens=2)
        assert info.value.param == "messages" and info.value.code == "no_chat_template"
        assert "--chat-template" in info.value.message
        assert c.completions.create(model=name, prompt="Hi", max_tokens=1).choices  # plain prompts still work
    template = tmp_path / "chatml.jinja"
    template.write_text(str(smollm2_model.tokenizer.chat_template), encoding="utf-8")
    with running(create_app(ServerOptions(kv_cache_tokens=256, chat_template=str(template)), model=model)) as base:
        c = client_for(base)
        r = c.chat.completions.create(model=c.models.list().data[0].id, messages=HELLO, max_tokens=6, temperature=0)
        rendered = smollm2_model.tokenizer.apply_chat_template(HELLO)
        assert r.usage.prompt_tokens == len(smollm2_model.tokenizer.encode(rendered, add_special_tokens=False))


def test_health_503_while_loading(smollm2_model):
    gate = threading.Event()

    def slow_loader():
        gate.wait(30)
        return smollm2_model

    with running(create_app(ServerOptions(kv_cache_tokens=256), loader=slow_loader)) as base:
        r = get(f"{base}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        with pytest.raises(openai.APIStatusError) as info:
            client_for(base).chat.completions.create(model="x", messages=HELLO)
        assert info.value.status_code == 503 and info.value.code == "model_loading"
        gate.set()
        wait_for(lambda: get(f"{base}/health").status_code == 200, what="the model to load")
        assert client_for(base).completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hi",
                                                   max_tokens=1).choices


def test_failed_load_stops_the_server():
    def broken_loader():
        raise RuntimeError("no such weights")

    app = create_app(ServerOptions(served_model_name="broken"), loader=broken_loader)
    server = make_server(app, app.state.service.options, log_level="critical", access_log=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive()
    assert app.state.service.status == "failed" and "no such weights" in app.state.service.failure()


def test_cors(smollm2_model, url):
    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    r = http("OPTIONS", f"{url}/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers  # off by default
    options = ServerOptions(kv_cache_tokens=256, allowed_origins=("http://example.com",), api_key="k")
    with running(create_app(options, model=smollm2_model)) as base:
        r = http("OPTIONS", f"{base}/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://example.com"
        r = get(f"{base}/v1/models", headers={"Origin": "http://example.com"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://example.com"


def test_graceful_shutdown(smollm2_model):
    app = create_app(ServerOptions(kv_cache_tokens=4096, shutdown_timeout_s=1.5), model=smollm2_model)
    server = make_server(app, app.state.models.options, log_level="warning", access_log=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, what="the server to start")
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    results: dict[str, list[str]] = {}

    def stream(name: str, max_tokens: int) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        results[name] = sse_events(f"{base}/v1/completions", body)

    # the long request first, so the short one cannot finish before both are seen running
    workers = [threading.Thread(target=stream, args=("long", 4000)), threading.Thread(target=stream, args=("short", 32))]
    workers[0].start()
    wait_for(lambda: metric(base, "vllm:num_requests_running") == 1, what="the long request to run")
    workers[1].start()
    wait_for(lambda: metric(base, "vllm:num_requests_running") == 2, what="both requests to run")
    server.handle_exit(signal.SIGTERM, None)
    for w in workers:
        w.join(30)
    thread.join(30)
    assert not thread.is_alive() and not app.state.service.engine.alive
    short, long = results["short"], results["long"]
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]"
    error = json.loads(long[-2])["error"]
    assert "shutting down" in error["message"] and error["code"] == "server_shutting_down"
    assert len(long) < 4000


# ---- the command line ------------------------------------------------------------------------
def test_cli_serve_options_and_failed_load(tmp_path):
    from llaisys.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--chat-template", str(tmp_path / "none.jinja")])
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        args.func(args)
    # the server starts, the model fails to load in the background, the command returns 1
    args = parser.parse_args(["serve", "--model", str(tmp_path / "missing.gguf"), "--port", "0", "--api-key", "k",
                              "--allowed-origins", "*", "--max-seqs", "4", "--kv-cache-tokens", "256",
                              "--allowed-hosts", "myhost.lan", "*.example.com", "--max-choices", "8",
                              "--max-body-bytes", "100000", "--header-timeout", "5", "--body-timeout", "5",
                              "--max-connections", "50"])
    assert args.func(args) == 1
