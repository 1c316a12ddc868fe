"""The reasoning budget (llama-server's --reasoning-budget): after N thinking tokens the end of
the think block is forced, and the answer follows as usual. The engine's token bookkeeping
directly, then the served SmolLM2 with a template that speaks of <think>, through the official
openai and anthropic clients.
"""
from __future__ import annotations

import pytest

from llaisys.engine import LLMEngine
from llaisys.engine.thinking import ThinkingBudget
from llaisys.generation import GenerationConfig
from llaisys.generation.results import SampledToken
from llaisys.server import ServerOptions, create_app
from llaisys.server.reasoning import think_end
from test_anthropic_api import anthropic_client
from test_server import client_for, post, running

pytestmark = pytest.mark.timeout(180)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CITY = [{"role": "user", "content": "Describe Paris."}]
THINKING_TEMPLATE = (  # SmolLM2's template, made to speak of <think> (enable_thinking opens the block)
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\n' }}{% endif %}{% endif %}")
OPENED = {"chat_template_kwargs": {"enable_thinking": True}}  # the prompt opens the think block


# ---- the engine's bookkeeping -------------------------------------------------------------------
def budget(n: int, open_ids=(), end=(90, 91), close=None) -> ThinkingBudget:
    config = GenerationConfig(reasoning_budget=n, reasoning_open=tuple(open_ids), reasoning_end=end)
    return ThinkingBudget(config, close)


def picks(b: ThinkingBudget, ids: list[int]) -> list[int]:
    return [b.pick(SampledToken(t)).token_id for t in ids]


def test_forced_after_the_budget():
    assert picks(budget(3), [1, 2, 3, 4, 5, 6, 7]) == [1, 2, 3, 90, 91, 6, 7]
    assert picks(budget(0), [1, 2, 3]) == [90, 91, 3]
    assert picks(budget(2, open_ids=(7, 8)), [7, 8, 1, 2, 3, 4, 5]) == [7, 8, 1, 2, 90, 91, 5]
    assert picks(budget(0, open_ids=(7,)), [7, 1, 2, 3]) == [7, 90, 91, 3]


def test_not_forced_when_closed_in_time_or_not_thinking():
    assert picks(budget(3, close=(90,)), [1, 90, 4, 5, 6]) == [1, 90, 4, 5, 6]
    assert picks(budget(0, open_ids=(7,)), [1, 2, 3]) == [1, 2, 3]  # the reply does not open a block


def test_logprobs_of_a_forced_token():
    b = budget(0)
    forced = b.pick(SampledToken(5, -1.5, [(5, -1.5)]))
    assert forced == SampledToken(90, 0.0, [(5, -1.5)])
    assert budget(0).pick(SampledToken(5)).logprob is None


def test_config_checks():
    with pytest.raises(ValueError, match="reasoning_budget"):
        GenerationConfig(reasoning_budget=-1, reasoning_end=(1,))
    with pytest.raises(TypeError, match="reasoning_budget"):
        GenerationConfig(reasoning_budget=True, reasoning_end=(1,))
    with pytest.raises(ValueError, match="needs reasoning_end"):
        GenerationConfig(reasoning_budget=2)
    with pytest.raises(ValueError, match="reasoning_end"):
        GenerationConfig(reasoning_budget=2, reasoning_end=(-3,))


def test_think_end_follows_the_template():
    qwen3 = "{{- '<think>\\n\\n</think>\\n\\n' }} {% set c = content.split('</think>')[-1] %}"
    assert think_end(qwen3) == "</think>\n\n"
    assert think_end(THINKING_TEMPLATE) == "</think>\n"


@pytest.mark.parametrize("speculative", [0, 4])
def test_engine_forces_the_end_and_continues_greedily(smollm2_model, speculative):
    tok = smollm2_model.tokenizer
    prompt = tok.encode("<|im_start|>user\nDescribe Paris.<|im_end|>\n<|im_start|>assistant\n<think>\n")
    end = tuple(tok.encode("</think>\n", add_special_tokens=False))
    engine = LLMEngine(smollm2_model, kv_cache_tokens=1024)
    plain = GenerationConfig(max_new_tokens=16, ignore_eos=True, speculative_tokens=speculative)
    free = engine.generate([prompt], plain)[0].token_ids
    n = 5
    budgeted = engine.generate([prompt], plain.replace(reasoning_budget=n, reasoning_end=end))[0].token_ids
    assert budgeted[:n] == free[:n]
    assert tuple(budgeted[n:n + len(end)]) == end
    rest = engine.generate([prompt + budgeted[:n + len(end)]], plain.replace(max_new_tokens=16 - n - len(end)))
    assert budgeted[n + len(end):] == rest[0].token_ids  # the answer is sampled as usual after the end


# ---- the server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def template(smollm2_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("reasoning") / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def url(smollm2_model, template):
    with running(create_app(ServerOptions(chat_template=template, reasoning_budget=6), model=smollm2_model)) as base:
        yield base


def ask(client, budget: int | None, *, logprobs: bool = True, stream: bool = False, max_tokens: int = 20, **extra):
    body = {**OPENED, **extra}
    if budget is not None:
        body["reasoning_budget"] = budget
    return client.chat.completions.create(model=MODEL, messages=CITY, max_tokens=max_tokens, temperature=0,
                                          logprobs=logprobs, stream=stream, extra_body=body)


def tokens(response) -> list[str]:
    return [t.token for t in response.choices[0].logprobs.content]


@pytest.mark.parametrize("n", [0, 3])
def test_budget_forces_the_end_of_thinking(url, smollm2_model, n):
    client = client_for(url)
    free = tokens(ask(client, 10_000))  # a budget it never reaches: the plain reply
    r = ask(client, n)
    got = tokens(r)
    end = [smollm2_model.tokenizer.decode([t], skip_special_tokens=False)
           for t in smollm2_model.tokenizer.encode("</think>\n", add_special_tokens=False)]
    assert got[:n] == free[:n] and got[n:n + len(end)] == end
    message = r.choices[0].message
    assert (message.reasoning_content or "") == "".join(got[:n])
    assert message.content == "".join(got[n + len(end):]).lstrip("\n") and message.content  # newlines after </think> dropped


def test_no_budget_leaves_the_reply_alone(smollm2_model, template):
    with running(create_app(ServerOptions(chat_template=template), model=smollm2_model)) as base:
        client = client_for(base)
        plain = ask(client, None, max_tokens=12)
        unreached = ask(client, 10_000, max_tokens=12)
    assert tokens(plain) == tokens(unreached)
    assert not plain.choices[0].message.content  # 12 tokens of thinking, never closed
    assert plain.choices[0].message.reasoning_content == "".join(tokens(plain))


def test_request_overrides_the_server(url):
    client = client_for(url)
    default, own = ask(client, None), ask(client, 2)
    assert len(default.choices[0].message.reasoning_content) > len(own.choices[0].message.reasoning_content)
    assert default.choices[0].message.reasoning_content == "".join(tokens(default)[:6])  # the server's 6
    assert own.choices[0].message.reasoning_content == "".join(tokens(own)[:2])


def test_streaming_gives_the_whole_text(url):
    client = client_for(url)
    whole = ask(client, 3, logprobs=False).choices[0].message
    reasoning = content = ""
    for chunk in ask(client, 3, logprobs=False, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)


def test_anthropic_budget_tokens(url):
    client = anthropic_client(url)
    reference = ask(client_for(url), 4, logprobs=False).choices[0].message
    m = client.messages.create(model=MODEL, messages=CITY, max_tokens=20, extra_body={"temperature": 0},
                               thinking={"type": "enabled", "budget_tokens": 4})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == reference.reasoning_content
    assert m.content[1].text == reference.content


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"reasoning_budget": -1}, "reasoning_budget"),
    ("/v1/chat/completions", {"reasoning_budget": "many"}, "reasoning_budget"),
    ("/v1/chat/completions", {"reasoning_budget": 1.5}, "reasoning_budget"),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": -4}}, "budget_tokens"),
])
def test_bad_budgets_are_400s(url, path, body, field):
    r = post(f"{url}{path}", json_body={"model": MODEL, "messages": CITY, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert field in r.text


def test_server_option_checked():
    with pytest.raises(ValueError, match="reasoning_budget"):
        ServerOptions(reasoning_budget=-2)


def test_cli_option():
    import argparse

    from llaisys.cli.serve import reasoning_budget

    assert reasoning_budget("-1") is None and reasoning_budget("0") == 0 and reasoning_budget("512") == 512
    with pytest.raises(argparse.ArgumentTypeError):
        reasoning_budget("-2")
