"""Grammars a client controls, held to bounds: sizes and depths refused before compiling,
compiles tried in a separate process under a time budget (a crash or a stall there costs the
request a 400, never the server), killed when the client leaves or the server stops, kept in
a cache bounded by memory, and requests whose grammar the library gives up on ended with an
error instead of text that breaks it.

Outputs are checked with ``re.fullmatch``, ``jsonschema`` and membership, refusals by their
status, field and code; the crash and shutdown cases run against a separate process.
"""
from __future__ import annotations

import json
import logging
import re
import signal
import threading
import time

import jsonschema
import llguidance
import pytest

from llaisys.engine import LLMEngine
from llaisys.engine.grammar import Grammar, GrammarCompiler, GuidedConfig, clean_error, grammar_source
from llaisys.engine.grammar_limits import GrammarLimits, GrammarTooLarge
from llaisys.engine.grammar_sandbox import GrammarCrashed, GrammarSandbox, GrammarTimeout
from llaisys.generation import GenerationConfig
from llaisys.server import ServerOptions, create_app
from llaisys.server.protocol import Tool
from llaisys.server.tool_calls import HERMES, forced_call_grammar, parse_tool_calls
from test_server import client_for, get, post, raw_post, running, sse_events, wait_for
from test_server_hardening import serve_process

pytestmark = pytest.mark.timeout(180)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
ASK = [{"role": "user", "content": "Give me a JSON object."}]
SLOW_SCHEMA = {"type": "object", "patternProperties": {f"^p{i}[a-z]+$": {"type": "integer"} for i in range(1000)}}
CHAIN = 3000


def lark_chain(n: int) -> str:
    """A Lark grammar of ``n`` rules, each the next one: ``start: r0``, ``r0: r1``, ...."""
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "a"'


def defs_chain(n: int) -> dict:
    """A schema whose ``$ref``s chain through ``n`` definitions to a string."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 5}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_text(depth: int) -> str:
    """A schema as JSON text, nested ``depth`` objects deep (as a string it escapes the body's depth check)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def chat(url: str, body: dict) -> tuple[int, dict]:
    reply = post(f"{url}/v1/chat/completions", json_body={"model": MODEL, "messages": ASK, "max_tokens": 8, **body})
    return reply.status_code, reply.json()


@pytest.fixture(scope="module")
def server(smollm2_model):
    """A server with a short compile budget; yields (url, its ModelService)."""
    app = create_app(ServerOptions(kv_cache_tokens=2048, grammar_timeout_s=3.0), model=smollm2_model)
    with running(app) as base:
        yield base, app.state.service


@pytest.fixture(scope="module")
def patient_server(smollm2_model):
    """A server whose compile budget (10 s) is far from any wait a test measures; yields (url,
    its ModelService)."""
    app = create_app(ServerOptions(kv_cache_tokens=2048, grammar_timeout_s=10.0), model=smollm2_model)
    with running(app) as base:
        yield base, app.state.service


@pytest.fixture(scope="module")
def compiler(smollm2_model) -> GrammarCompiler:
    return GrammarCompiler(smollm2_model.tokenizer, smollm2_model.eos_token_ids, smollm2_model.config.vocab_size)


# ---- limits, checked before compiling ----------------------------------------------------------
def test_static_limits_name_what_is_too_large():
    small, deep = GrammarLimits(max_bytes=1000, max_choices=10), GrammarLimits(max_depth=64)
    cases = [(small, "choice", [str(i) for i in range(11)], "max_choices"),
             (small, "choice", ["x" * 600, "y" * 600], "max_bytes"),
             (small, "regex", "a" * 1001, "max_bytes"),
             (deep, "json_schema", nested_text(50_000), "max_depth"),
             (deep, "json_schema", defs_chain(100), "max_depth"),
             (deep, "lark", lark_chain(100), "max_depth"),
             (deep, "grammar", "root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1}" for i in range(80)) + '\nr80 ::= "a"',
              "max_depth"),
             (deep, "lark", "start: obj\nobj: %json " + json.dumps(defs_chain(100)), "max_depth")]
    for limits, kind, value, limit in cases:
        with pytest.raises(GrammarTooLarge) as info:
            limits.check(kind, value)
        assert info.value.limit == limit, (kind, str(info.value))
    limits = GrammarLimits(max_choices=10, max_depth=64)
    # just under the limits, and recursion (a tree of itself) that expands lazily, are fine
    tree = {"$defs": {"node": {"type": "object", "properties": {"children": {"type": "array",
                                                                             "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    for kind, value in (("choice", [str(i) for i in range(10)]), ("json_schema", defs_chain(40)),
                        ("json_schema", tree), ("lark", lark_chain(40)), ("lark", "start: a\na: \"x\" a | \"y\"")):
        limits.check(kind, value)


def test_compiler_arguments_are_checked(smollm2_model):
    tok = smollm2_model.tokenizer
    for kwargs, error, word in [({"vocab_size": 10**9}, ValueError, "vocab_size"),
                                ({"vocab_size": 10}, ValueError, "vocab_size"),
                                ({"vocab_size": "49152"}, TypeError, "vocab_size"),
                                ({"eos_token_ids": [-1]}, ValueError, "eos"),
                                ({"eos_token_ids": [2**64]}, ValueError, "eos"),
                                ({"eos_token_ids": ["2"]}, TypeError, "eos_token_ids")]:
        with pytest.raises(error, match=word):
            GrammarCompiler(tok, **kwargs)
    with pytest.raises(TypeError, match="GuidedConfig.grammar"):
        GuidedConfig(grammar="start: \"a\"")


def test_engine_refuses_a_grammar_of_another_vocabulary(smollm2_model, compiler):
    good = compiler.compile("regex", "[a-z]{1,4}")
    engine = LLMEngine(smollm2_model, kv_cache_tokens=256)
    for vocab in (good.vocab_size - 1, good.vocab_size + 64):
        other = Grammar(good.kind, good.source, good.prototype, vocab, good.digest)
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_request(None, "Hi", GuidedConfig(max_new_tokens=4, grammar=other))
    assert not engine.has_unfinished()


def test_compile_refuses_grammars_that_allow_nothing(compiler):
    """Each compiles in llguidance, but allows no output at all (or is not the regex written)."""
    for kind, value in (("json_schema", {"$ref": "#"}), ("json_schema", {"$defs": {"a": {"$ref": "#/$defs/a"}},
                                                                         "$ref": "#/$defs/a"}),
                        ("regex", r"[^\s\S]"), ("regex", "\\"), ("regex", "ab\\")):
        with pytest.raises(ValueError) as info:
            compiler.compile(kind, value)
        assert "no output" in str(info.value) or "backslash" in str(info.value), (value, info.value)


def test_library_errors_are_plain_sentences():
    panic = ("panic: thread '<unnamed>' panicked at parser/src/lark/parser.rs:543:30:\nbegin <= end\n"
             "stack backtrace:\n   0: std::backtrace::Backtrace::create\n" + "   1: frame\n" * 50)
    assert clean_error(panic) == "the grammar library failed on this grammar (an internal error)"
    assert len(clean_error("x" * 100_000)) < 1100


def test_choice_of_3000_strings_is_enforced(compiler):
    """As alternatives of one rule, 3,000 strings pass the parser's row limit (2,000) and it
    gives up after the first token; as one terminal every string is still reachable."""
    choices = [f"w{i}" for i in range(3000)]
    grammar = compiler.compile("choice", choices)
    matcher = grammar.matcher()
    tok = compiler.lltokenizer
    for token in tok.tokenize_str("w2999"):
        assert matcher.consume(token), matcher.failure
    assert matcher.accepting and matcher.failure is None
    rows = llguidance.LLMatcher(tok, grammar_source("lark", "start: " + " | ".join(json.dumps(c) for c in choices)),
                                log_level=0)
    assert not rows.consume_tokens(tok.tokenize_str("w2999"))  # the library's own limit, as a rule


def test_engine_ends_a_request_whose_grammar_fails_with_an_error(smollm2_model, compiler):
    """The library gives up after the first token of "a"{1000000} (its parser's item limit):
    the request ends "abort" with the reason, and ``generate`` raises rather than return
    text that does not follow the grammar; a request beside it is unaffected."""
    broken = compiler.compile("lark", 'start: "a"{1000000}')
    engine = LLMEngine(smollm2_model, kv_cache_tokens=256)
    engine.add_request("g", "Hi", GuidedConfig(max_new_tokens=8, grammar=broken))
    engine.add_request("p", "Hi", GenerationConfig(max_new_tokens=4, ignore_eos=True))
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
    assert last["g"].finish_reason == "abort" and "items" in last["g"].error, last["g"]
    assert last["p"].finish_reason == "length" and last["p"].error is None
    with pytest.raises(ValueError, match="prompt 1: its grammar could not be enforced"):
        engine.generate(["Hi", "Hello"], [GenerationConfig(max_new_tokens=2), GuidedConfig(max_new_tokens=8,
                                                                                           grammar=broken)])


# ---- the sandbox -------------------------------------------------------------------------------
def test_sandbox_survives_crashes_and_stalls(compiler):
    sandbox = GrammarSandbox(compiler.tokenizer_json, compiler.vocab_size, compiler.eos_token_ids, 256 << 20)
    try:
        assert sandbox.check(grammar_source("regex", "[0-9]+"), timeout=30) > 0
        with pytest.raises(GrammarCrashed, match="SIGSEGV|SIGABRT|signal"):  # the stack overflows there, not here
            sandbox.check(grammar_source("lark", lark_chain(60_000)), timeout=60)
        start = time.monotonic()
        with pytest.raises(GrammarTimeout):
            sandbox.check(grammar_source("json_schema", SLOW_SCHEMA), timeout=1.0)
        assert time.monotonic() - start < 5
        assert not sandbox.running
        with pytest.raises(ValueError, match="no output"):
            sandbox.check(grammar_source("json_schema", {"$ref": "#"}), timeout=30)
        assert sandbox.check(grammar_source("regex", "[0-9]+"), timeout=30) > 0 and sandbox.started == 3
    finally:
        sandbox.close()


# ---- over HTTP ---------------------------------------------------------------------------------
REFUSED = [  # (body, param, code)
    ({"guided_choice": [str(i) for i in range(5000)]}, "guided_choice", "grammar_too_large"),
    ({"guided_json": nested_text(50_000)}, "guided_json", "grammar_too_large"),
    ({"guided_grammar": lark_chain(CHAIN)}, "guided_grammar", "grammar_too_large"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": defs_chain(CHAIN)}}},
     "response_format.json_schema.schema", "grammar_too_large"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format.json_schema.schema", "invalid_grammar"),
    ({"guided_regex": r"[^\s\S]"}, "guided_regex", "invalid_grammar"),
    ({"guided_regex": "\\"}, "guided_regex", "invalid_grammar"),
    ({"structured_outputs": {"json": SLOW_SCHEMA}}, "structured_outputs.json", "grammar_timeout"),
]


@pytest.mark.parametrize("body, param, code", REFUSED, ids=[f"{p}:{c}" for _, p, c in REFUSED])
def test_bad_grammars_are_400_naming_the_field(server, body, param, code):
    url, _ = server
    status, reply = chat(url, body)
    err = reply["error"]
    assert status == 400 and err["param"] == param and err["code"] == code, reply
    assert param in err["message"] and "Traceback" not in err["message"] and len(err["message"]) < 1500
    assert get(f"{url}/health").status_code == 200


def test_a_crash_in_the_grammar_library_is_a_400():
    """Past the depth limit the library overflows its stack. With the limit raised, a chain of
    60,000 rules crashes the sandbox's process and this one answers 400; one of 10,000, which
    needs more stack than a thread gets by default (8 MiB), compiles there and here (a compile
    thread has 4x the sandbox's 64 MiB)."""
    with serve_process("--max-grammar-depth", "1000000", "--max-grammar-bytes", str(4 << 20)) as served:
        url = served.url
        status, reply = chat(url, {"guided_grammar": lark_chain(60_000)})
        assert status == 400 and reply["error"]["code"] == "invalid_grammar", reply
        assert "failed on this grammar" in reply["error"]["message"]
        status, reply = chat(url, {"guided_grammar": lark_chain(10_000), "max_tokens": 4})
        assert status == 200 and reply["choices"][0]["message"]["content"] == "a", reply
        assert served.proc.poll() is None and get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"guided_grammar": "start: " + " | ".join(f'"x{i}y"' for i in range(3000))}, "guided_grammar"),
    ({"structured_outputs": {"grammar": 'start: "a"{1000000}'}}, "structured_outputs.grammar"),
], ids=["3000-alternatives", "huge-repeat"])
def test_a_grammar_the_library_gives_up_on_is_an_error(server, body, param, caplog):
    """These compile, then the library gives up after the first token: whole, a 400; streamed,
    an error event; never text that breaks the grammar with finish_reason "stop". The log
    names the grammar by a digest."""
    url, _ = server
    with caplog.at_level(logging.WARNING):
        status, reply = chat(url, body)
    assert status == 400 and reply["error"]["code"] == "grammar_not_enforced" and reply["error"]["param"] == param
    assert "could not be kept" in reply["error"]["message"]
    events = sse_events(f"{url}/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 8,
                                                       "stream": True, **body})
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "grammar_not_enforced", events
    assert not any('"finish_reason":"stop"' in e for e in events)
    logged = [r.getMessage() for r in caplog.records]
    assert any("could not be enforced" in m for m in logged) and max(map(len, logged)) < 2000


def test_choice_of_3000_over_http(server):
    choices = [f"w{i}" for i in range(3000)]
    status, reply = chat(server[0], {"guided_choice": choices, "max_tokens": 10})
    choice = reply["choices"][0]
    assert status == 200 and choice["message"]["content"] in choices and choice["finish_reason"] == "stop"


def test_plain_requests_flow_while_grammars_compile(server):
    """Two compiles that run out their budget (3 s each, one after the other in the sandbox):
    meanwhile a plain chat completes and /health answers at once."""
    url, _ = server
    results = []

    def slow(i: int) -> None:
        schema = {**SLOW_SCHEMA, "title": f"slow {i}"}  # two grammars, not one compile shared
        results.append(chat(url, {"guided_json": schema}))

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    start = time.monotonic()
    reply = client_for(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=8, temperature=0)
    took = time.monotonic() - start
    health_start = time.monotonic()
    assert get(f"{url}/health").status_code == 200 and time.monotonic() - health_start < 0.5
    assert reply.choices[0].message.content is not None and took < 3.0, took
    for t in threads:
        t.join(30)
    assert all(status == 400 and r["error"]["code"] == "grammar_timeout" for status, r in results), results


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_a_client_that_leaves_stops_its_compile(patient_server, route):
    url, service = patient_server
    sandbox_of = service.grammars
    schema = {**SLOW_SCHEMA, "title": f"left {route}"}
    body = {"model": MODEL, "messages": ASK, "guided_json": schema} if route == "/v1/chat/completions" else \
        {"model": MODEL, "input": "Hi", "text": {"format": {"type": "json_schema", "name": "left", "schema": schema}}}
    sock = raw_post(url, route, body)
    wait_for(lambda: sandbox_of.compiling, timeout=10, what="the compile to start")
    wait_for(lambda: sandbox_of.sandbox().running, timeout=10, what="the sandbox to run")
    time.sleep(0.3)
    left = time.monotonic()
    sock.close()
    wait_for(lambda: not sandbox_of.sandbox().running, timeout=5, what="the sandbox's child to be killed")
    assert time.monotonic() - left < 5  # long before the 10 s budget would have ended it
    # the event loop hears the compile thread's end a moment after the child dies
    wait_for(lambda: not sandbox_of.compiling, timeout=5, what="the compile to be forgotten")


def test_cache_is_bounded_by_bytes(smollm2_model):
    """Each (a{1000}){1000}b{i} holds about 190 MB once its lexer is built: a 300 MiB cache
    keeps one, and a 64 MiB one refuses it."""
    options = ServerOptions(kv_cache_tokens=256, grammar_cache_bytes=300 << 20)
    app = create_app(options, model=smollm2_model)
    with running(app) as url:
        for i in (1, 2):
            status, reply = chat(url, {"guided_regex": f"(a{{1000}}){{1000}}b{{{i}}}", "max_tokens": 1})
            assert status == 200, reply
        cache = app.state.service.grammars.cache
        assert len(cache) == 1 and 100 << 20 < cache.nbytes <= 300 << 20
    with running(create_app(ServerOptions(kv_cache_tokens=256, grammar_cache_bytes=64 << 20),
                            model=smollm2_model)) as url:
        status, reply = chat(url, {"guided_regex": "(a{1000}){1000}b", "max_tokens": 1})
        assert status == 400 and reply["error"]["code"] == "grammar_too_large", reply
        assert "--grammar-cache-bytes" in reply["error"]["message"]


# ---- tools -------------------------------------------------------------------------------------
LOC = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
       "additionalProperties": False}
PYDANTIC_PARAMS = {"$defs": {"Loc": LOC}, "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}},
                   "required": ["loc"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "where"}}],
                         ids=["required", "named"])
def test_forced_call_with_local_defs(server, tool_choice):
    tools = [{"type": "function", "function": {"name": "where", "description": "A place",
                                               "parameters": PYDANTIC_PARAMS}}]
    r = client_for(server[0]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Where is the Eiffel tower?"}], tools=tools,
        tool_choice=tool_choice, max_tokens=40, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PYDANTIC_PARAMS)


def test_required_call_ends_after_one(server):
    """SmolLM2 writes a newline after a call, meaning to go on in prose: that must not commit it
    to a second call (parallel_tool_calls is on by default)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": WEATHER}}]
    r = client_for(server[0]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather like in Paris?"}], tools=tools,
        tool_choice="required", max_tokens=120, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, calls
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


def test_forced_call_over_many_tools_compiles_quickly(compiler):
    """One alternative per tool, told apart by its name: 300 tools compile in well under the
    compile budget (as one anyOf schema they took about half a minute)."""
    tools = [Tool.model_validate({"type": "function", "function": {"name": f"tool_{i}", "parameters": WEATHER}})
             for i in range(300)]
    start = time.monotonic()
    grammar = compiler.compile("lark", forced_call_grammar(tools, "required", True, HERMES))
    assert time.monotonic() - start < 5
    matcher = grammar.matcher()
    calls = ['<tool_call>\n{"name": "tool_299", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
             '<tool_call>\n{"name": "tool_0", "arguments": {"city": "Oslo", "unit": "fahrenheit"}}\n</tool_call>']
    for token in compiler.lltokenizer.tokenize_str("".join(calls)):  # back to back
        assert matcher.consume(token), matcher.failure
    assert matcher.accepting
    content, parsed = parse_tool_calls("".join(calls))
    assert content is None and [c.name for c in parsed] == ["tool_299", "tool_0"]


# ---- shutdown ----------------------------------------------------------------------------------
def test_sigterm_ends_a_compile_and_exits():
    with serve_process("--shutdown-timeout", "1", "--grammar-timeout", "120") as served:
        proc, base = served.proc, served.url
        replies: list = []

        def slow() -> None:
            replies.append(post(f"{base}/v1/chat/completions",
                                json_body={"model": MODEL, "messages": ASK, "guided_json": SLOW_SCHEMA}))

        waiter = threading.Thread(target=slow)
        waiter.start()
        time.sleep(3.0)  # the sandbox starts and takes the grammar
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, served.stderr()[-3000:]
        waiter.join(20)
        stderr = served.stderr()
    assert replies and replies[0].status_code == 503, replies
    assert "Traceback" not in stderr, stderr[-3000:]
