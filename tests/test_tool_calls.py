"""Tool calls through the official openai client against a live server on the bundled SmolLM2
(whose template knows no tools: the documented fallback), and the parsers on their own.

Forced calls (tool_choice "required" and a named function) are constrained by a grammar, so
their arguments parse and validate against the function's parameters; a stream's deltas
reassemble into the whole response's calls; a conversation goes on with tool results.
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from llaisys.server import ServerOptions, create_app
from llaisys.server.protocol import ChatMessage, Tool
from llaisys.server.tool_calls import (HERMES, LLAMA3_JSON, ToolCallParser, parse_tool_calls, template_messages,
                                       tool_format)
from test_server import client_for, running

pytestmark = pytest.mark.timeout(180)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2_model):
    with running(create_app(ServerOptions(), model=smollm2_model)) as base:
        yield client_for(base)


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def reassemble(stream) -> tuple[dict[int, dict], str | None, str]:
    """The calls (by index), finish reason and content of a streamed chat completion."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or ():
                if d.index not in calls:  # the first delta of a call carries its id and name
                    assert d.id and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and not d.function.name
                calls[d.index]["arguments"] += d.function.arguments or ""
    return calls, reason, content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_calls_whole_and_streamed(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=60, temperature=0,
                  parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1
    if isinstance(tool_choice, dict):
        assert choice.message.tool_calls[0].function.name == "get_weather"
    calls, reason, content = reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert reason == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_required_sampled_parallel_calls_validate(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=90,
                                       temperature=1.0, seed=3, n=2)
    for choice in r.choices:
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message.tool_calls)


def test_conversation_with_tool_results(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=60, temperature=0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=24, temperature=0)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:
        for c in choice.message.tool_calls:
            json.loads(c.function.arguments)
    else:
        assert choice.message.content
    none = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason != "tool_calls"


ERRORS = [  # (fields, param)
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]


@pytest.mark.parametrize("fields, param", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_tool_errors(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=fields)
    assert info.value.param == param, info.value.body


# ---- without a server --------------------------------------------------------------------------
HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"arguments": {"timezone": "CET"}, "name": "get_time"}\n'
               '</tool_call>')


def test_hermes_parser_streamed_equals_whole():
    content, calls = parse_tool_calls(HERMES_TEXT)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]
    parser, streamed, args = ToolCallParser(), "", {}
    for ch in HERMES_TEXT:  # one character at a time: the worst split
        for d in (parser.feed(ch),):
            streamed += d.content
            for c in d.calls:
                args[c["index"]] = args.get(c["index"], "") + c["function"]["arguments"]
    end = parser.finish()
    streamed += end.content
    for c in end.calls:
        args[c["index"]] = args.get(c["index"], "") + c["function"]["arguments"]
    assert streamed == content and [args[i] for i in sorted(args)] == [c.arguments for c in calls]


def test_parsers_leave_other_text_alone():
    assert parse_tool_calls("no calls <tool_ here") == ("no calls <tool_ here", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>")[1] == []
    content, calls = parse_tool_calls('<|python_tag|>{"name": "get_time", "parameters": {"timezone": "UTC"}}',
                                      LLAMA3_JSON)
    assert content is None and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"timezone": "UTC"}
    assert parse_tool_calls("Hello there", LLAMA3_JSON) == ("Hello there", [])


def test_formats_and_fallback_rendering(smollm2_model):
    assert tool_format(smollm2_model.tokenizer.chat_template) == HERMES
    assert tool_format("{% for t in tools %}<|python_tag|>{% endfor %}") == LLAMA3_JSON
    tools = [Tool.model_validate(t) for t in TOOLS]
    history = [ChatMessage.model_validate(m) for m in ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]]
    out = template_messages(history, tools, knows_tools=False)
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"] and '"get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    kept = template_messages(history, tools, knows_tools=True)
    assert kept[1]["tool_calls"][0]["function"]["arguments"] == {"timezone": "UTC"} and kept[2]["role"] == "tool"


def test_reasoning_parser_streamed_equals_whole():
    from llaisys.server.reasoning import ReasoningParser, ReplyReader
    from llaisys.server.tool_calls import ToolCallParser as Tools

    text = "<think>\nThe user wants weather.\n</think>\n\n" + HERMES_TEXT
    reasoning, content, calls = ReplyReader(ReasoningParser(), Tools()).whole(text)
    assert reasoning == "\nThe user wants weather.\n" and content.strip() == "Let me check." and len(calls) == 2
    reader, streamed = ReplyReader(ReasoningParser(), Tools()), ["", ""]
    for d in [*(reader.feed(ch) for ch in text), reader.finish()]:
        streamed[0] += d.reasoning
        streamed[1] += d.content
    assert streamed == [reasoning, content]
    assert ReplyReader(ReasoningParser(started=True), None).whole("cut short") == ("cut short", "", [])
    assert ReplyReader(ReasoningParser(), None).whole("no thinking") == (None, "no thinking", [])


def test_models_lists_capabilities(client):
    (entry,) = client.models.list().data
    caps = entry.model_extra["capabilities"]
    assert caps["structured_outputs"] is True and caps["chat"] is True and caps["reasoning"] is False
    assert caps["tool_calls"] == {"format": "hermes", "rendering": "fallback"}
    assert caps["embeddings"] is True and caps["responses"] is True


# ---- the Responses API (stateless) ---------------------------------------------------------------
RESPONSE_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                   "parameters": t["function"]["parameters"]} for t in TOOLS]


def test_responses_text_whole_and_streamed(client):
    kwargs = dict(model=MODEL, input="What is the capital of France?", instructions="Answer briefly.",
                  max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.output_text
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens <= 12
    assert whole.status == ("incomplete" if whole.usage.output_tokens == 12 else "completed")
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == f"response.{whole.status}" and [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_responses_forced_call_and_its_result(client):
    kwargs = dict(model=MODEL, input=ASK[0]["content"], tools=RESPONSE_TOOLS, max_output_tokens=60, temperature=0,
                  tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    whole = client.responses.create(**kwargs)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(client.responses.create(**kwargs, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done[0].arguments == call.arguments
    follow = client.responses.create(model=MODEL, tools=RESPONSE_TOOLS, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees, clear"}])
    assert follow.output and follow.usage.input_tokens > whole.usage.input_tokens


def test_responses_json_schema_and_errors(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Name a city as JSON.", max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    for fields, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                          ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, **{"input": "hi", **fields})
        assert info.value.param == param, info.value.body


def test_parallel_tool_calls_false_keeps_the_first():
    from llaisys.server.reasoning import ReplyReader

    _, _, calls = ReplyReader(None, ToolCallParser(), max_calls=1).whole(HERMES_TEXT)
    assert [c.name for c in calls] == ["get_weather"]
    reader = ReplyReader(None, ToolCallParser(), max_calls=1)
    deltas = [reader.read(ch, i == len(HERMES_TEXT) - 1) for i, ch in enumerate(HERMES_TEXT)]
    assert {c["index"] for d in deltas for c in d.calls} == {0}


def test_responses_events_of_reasoning_text_and_calls():
    """A reply with a think block, text and a tool call, streamed as Responses events (no model:
    the run's outputs are given)."""
    import asyncio
    from types import SimpleNamespace

    from llaisys.server.completions import ChatFormat, Job
    from llaisys.server.responses import ResponseRun, ResponsesRequest, chat_request

    text = "<think>Paris is in France.</think>\nChecking." + HERMES_TEXT[len("Let me check."):]
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]

    class FakeRun:
        id = "resp_test"

        async def outputs(self):
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                yield 0, SimpleNamespace(text_delta=piece, finished=last, finish_reason="stop" if last else None)

        def usage(self):
            return {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12,
                    "prompt_tokens_details": {"cached_tokens": 0}}

    service = SimpleNamespace(model_name=MODEL, prompt_opens_think=lambda ids: False)
    req = ResponsesRequest.model_validate({"input": "hi", "tools": RESPONSE_TOOLS, "stream": True})
    fmt = ChatFormat(service, HERMES, reasoning=True)
    job = Job(0, [1, 2, 3], None)

    async def collect(run):
        return [json.loads(e.split("data: ", 1)[1]) async for e in run.events()]

    events = asyncio.run(collect(ResponseRun(service, req, chat_request(req), fmt, job, FakeRun())))
    kinds = [e["type"] for e in events]
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    assert kinds[-1] == "response.completed" and kinds.count("response.output_item.done") == 4
    final = events[-1]["response"]["output"]
    assert final[0]["content"][0]["text"] == "Paris is in France."
    assert final[1]["content"][0]["text"] == "Checking.\n"
    assert [(i["name"], json.loads(i["arguments"])) for i in final[2:]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]
    whole = asyncio.run(ResponseRun(service, req, chat_request(req), fmt, job, FakeRun()).whole())
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert [i["arguments"] for i in whole["output"][2:]] == [i["arguments"] for i in final[2:]]
