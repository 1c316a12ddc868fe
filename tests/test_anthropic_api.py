"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client against a live server on the bundled SmolLM2, checked against the OpenAI chat
route (the same conversation, greedy), transformers' chat template (token counts) and the
client's own stream accumulator; errors in Anthropic's shape as the client's typed exceptions.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import urllib.request

import anthropic
import jsonschema
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from llaisys.server import ServerOptions, create_app
from llaisys.server.anthropic import (AnthropicErrors, AnthropicMessagesRequest, ContentBlocks, MessageRun,
                                      chat_request, error_body, matched_stop, reshape_error)
from llaisys.server.completions import ChatFormat, Job
from llaisys.server.errors import shutting_down
from llaisys.server.reasoning import ReplyDeltas
from test_server import client_for, http, post, running

pytestmark = pytest.mark.timeout(180)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
GREEDY = {"temperature": 0}  # the client no longer names temperature: sent as an extra field
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                  "parameters": WEATHER}}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


def anthropic_client(url: str, **auth) -> anthropic.Anthropic:
    auth = auth or {"api_key": "unused"}
    return anthropic.Anthropic(base_url=url, max_retries=0, timeout=60, **auth)


def sse(url: str, body: dict) -> list[tuple[str, dict]]:
    """POST a streamed Messages request; its events as (event name, data), in order."""
    request = urllib.request.Request(f"{url}/v1/messages", data=json.dumps({**body, "stream": True}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    events, name = [], None
    with urllib.request.urlopen(request, timeout=60) as r:
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    return events


@pytest.fixture(scope="module")
def url(smollm2_model):
    with running(create_app(ServerOptions(), model=smollm2_model)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> anthropic.Anthropic:
    return anthropic_client(url)


def sdk(body: dict) -> dict:
    """The client's keyword arguments for a request body (the sampling fields it no longer names
    go as extra fields)."""
    args = dict(body)
    extra = {k: args.pop(k) for k in ("temperature", "top_p", "top_k") if k in args}
    return {**args, "extra_body": extra} if extra else args


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# ---- replies ------------------------------------------------------------------------------------
def test_whole_reply_equals_the_chat_route(url, client):
    system = [{"type": "text", "text": "You are a geography teacher."}, {"type": "text", "text": "Be brief."}]
    m = client.messages.create(model=MODEL, system=system, messages=ASK, max_tokens=16, extra_body=GREEDY,
                               extra_headers={"anthropic-version": "2023-06-01"})
    chat = client_for(url).chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": "You are a geography teacher.\nBe brief."}] + ASK)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"]
    assert text_of(m) == chat.choices[0].message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert m.stop_sequence is None
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_stream_events_in_order_joining_into_the_whole_reply(url, client):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 12, **GREEDY}
    whole = client.messages.create(**sdk(body))
    events = sse(url, body)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"], names
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == text_of(whole)
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    with client.messages.stream(**sdk(body)) as stream:  # the client's accumulator over our events
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason


def test_max_tokens(url, client):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 3, **GREEDY}
    m = client.messages.create(**sdk(body))
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    assert sse(url, body)[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_stop_sequences(url, client):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 24, **GREEDY}
    first = client.messages.create(**sdk(body))
    whole = text_of(first)
    assert first.stop_reason == "end_turn", whole  # the greedy reply ends at end-of-sequence
    m = client.messages.create(**sdk({**body, "stop_sequences": ["zqzqzq"]}))
    assert (m.stop_reason, m.stop_sequence, text_of(m)) == ("end_turn", None, whole)
    words = whole.split()
    assert len(words) >= 3, whole
    stop = words[len(words) // 2]
    m = client.messages.create(**sdk({**body, "stop_sequences": ["zqzqzq", stop]}))
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert text_of(m) == whole[:whole.find(stop)]
    delta = sse(url, {**body, "stop_sequences": ["zqzqzq", stop]})[-2][1]["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": stop}


# ---- tools --------------------------------------------------------------------------------------
def test_tool_use_round_trip(url, client):
    body = {"model": MODEL, "messages": WEATHER_ASK, "tools": TOOLS, "max_tokens": 60,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, **GREEDY}
    m = client.messages.create(**sdk(body))
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    events = sse(url, body)  # the input streamed as JSON fragments
    (start,) = [d["content_block"] for n, d in events if n == "content_block_start" and
                d["content_block"]["type"] == "tool_use"]
    assert start["name"] == "get_weather" and start["input"] == {}
    fragments = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert json.loads("".join(fragments)) == call.input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(**sdk(body)) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(call.name, call.input)]

    result = json.dumps({"temperature": 21, "sky": "clear"})
    history = WEATHER_ASK + [{"role": "assistant", "content": m.content},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                           "content": result}]}]
    answer = client.messages.create(model=MODEL, messages=history, tools=TOOLS, tool_choice={"type": "none"},
                                    max_tokens=20, extra_body=GREEDY)
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")
    arguments = json.dumps(call.input)
    chat = client_for(url).chat.completions.create(  # the same conversation through the OpenAI route
        model=MODEL, tools=OPENAI_TOOLS, tool_choice="none", max_tokens=20, temperature=0, messages=WEATHER_ASK + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": result}])
    assert text_of(answer) == chat.choices[0].message.content
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_named_tool_choice(client):
    tools = TOOLS + [{"name": "get_time", "input_schema": {"type": "object", "properties": {
        "timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"]}}]
    m = client.messages.create(model=MODEL, messages=WEATHER_ASK, tools=tools, max_tokens=60, extra_body=GREEDY,
                               tool_choice={"type": "tool", "name": "get_time"})
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "get_time" and m.stop_reason == "tool_use"
    jsonschema.validate(call.input, tools[1]["input_schema"])


# ---- count_tokens ----------------------------------------------------------------------------------
def test_count_tokens(client, hf_smollm2_tokenizer):
    system = "You answer in one word."
    n = client.messages.count_tokens(model=MODEL, system=system, messages=ASK).input_tokens
    openai_messages = [{"role": "system", "content": system}] + ASK
    text = hf_smollm2_tokenizer.apply_chat_template(openai_messages, tokenize=False, add_generation_prompt=True)
    assert n == len(hf_smollm2_tokenizer.encode(text, add_special_tokens=False))
    m = client.messages.create(model=MODEL, system=system, messages=ASK, max_tokens=2, extra_body=GREEDY)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n
    with_tools = client.messages.count_tokens(model=MODEL, messages=WEATHER_ASK, tools=TOOLS).input_tokens
    m = client.messages.create(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, max_tokens=2, extra_body=GREEDY)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == with_tools
    without = client.messages.count_tokens(model=MODEL, messages=WEATHER_ASK).input_tokens
    unused = client.messages.count_tokens(model=MODEL, messages=WEATHER_ASK, tools=TOOLS,
                                          tool_choice={"type": "none"}).input_tokens
    assert without == unused < with_tools  # tool_choice none: the tools are not rendered, as on the chat route


# ---- thinking -----------------------------------------------------------------------------------
THINKING_TEMPLATE = (  # SmolLM2's template, made to speak of <think> (enable_thinking opens the block)
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\n' }}{% endif %}{% endif %}")


def test_thinking_blocks(smollm2_model, tmp_path):
    path = tmp_path / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE)
    with running(create_app(ServerOptions(chat_template=str(path), kv_cache_tokens=512), model=smollm2_model)) as base:
        client, chat = anthropic_client(base), client_for(base)
        for enabled in (True, False):
            thinking = {"type": "enabled", "budget_tokens": 1024} if enabled else {"type": "disabled"}
            body = {"model": MODEL, "messages": ASK, "max_tokens": 6, "thinking": thinking, **GREEDY}
            m = client.messages.create(**sdk(body))
            reference = chat.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                                     extra_body={"chat_template_kwargs": {"enable_thinking": enabled}})
            message = reference.choices[0].message
            thought = "".join(b.thinking for b in m.content if b.type == "thinking")
            assert thought == (getattr(message, "reasoning_content", None) or "")
            assert text_of(m) == (message.content or "")
            if enabled:  # the prompt opened the block, and 6 tokens do not close it
                assert [b.type for b in m.content] == ["thinking"] and thought
            events = sse(base, body)
            deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
            assert "".join(d.get("thinking", "") for d in deltas) == thought
            assert "".join(d.get("text", "") for d in deltas) == text_of(m)


def test_thinking_ignored_without_a_reasoning_template(client, caplog, monkeypatch):
    monkeypatch.setattr("llaisys.server.anthropic._thinking_noted", set())
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, **GREEDY}
    plain = client.messages.create(**sdk(body))
    with caplog.at_level(logging.INFO, logger="llaisys.server.anthropic"):
        m = client.messages.create(**sdk({**body, "thinking": {"type": "enabled", "budget_tokens": 1024}}))
    assert m.content == plain.content and [b.type for b in m.content] == ["text"]
    assert any("thinking is ignored" in r.getMessage() for r in caplog.records)


def test_output_config_format_follows_the_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    m = client.messages.create(model=MODEL, messages=ASK, max_tokens=30, extra_body={**GREEDY, **fmt})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(m)), schema)


# ---- auth ---------------------------------------------------------------------------------------
def test_api_key_as_x_api_key_or_bearer(smollm2_model):
    with running(create_app(ServerOptions(api_key="sekrit", kv_cache_tokens=256), model=smollm2_model)) as base:
        for auth in ({"api_key": "sekrit"}, {"auth_token": "sekrit"}):
            m = anthropic_client(base, **auth).messages.create(model=MODEL, messages=ASK, max_tokens=1)
            assert m.usage.output_tokens == 1
        for auth in ({"api_key": "wrong"}, {"auth_token": "wrong"}):
            with pytest.raises(anthropic.AuthenticationError) as info:
                anthropic_client(base, **auth).messages.count_tokens(model=MODEL, messages=ASK)
            assert info.value.body["error"]["type"] == "authentication_error"
        r = post(f"{base}/v1/messages", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"  # before the body
        r = post(f"{base}/v1/completions", json_body={"prompt": "Hi", "max_tokens": 1}, headers={"x-api-key": "sekrit"})
        assert r.status_code == 200


# ---- errors -------------------------------------------------------------------------------------
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
ERRORS = [  # (body fields over a good request, status, what the message names)
    ({"max_tokens": None}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, 400, "has no vision encoder; it takes text only"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}]}]},
     400, "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400,
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].text"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, 400, "messages[0].role"),
    ({"messages": ASK + [{"role": "assistant", "content": "The"}]}, 400, "prefill"),
    ({"system": [{"type": "document"}]}, 400, "system[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools[0].type"),
    ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, 400, "tools[0].name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}],
      "tool_choice": {"type": "any"}}, 400, "tools"),
    ({"temperature": 1.5}, 400, "temperature"),
    ({"stop_sequences": ["ok", ""]}, 400, "stop_sequences"),
    ({"thinking": {"type": "sometimes"}}, 400, "thinking.type"),
    ({"output_config": {"format": {"type": "xml"}}}, 400, "output_config.format"),
    ({"max_tokens": 10**6}, 400, "maximum context length"),
    ({"model": "claude-sonnet-4-5"}, 404, "claude-sonnet-4-5"),
]


@pytest.mark.parametrize("fields, status, named", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_errors_in_anthropic_shape(url, fields, status, named):
    body = {k: v for k, v in {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}.items() if v is not None}
    r = post(f"{url}/v1/messages", json_body=body)
    assert r.status_code == status, r.body
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert named in error["error"]["message"]


def test_route_errors_and_typed_exceptions(url, client):
    for method, path, status, kind in [("POST", "/v1/messages/batches", 404, "not_found_error"),
                                       ("GET", "/v1/messages", 405, "invalid_request_error")]:
        r = http(method, f"{url}{path}", json_body={} if method == "POST" else None)
        assert r.status_code == status and r.json()["error"]["type"] == kind, r.body
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [IMAGE]}])
    assert info.value.body["error"]["type"] == "invalid_request_error" and "image" in info.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-haiku-4-5", max_tokens=4, messages=ASK)
    assert post(f"{url}/v1/chat/completions", json_body={"messages": "x"}).json()["error"]["param"] == "messages"


# ---- without a server ---------------------------------------------------------------------------
def test_error_types_by_status():
    assert error_body(503, "m") == {"type": "error", "error": {"type": "overloaded_error", "message": "m"}}
    kinds = {s: error_body(s, "")["error"]["type"] for s in (400, 401, 403, 404, 408, 413, 421, 429, 500, 502)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                     421: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 502: "api_error"}
    openai_shaped = json.dumps(shutting_down().body()).encode()
    assert json.loads(reshape_error(503, openai_shaped)) == error_body(503, shutting_down().message)


def test_error_middleware_reshapes_chunked_bodies_and_crashes():
    async def chunked_error(scope, receive, send):
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"42")]})
        await send({"type": "http.response.body", "body": b'{"error": {"message": "too', "more_body": True})
        await send({"type": "http.response.body", "body": b' big"}}'})

    async def crash(scope, receive, send):
        raise RuntimeError("boom")

    async def call(app, path):
        sent = []

        async def send(message):
            sent.append(message)

        try:
            await AnthropicErrors(app)({"type": "http", "path": path}, None, send)
        except RuntimeError as exc:
            sent.append(exc)
        return sent

    start, body = asyncio.run(call(chunked_error, "/v1/messages"))
    assert json.loads(body["body"]) == error_body(413, "too big") and error_body(413, "")["error"]["type"] == \
        "request_too_large"
    assert dict(start["headers"])[b"content-length"] == str(len(body["body"])).encode()
    start, body, exc = asyncio.run(call(crash, "/v1/messages/count_tokens"))
    assert start["status"] == 500 and isinstance(exc, RuntimeError)  # answered, then passed on to be logged
    assert json.loads(body["body"]) == error_body(500, "internal error: RuntimeError: boom")
    start, *rest = asyncio.run(call(chunked_error, "/v1/chat/completions"))  # other routes: untouched
    assert b"".join(m["body"] for m in rest) == b'{"error": {"message": "too big"}}'


def test_conversion_to_chat_messages():
    req = AnthropicMessagesRequest.model_validate({
        "max_tokens": 8, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                          "content": [{"type": "text", "text": "no such x"}]},
                                         {"type": "text", "text": "Try again"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "top_k": 5, "thinking": {"type": "disabled"}})
    chat = chat_request(req)
    assert [m.as_template_message() for m in chat.messages] == [
        {"role": "system", "content": "A\nB"}, {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "Error: no such x", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "Try again"}]
    assert chat.tool_mode == "function:f" and chat.parallel_tool_calls is False
    assert (chat.stops, chat.top_k, chat.max_tokens) == (("END",), 5, 8)
    assert chat.chat_template_kwargs == {"enable_thinking": False}


def test_matched_stop():
    assert matched_stop("The capital of France is", ["France", "capital"]) == "capital"
    assert matched_stop("abc", ["b", "bc"]) == "b"
    assert matched_stop("Paris.", ["zz"]) is None and matched_stop("Paris.", None) is None


def test_blocks_through_the_clients_accumulator():
    """Our block events, fed to the official client's stream accumulator, rebuild the whole
    message's content: thinking, text (blanks before it kept, blanks beside calls dropped) and
    tool_use with its input from JSON fragments."""
    blocks = ContentBlocks()
    pieces = [ReplyDeltas(reasoning="Weather"), ReplyDeltas(reasoning=" asked."), ReplyDeltas(content="\n"),
              ReplyDeltas(content="Sure."), ReplyDeltas(content="\n"),
              ReplyDeltas(calls=[{"index": 0, "id": "call_ab12", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": '}}]),
              ReplyDeltas(calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}]), ReplyDeltas(content="\n"),
              ReplyDeltas(calls=[{"index": 1, "id": "call_cd34", "type": "function",
                                  "function": {"name": "get_time", "arguments": "{}"}}])]
    events = [e for p in pieces for e in blocks.feed(p)] + blocks.close()
    # the client keeps a tool input's JSON text in json_bufs (2.x) or on the block (before)
    bufs: dict = {"json_bufs": {}} if "json_bufs" in inspect.signature(accumulate_event).parameters else {}
    snapshot = accumulate_event(event={"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}}, current_snapshot=None, **bufs)
    for event in events:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, **bufs)
    content = blocks.content()
    assert content == [{"type": "thinking", "thinking": "Weather asked.", "signature": ""},
                       {"type": "text", "text": "\nSure.\n"},
                       {"type": "tool_use", "id": "toolu_ab12", "name": "get_weather", "input": {"city": "Paris"}},
                       {"type": "tool_use", "id": "toolu_cd34", "name": "get_time", "input": {}}]
    assert [b.to_dict(exclude_none=True) for b in snapshot.content] == content


class _Service:
    model_name = MODEL

    async def in_worker(self, fn):
        return fn()


class _FailingRun:
    """A run whose engine request ends with the server shutting down after one output."""

    id = "msg_x"

    def usage(self):
        return {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                "prompt_tokens_details": {"cached_tokens": 0}}

    async def outputs(self):
        from llaisys.engine import RequestOutput

        yield 0, RequestOutput("msg_x-0", "Hello", [1], None, False, None, 5, 1, 0)
        raise shutting_down()


def test_error_mid_stream_is_an_error_event():
    req = AnthropicMessagesRequest.model_validate({"max_tokens": 8, "messages": ASK, "stream": True})
    fmt = ChatFormat(_Service())
    run = MessageRun(_Service(), req, fmt, Job(0, [1, 2], None), _FailingRun())

    async def collect():
        return [e async for e in run.events()]

    text = "".join(asyncio.run(collect()))
    names = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    last = json.loads(text.strip().splitlines()[-1].removeprefix("data: "))
    assert last == error_body(503, shutting_down().message) and last["error"]["type"] == "overloaded_error"
