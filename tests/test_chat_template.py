"""Chat templates are untrusted code: rendering in the sandbox within limits, errors that name
the template's origin, message checks and text parts. References: transformers' rendering of
the bundled SmolLM2 template, and Jinja2's own sandbox for loop semantics."""
from __future__ import annotations

import time

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llaisys.models import chat_template, template_sandbox
from llaisys.models.chat_template import ChatTemplate, render_chat

ORIGIN = "/models/x/tokenizer_config.json"
USER = [{"role": "user", "content": "hi"}]


def render(source: str, messages: list[dict] = USER, **variables) -> str:
    return render_chat(ChatTemplate(source, ORIGIN), messages, **variables)


# ---- the bundled template, as transformers renders it ----------------------------------------
@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from llaisys.models import Tokenizer
    from llaisys.models.loaders.gguf import read_gguf

    return Tokenizer.from_gguf(read_gguf(smollm2_path).meta, str(smollm2_path))


def test_text_parts_render_as_their_joined_text(smollm2_tokenizer, hf_smollm2_tokenizer):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi\nthere"}]
    want = hf_smollm2_tokenizer.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    assert smollm2_tokenizer.apply_chat_template(parts) == want
    assert smollm2_tokenizer.apply_chat_template(joined) == want
    assert parts[1]["content"][0] == {"type": "text", "text": "Hi"}  # the caller's messages are left alone


# ---- errors name the template's origin ---------------------------------------------------------
@pytest.mark.parametrize("source,kind", [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ 2.0 ** 5000 }}", "OverflowError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ messages[0].content.index('zz') }}", "ValueError"),
    ("{{ raise_exception('only user messages') }}", "only user messages"),
])
def test_errors_inside_a_template_name_its_origin(source: str, kind: str):
    with pytest.raises(ValueError, match=f"chat template from {ORIGIN} failed: .*{kind}"):
        render(source)


def test_syntax_error_names_the_origin_and_line():
    with pytest.raises(ValueError, match=f"chat template from {ORIGIN} has a syntax error at line 2"):
        render("ok\n{% for %}")
    gguf = ChatTemplate("{% if %}", "GGUF metadata tokenizer.chat_template")
    with pytest.raises(ValueError, match="GGUF metadata tokenizer.chat_template has a syntax error"):
        render_chat(gguf, USER)


def test_assistant_without_content_reaches_the_template_and_fails_clearly():
    concat = "{% for m in messages %}{{ '<' + m.role + '>' + m.content }}{% endfor %}"
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}]
    assert render("{% for m in messages %}{{ m.content is none }}{% endfor %}", msgs) == "FalseTrue"
    with pytest.raises(ValueError, match=f"{ORIGIN} failed: TypeError"):
        render(concat, msgs)


# ---- message checks ------------------------------------------------------------------------------
@pytest.mark.parametrize("messages,err,needle", [
    ("hi", TypeError, "list of dicts"),
    (["hi"], TypeError, r"messages\[0\] must be a dict"),
    ([{"content": "x"}], ValueError, r"messages\[0\] has no 'role'"),
    ([{"role": 1, "content": "x"}], TypeError, r"messages\[0\]\['role'\] must be a str, got int"),
    ([{"role": "user", "content": None}], TypeError, r"\(user\) must be a str or a list of text parts, got NoneType"),
    ([{"role": "user", "content": 5}], TypeError, "got int"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ValueError,
     r"messages\[0\]\['content'\]\[0\] is a 'image_url' part; expected a text part"),
    ([{"role": "user", "content": ["plain"]}], ValueError, r"\[0\] is 'plain'; expected a text part"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], ValueError, "expected a text part"),
])
def test_bad_messages_are_clear_errors(messages, err: type, needle: str):
    with pytest.raises(err, match=needle):
        render("{{ messages }}", messages)


# ---- limits --------------------------------------------------------------------------------------
def test_nested_loops_stop_at_the_iteration_limit():
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=f"{ORIGIN} stopped: more than {template_sandbox.MAX_LOOP_ITERATIONS} loop"):
        render("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}")
    with pytest.raises(ValueError, match="loop iterations"):
        render("{% set r = range(100000) %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}")
    assert time.perf_counter() - t0 < 30


def test_calls_without_loops_stop_at_the_deadline(monkeypatch):
    monkeypatch.setattr(template_sandbox, "RENDER_TIMEOUT_S", 0.3)
    exponential = ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                   "{{ f(60) }}")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="stopped: rendering took longer than 0.3 s"):
        render(exponential)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("source,needle", [
    ("{{ 'x' * 10 ** 9 }}", "repeating 1 items 1000000000 times"),
    ("{{ [0] * 10 ** 9 }}", "repeating 1 items"),
    ("{{ 10 ** 100000 }}", "a power of about 400000 bits"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "joining with ~ would make 8388608 characters"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "joining"),
    ("{% set big = 'y' * 4000000 %}{% set copy %}{% for i in range(10) %}{{ big }}{% endfor %}{% endset %}",
     "the output is over the limit"),
])
def test_big_values_and_output_are_refused(source: str, needle: str):
    with pytest.raises(ValueError, match=f"{ORIGIN} stopped: {needle}"):
        render(source)


def test_limits_are_per_rendering(monkeypatch):
    monkeypatch.setattr(template_sandbox, "MAX_LOOP_ITERATIONS", 50)
    loop = "{% for i in range(40) %}.{% endfor %}"
    for _ in range(3):  # 40 iterations each time, under the limit of 50 every time
        assert render(loop) == "." * 40
    with pytest.raises(ValueError, match="more than 50 loop iterations"):
        render(loop + loop)


# ---- what the guards must not change -------------------------------------------------------------
SEMANTICS = [
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }} {{ loop.first }} {{ loop.last }} "
    "{{ loop.revindex }} {{ loop.cycle('a', 'b') }} {{ loop.previtem }};{% endfor %}",
    "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }}{% endfor %}",
    "{% for m in messages if m.role == 'user' %}{{ m.content }}{% else %}none{% endfor %}",
    "{% for x in [] %}{{ x }}{% else %}empty{% endfor %}",
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
    "{% for m in messages[::-1] %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}",
    "{% for x in [[1, [2, 3]], 4] recursive %}{% if x is iterable %}({{ loop(x) }}){% else %}{{ x }}{% endif %}"
    "{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content|length %}{% endfor %}"
    "{{ ns.n }} {{ 'ab' ~ 'cd' }} {{ [1] + [2] }} {{ 3 * 'ab' }} {{ 2 ** 10 }}",
    "{% macro tag(r) %}<{{ r }}>{% endmacro %}{% for m in messages %}{{ tag(m.role) }}{{ m.content|trim }}"
    "{% endfor %}{% if add_generation_prompt %}{{ tag('assistant') }}{% endif %}",
]


@pytest.mark.parametrize("source", SEMANTICS)
def test_guards_keep_jinja_semantics(source: str):
    msgs = [{"role": "system", "content": "s "}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    want = env.from_string(source).render(messages=msgs, add_generation_prompt=True)
    assert render(source, msgs) == want


# ---- loaded templates know where they came from -------------------------------------------------
def test_a_loaded_gguf_template_names_its_file_in_errors(smollm2_tokenizer, smollm2_path):
    assert str(smollm2_path) in smollm2_tokenizer.chat_template.origin
    broken = ChatTemplate("{{ messages[0].content / 0 }}", smollm2_tokenizer.chat_template.origin)
    with pytest.raises(ValueError, match=r"chat template from .*SmolLM2.*tokenizer\.chat_template\) failed: TypeError"):
        render_chat(broken, USER)


def test_a_folder_template_file_names_itself_in_errors(tmp_path):
    from llaisys.models.tokenizer import _folder_chat_template

    (tmp_path / "chat_template.jinja").write_text("{{ 1 // 0 }}")
    template = _folder_chat_template(tmp_path, {})
    with pytest.raises(ValueError, match=r"chat template from .*chat_template\.jinja failed: ZeroDivisionError"):
        render_chat(template, USER)
    (tmp_path / "chat_template.jinja").unlink()
    template = _folder_chat_template(tmp_path, {"chat_template": "{{ none_such() }}"})
    with pytest.raises(ValueError, match=r"chat template from .*tokenizer_config\.json failed"):
        render_chat(template, USER)
