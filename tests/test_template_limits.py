"""A hostile chat template (it comes with a downloaded model file) costs at most about a second
and a bounded amount of memory: what a filter, method, operator or slice would build is refused
from its arguments, before it exists; what the template does item by item runs against the
deadline; nesting too deep to compile is a clean error. Each case is a ValueError naming the
template's origin. And the guards change nothing a real template renders: filters, methods,
slices and operators give what Jinja's own sandbox gives."""
from __future__ import annotations

import time
import tracemalloc

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llaisys.models import template_sandbox
from llaisys.models.chat_template import ChatTemplate, compile_template, render_chat

ORIGIN = "/models/x/tokenizer_config.json"
USER = [{"role": "user", "content": "hi"}]
BIG = "{% set big = 'x' * 8000000 %}"  # a value at the size limit
MIB = 1 << 20


def render(source: str, messages: list[dict] = USER, **variables) -> str:
    return render_chat(ChatTemplate(source, ORIGIN), messages, **variables)


def refused(source: str, needle: str, seconds: float = 1.0, mib: int = 150) -> None:
    """``source`` stops with a ValueError naming the origin and matching ``needle``, within
    ``seconds`` (plus slack for a loaded machine) and ``mib`` MiB of peak allocation."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=f"chat template from {ORIGIN} (stopped|failed|cannot be compiled)"
                                             f".*{needle}"):
            render(source)
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < seconds + 1.5, f"took {elapsed:.1f} s"
    assert peak < mib * MIB, f"allocated {peak / MIB:.0f} MiB"


# ---- compile time -------------------------------------------------------------------------------
@pytest.mark.parametrize("source", [
    "{% if 1 %}" * 400 + "x" + "{% endif %}" * 400,  # the parser's recursion
    "{{ " + "(" * 1000 + "1" + ")" * 1000 + " }}",
    "{% for i in [1] %}" * 30 + "x" + "{% endfor %}" * 30,  # Python's limit of nested blocks
])
def test_nesting_too_deep_to_compile_is_a_clean_error(source: str):
    refused(source, "it is nested too deeply")


def test_an_oversized_template_is_refused_before_it_compiles():
    source = "x" * (template_sandbox.MAX_TEMPLATE_CHARS + 1)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=f"{ORIGIN} is {len(source)} characters long, over the limit"):
        compile_template(ChatTemplate(source, ORIGIN))
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.parametrize("source,needle", [
    ("{{ 'x'|center(1000000000) }}", "the filter center would make 1000000000 characters"),
    ("{{ '%0999999999d' % 1 }}", "formatting with % would make"),
    ("{{ '%.999999999f' % 1.5 }}", "formatting with % would make"),
    ("{{ '%0999999999d'|format(1) }}", "the filter format would make"),
])
def test_constants_are_not_folded_at_compile_time(source: str, needle: str):
    """Jinja's optimizer would build these while compiling, before any limit is checked."""
    t0 = time.perf_counter()
    compile_template(ChatTemplate(source, ORIGIN))
    assert time.perf_counter() - t0 < 1
    refused(source, needle)


# ---- values built from small arguments -------------------------------------------------------------
@pytest.mark.parametrize("source,needle", [
    ("{{ '{:>999999999}'.format(1) }}", "the method str.format would make"),
    ("{{ '{:{}}'.format(1, 999999999) }}", "the method str.format would make"),
    ("{{ '{0}{0}{0}{0}{0}{0}{0}{0}{0}{0}'.format(big) }}", "the method str.format would make 8000"),
    ("{{ 'x'.ljust(1000000000) }}", "the method str.ljust would make 1000000000 characters"),
    ("{{ 'x'.zfill(1000000000) }}", "the method str.zfill"),
    ("{{ ('\\t' * 100000).expandtabs(100000) }}", "the method str.expandtabs"),
    ("{{ ('x' * 1000000).translate({120: 'y' * 1000}) }}", "the method str.translate"),
    ("{{ ('x' * 8000000).replace('', 'yy') }}", "the method str.replace"),
    ("{{ ','.join([big] * 50) }}", "the method str.join"),
    ("{{ ('x ' * 4000000).split()|length }}", "the method str.split would make more than 100000 items"),
    ("{{ ('\\n' * 8000000).splitlines()|length }}", "the method str.splitlines"),
    ("{{ (1).to_bytes(1000000000, 'big') }}", "the method int.to_bytes"),
    ("{{ 'x'.encode() * 1000000000 }}", "repeating 1 items 1000000000 times"),
    ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "a product would make"),
    ("{{ lipsum(100000, false, 20, 10000) }}", "lipsum would make"),
    ("{{ ('x' * 8000000)|replace('', 'yyyy') }}", "the filter replace would make"),
    ("{{ ('\\n' * 8000000)|indent(1000) }}", "the filter indent takes at most 100000 lines"),
    ("{{ [[[[1]]]]|tojson(indent=1000000000) }}", "the filter tojson would make"),
    ("{{ [1]|slice(1000000000)|list }}", "the filter slice would make 1000000000 items"),
    ("{{ [1]|batch(1000000000, 0)|list }}", "the filter batch would make 1000000000 items"),
    ("{{ ([big] * 50)|join(',') }}", "the filter join would make"),
    ("{{ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big }}", "joining with ~ would make 80000000"),
    ("{{ [big] * 100 }}", "the text of a value would make"),
    ("{{ ([big] * 100)|string }}", "the text of a value would make"),
    ("{{ dict(a=big, b=big) }}", "the text of a value would make"),
    ("{% set ns = namespace(a=big, b=big) %}{{ ns }}", "the text of a value would make"),
    ("{{ strftime_now('%c' * 1000000) }}", "a strftime format of 2000000 characters"),
])
def test_what_small_arguments_would_build_is_refused_first(source: str, needle: str):
    refused(BIG + source, needle)


# ---- filters that go through a huge input, item by item ------------------------------------------------
@pytest.mark.parametrize("source,needle", [
    ("{{ ('xyzw' * 2000000)|list|sort }}", "the filter list takes at most 100000 items, got 8000000"),
    ("{{ ([big] * 99999)|sort }}", "the text of a value would make"),  # a case-insensitive key lower-cases each
    ("{{ ([big] * 99999)|unique|list }}", "the text of a value would make"),
    ("{{ ('x' * 8000000)|batch(1)|list }}", "the filter batch takes at most 100000 items"),
    ("{{ ('x ' * 4000000)|wordwrap(1) }}", "the filter wordwrap takes at most 100000 characters"),
    ("{{ ('x ' * 4000000)|title }}", "the filter title takes at most"),
    ("{{ ('x' * 8000000)|map('upper')|list }}", "the filter map takes at most 100000 items"),
    ("{{ ([big] * 99999)|map('lower')|list|length }}", "the values built are over the limit"),
    ("{{ range(100000)|map('string')|map('list')|sum(start=[]) }}", "rendering took longer|the filter sum"),
    ("{{ ('x' * 100000)|select('in', 'y' * 8000000)|list }}", "rendering took longer than 1 s"),
])
def test_filters_over_huge_inputs_stop_within_the_limits(source: str, needle: str):
    refused(BIG + source, needle)


def test_copies_made_by_slicing_count_toward_what_is_built():
    loop = "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + [big[1:]] %}{% endfor %}"
    refused(BIG + loop, "the values built are over the limit of 64000000 characters", mib=250)


def test_a_lone_surrogate_in_the_prompt_is_a_clean_error():
    with pytest.raises(ValueError, match=f"{ORIGIN} rendered a lone surrogate U\\+D800 at character 3"):
        render("abc{{ '\\ud800' }}")
    with pytest.raises(ValueError, match="lone surrogate U\\+DC00 at character 1"):
        render("{{ messages[0].content }}", [{"role": "user", "content": "a\udc00"}])


def test_tools_and_documents_are_none_unless_given():
    assert render("{{ tools is none }} {{ documents is none }}") == "True True"
    assert render("{{ tools|length }}", tools=[{"name": "f"}]) == "1"


# ---- the guards keep Jinja's semantics ---------------------------------------------------------------
SEMANTICS = [
    "{{ ['b', 'A', 'c']|sort }} {{ ['b', 'A', 'c']|sort(case_sensitive=true, reverse=true) }}",
    "{{ [{'n': 'b'}, {'n': 'a'}]|sort(attribute='n')|map(attribute='n')|join(',') }}",
    "{{ ['a', 'A', 'b']|unique|list }} {{ [3, 1, 2]|min }} {{ ['a', 'B']|max }} {{ [1, 2, 3]|sum(start=10) }}",
    "{{ [[1], [2, 3]]|sum(start=[]) }} {{ {'b': 1, 'a': 2}|dictsort }} {{ {'a': 1}|items|list }}",
    "{{ range(7)|batch(3, 0)|list }} {{ range(7)|slice(3)|list }} {{ 'abc'|list }} {{ []|map|list }}",
    "{{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2, 3]|reject('even')|join('-') }} {{ 'abc'|join('.') }}",
    "{% for g in [{'k': 'x', 'v': 1}, {'k': 'X', 'v': 2}]|groupby('k') %}{{ g.grouper }}{{ g.list|length }}"
    "{% endfor %}",
    "{{ messages|selectattr('role', 'eq', 'user')|map(attribute='content')|list }} "
    "{{ messages|rejectattr('role', 'in', ['user'])|list|length }}",
    "{{ 'ab'|center(9) }}|{{ '%05.1f and %s'|format(3.14159, 'x') }}|{{ '%(a)s-%(b)d' % {'a': 'x', 'b': 2} }}",
    "{{ 'a\nb\n\nc'|indent(2) }}|{{ 'a\nb'|indent('> ', first=true, blank=true) }}",
    "{{ 'one two three four five six'|wordwrap(9) }}|{{ 'hello world foo'|truncate(9, leeway=0) }}",
    "{{ 'a-b-a'|replace('a', 'xyz') }} {{ 'aaa'|replace('a', 'b', 2) }} {{ 'hi there'|title }}",
    "{{ '  x  '|trim }}|{{ 'x'|upper }}{{ 'Y'|lower }}{{ 'ab'|capitalize }} {{ 'a b c'|wordcount }}",
    "{{ 'abcdef'[1:4] }} {{ 'abcdef'[::-2] }} {{ messages[1:]|length }} {{ [1, 2, 3][:-1] }}",
    "{{ '{} {:>5} {x}'.format(1, 'r', x=[1]) }} {{ '{a}'.format_map({'a': 2}) }} {{ '%s' % [1, 'b'] }}",
    "{{ 'a,b'.split(',') }} {{ 'a b'.split() }} {{ 'a\nb'.splitlines() }} {{ '-'.join(['x', 'y']) }}",
    "{{ 'ab'.ljust(4, '.') }}{{ 'ab'.rjust(4) }}{{ '7'.zfill(3) }}{{ 'a\tb'.expandtabs(4) }}"
    "{{ 'abc'.replace('b', 'BB') }}{{ 'ab'.translate({97: 'A'}) }}",
    "{{ 'ab' ~ 1 ~ [2] ~ none }} {{ 3 * 'ab' }} {{ [1] * 2 }} {{ 2 ** 10 }} {{ 7 % 3 }} {{ 6 * 7 }}",
    "{{ {'a': [1, {'b': 'c'}]} }} {{ (1, 'x') }} {{ 'é'|string }} {{ 'x'|e }}{{ '<b>'|escape }}",
    "{% set ns = namespace(a=[1]) %}{{ ns.a }} {{ range(3)|list }} {{ [3, 1]|reverse|list }} {{ 'abc'|reverse }}",
    "{% for x in 'ab' %}{{ loop.index }}{{ x }}{% endfor %}{% set s %}{{ 1 + 1 }}{% endset %}{{ s }}",
    "{{ [1, 2]|first }}{{ [1, 2]|last }}{{ [1, 2]|length }}{{ '3'|int + 1 }}{{ '2.5'|float }}{{ -3|abs }}",
]


@pytest.mark.parametrize("source", SEMANTICS)
def test_guards_keep_jinja_semantics_for_filters_methods_and_operators(source: str):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    want = env.from_string(source).render(messages=msgs, add_generation_prompt=True)
    assert render(source, msgs) == want
