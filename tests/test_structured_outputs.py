"""Structured outputs (a grammar per request, llguidance) through the official openai client
against a live server on the bundled SmolLM2, and the engine's grammar hook directly.

Outputs must validate (jsonschema), match (re.fullmatch) or be one of the choices; streamed
and whole greedy answers are equal; unconstrained requests batched beside constrained ones
keep the tokens they get alone; a preempted constrained request still ends valid.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from llaisys.engine import LLMEngine
from llaisys.engine.grammar import GrammarCompiler, GuidedConfig
from llaisys.generation import GenerationConfig
from llaisys.server import ServerOptions, create_app
from test_server import client_for, running

pytestmark = pytest.mark.timeout(180)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "color"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["old", "big", "sunny"]}, "minItems": 1,
             "maxItems": 2},
    "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                 "required": ["lat", "lon"], "additionalProperties": False}},
    "required": ["city", "tags", "location"], "additionalProperties": False}
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the bundled model's served name
ASK = [{"role": "user", "content": "Give me a JSON object describing a person."}]
CITY = [{"role": "user", "content": "Describe Paris as JSON."}]


@pytest.fixture(scope="module")
def url(smollm2_model):
    with running(create_app(ServerOptions(), model=smollm2_model)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return client_for(url)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def streamed_text(stream) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("schema, messages", [(PERSON, ASK), (NESTED, CITY)], ids=["flat-enum", "nested"])
def test_json_schema_whole_and_streamed(client, schema, messages):
    kwargs = dict(model=MODEL, messages=messages, max_tokens=80, temperature=0, response_format=schema_format(schema))
    whole = client.chat.completions.create(**kwargs)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert whole.choices[0].finish_reason == "stop"
    streamed, reason = streamed_text(client.chat.completions.create(**kwargs, stream=True))
    assert streamed == text and reason == "stop"


def test_json_schema_sampled_n(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=1.0, seed=5, n=3,
                                       response_format=schema_format(PERSON))
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut at max_tokens: a prefix of an object
        assert r.choices[0].finish_reason == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


def test_completions_regex_and_choice(client):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    r = client.completions.create(model=MODEL, prompt="A code:", max_tokens=12, temperature=0.8, seed=1, n=2,
                                  extra_body={"guided_regex": pattern})
    for choice in r.choices:
        assert re.fullmatch(pattern, choice.text), choice.text
    choices = ["yes", "no", "maybe"]
    r = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=5, temperature=1.0, seed=2, n=3,
                                  extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices for c in r.choices)


def test_chat_guided_grammar_streamed(client):
    grammar = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    text, reason = streamed_text(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=12, temperature=0,
        stream=True, extra_body={"structured_outputs": {"grammar": grammar}}))
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", text) and reason == "stop"


def test_batched_unconstrained_tokens_unchanged(client):
    plain = dict(model=MODEL, messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=16,
                 temperature=0)
    alone = client.chat.completions.create(**plain).choices[0].message.content
    constrained = dict(model=MODEL, messages=ASK, max_tokens=60, temperature=0, response_format=schema_format(PERSON))
    with ThreadPoolExecutor(6) as pool:
        guided = [pool.submit(client.chat.completions.create, **constrained) for _ in range(3)]
        free = [pool.submit(client.chat.completions.create, **plain) for _ in range(3)]
        assert all(f.result().choices[0].message.content == alone for f in free)
        for f in guided:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), PERSON)


BAD = [  # (extra body, param)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[p for _, p in BAD])
def test_bad_constraints_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    assert info.value.param == param, info.value.body
    assert param.split(".")[0] in info.value.body["message"]


def test_engine_constrained_survives_preemption(smollm2_model):
    """A KV pool too small for all at once preempts and recomputes; each output still validates,
    and the unconstrained request's tokens match its run alone."""
    model = smollm2_model
    tok = model.tokenizer
    grammar = GrammarCompiler(tok, model.eos_token_ids).compile("json_schema", PERSON)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Person number {i} as JSON."}]),
                          add_special_tokens=False) for i in range(4)]  # distinct: no shared prefix blocks
    plain = GenerationConfig(max_new_tokens=24)
    alone = LLMEngine(model).generate([prompts[3]], plain)[0].token_ids
    need = max(map(len, prompts)) + 40
    engine = LLMEngine(model, kv_cache_tokens=need + 16, block_size=8)  # one at full length: preempts
    configs = [GuidedConfig(max_new_tokens=40, grammar=grammar, temperature=0.7, seed=i) for i in range(3)]
    results = engine.generate(prompts, configs + [plain])
    assert engine.scheduler.num_preemptions > 0
    for r in results[:3]:
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), PERSON)
        else:  # cut at max_new_tokens: still a prefix the grammar allows
            assert r.text.startswith('{"name": "')
    assert results[3].token_ids == alone


# ---- reasoning: <think> blocks as reasoning_content ---------------------------------------------
THINKING_TEMPLATE = (  # SmolLM2's template, made to speak of <think> (enable_thinking opens the block)
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\n' }}{% endif %}{% endif %}")


def test_reasoning_content_whole_and_streamed(smollm2_model, tmp_path):
    path = tmp_path / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE)
    with running(create_app(ServerOptions(chat_template=str(path)), model=smollm2_model)) as base:
        client = client_for(base)
        cases = [  # (chat_template_kwargs, the regex the reply follows)
            (None, r"<think>[a-z ]{1,12}</think>\n[A-Z][a-z]{1,10}"),
            ({"enable_thinking": True}, r"[a-z ]{1,12}</think>\n[A-Z][a-z]{1,10}"),  # the prompt opened it
        ]
        for kwargs, pattern in cases:
            body = dict(model=MODEL, messages=CITY, max_tokens=30, temperature=0,
                        extra_body={"guided_regex": pattern, "chat_template_kwargs": kwargs})
            message = client.chat.completions.create(**body).choices[0].message
            assert re.fullmatch(r"[a-z ]{1,12}", message.reasoning_content), message
            assert re.fullmatch(r"[A-Z][a-z]{1,10}", message.content), message
            reasoning, content = "", ""
            for chunk in client.chat.completions.create(**body, stream=True):
                for choice in chunk.choices:
                    reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                    content += choice.delta.content or ""
            assert (reasoning, content) == (message.reasoning_content, message.content)
