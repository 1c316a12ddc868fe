"""Rendering chat templates (Jinja2, sandboxed) the way Hugging Face tokenizers do.

A chat template comes with the model file, so it is untrusted code. It renders in Jinja2's
immutable sandbox, within limits: a deadline (``RENDER_TIMEOUT_S``), a number of loop
iterations (``MAX_LOOP_ITERATIONS``) and a number of characters (``MAX_CHARS``) for what it
writes and for any one string or list it builds. Every loop iteration, call, written value and
``*``, ``**`` or ``+`` goes through a check. What is not bounded: a filter (``join``,
``replace``, ``center``...) can still build one large string out of values within the limits
before a check sees it. Any failure inside the template becomes a ValueError naming where the
template came from.
"""
from __future__ import annotations

import contextvars
import functools
import json
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from .template_source import ChatTemplate, template_origin  # noqa: F401  (ChatTemplate: imported from here too)

RENDER_TIMEOUT_S = 5.0
MAX_LOOP_ITERATIONS = 200_000  # chat templates loop over messages and tools: thousands at most
MAX_CHARS = 8_000_000  # far above any prompt a context window holds
MAX_POWER_BITS = 1 << 16  # `**` results wider than this many bits are refused


class RenderLimitError(jinja2.TemplateError):
    """A template ran past one of the rendering limits."""


class _Budget:
    """What one rendering may still spend: time, loop iterations, characters written."""

    __slots__ = ("deadline", "iterations", "chars")

    def __init__(self) -> None:
        self.deadline = time.monotonic() + RENDER_TIMEOUT_S
        self.iterations = 0
        self.chars = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimitError(f"rendering took longer than {RENDER_TIMEOUT_S:g} s")

    def loop_step(self) -> None:
        self.iterations += 1
        if self.iterations > MAX_LOOP_ITERATIONS:
            raise RenderLimitError(f"more than {MAX_LOOP_ITERATIONS} loop iterations")
        if self.iterations % 256 == 0:
            self.tick()

    def check_size(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_CHARS:
            raise RenderLimitError(f"a value of {len(value)} items is over the limit of {MAX_CHARS}")
        return value

    def write(self, value: Any) -> Any:
        self.chars += len(str(value))
        if self.chars > MAX_CHARS:
            raise RenderLimitError(f"the output is over the limit of {MAX_CHARS} characters")
        return value


_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _current_budget() -> _Budget:
    # Outside render_chat each check gets a fresh budget: sizes are still checked, time and
    # loop iterations are not counted.
    budget = _budget.get(None)
    return budget if budget is not None else _Budget()


def _guard_loop(iterable: Iterable[Any]) -> Iterator[Any]:
    """Every ``{% for %}`` iterates through this: counts iterations, checks the deadline."""
    budget = _current_budget()
    for item in iterable:
        budget.loop_step()
        yield item


def _guard_output(value: Any) -> Any:
    """Every value a template writes passes through this (captured ``{% set %}`` blocks too)."""
    return _current_budget().write(value)


def _identity(value: Any) -> Any:
    return value


class _InsertGuards(NodeTransformer):
    """Wraps each loop's iterable, each written value and each ``~`` concatenation in a call
    to a guard; the guards are imported names, which a template cannot rebind."""

    @staticmethod
    def _wrap(guard: str, node: nodes.Expr) -> nodes.Call:
        callee = nodes.ImportedName(f"{__name__}.{guard}")
        return nodes.Call(callee, [node], [], None, None).set_lineno(node.lineno)

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = self._wrap("_guard_loop", node.iter)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        self.generic_visit(node)
        node.nodes = [self._wrap("_guard_output", n) for n in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return self._wrap("_identity", node)  # the call hook checks the result's size


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the rendering limits checked in its call and operator hooks."""

    intercepted_binops = frozenset(("*", "**", "+"))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _current_budget()
        budget.tick()
        return budget.check_size(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _current_budget()
        budget.tick()
        _check_binop_size(operator, left, right)
        return budget.check_size(super().call_binop(context, operator, left, right))


def _check_binop_size(operator: str, left: Any, right: Any) -> None:
    """Refuse a repetition, concatenation or power whose result would be over the limits,
    before it is computed."""
    sized = (str, list, tuple)
    if operator == "*":
        seq, n = (left, right) if isinstance(left, sized) else (right, left)
        if isinstance(seq, sized) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
            raise RenderLimitError(f"repeating {len(seq)} items {n} times is over the limit of {MAX_CHARS}")
    elif operator == "+":
        if isinstance(left, sized) and isinstance(right, sized) and len(left) + len(right) > MAX_CHARS:
            raise RenderLimitError(f"joining {len(left)} and {len(right)} items is over the limit of {MAX_CHARS}")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if left.bit_length() * right > MAX_POWER_BITS:
            raise RenderLimitError(f"a power of about {left.bit_length() * right} bits is over the limit of "
                                   f"{MAX_POWER_BITS} bits")


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text; rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(_InsertGuards().visit(env.parse(source)))


def compile_template(source: str) -> jinja2.Template:
    """The compiled template, with the rendering guards built in (``render_chat`` sets the
    limits of each rendering); a syntax error becomes a ValueError naming the template's
    origin and the line."""
    try:
        return _compile(str(source))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{template_origin(source)} has a syntax error at line {exc.lineno}: "
                         f"{exc.message}") from exc


def _content_text(content: list, where: str) -> str:
    """The text of a list of content parts ([{"type": "text", "text": ...}, ...]), joined
    with newlines; any other kind of part is an error."""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a {kind!r} part" if isinstance(kind, str) else repr(part)[:80]
            raise ValueError(f"{where}[{j}] is {what}; expected a text part "
                             "{'type': 'text', 'text': '...'} (this model takes text only)")
        texts.append(part["text"])
    return "\n".join(texts)


def prepare_messages(messages: Sequence[dict]) -> list[dict]:
    """Copies of ``messages`` ready for a template: each a dict whose "role" is a str and whose
    "content" is a str, a list of text parts (joined into one str) or, for an assistant
    message, None. Raises TypeError or ValueError naming the bad message."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of dicts with 'role' and 'content', got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no 'role'; expected a dict with 'role' and 'content'")
        role, content = m["role"], m.get("content")
        if not isinstance(role, str):
            raise TypeError(f"messages[{i}]['role'] must be a str, got {type(role).__name__} {role!r}")
        if isinstance(content, list):
            m = {**m, "content": _content_text(content, f"messages[{i}]['content']")}
        elif not (isinstance(content, str) or (content is None and role == "assistant")):
            allowed = "a str, a list of text parts or None" if role == "assistant" else "a str or a list of text parts"
            raise TypeError(f"messages[{i}]['content'] ({role}) must be {allowed}, got {type(content).__name__}")
        out.append(dict(m))
    return out


def render_chat(source: str, messages: Sequence[dict], add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render ``messages`` (dicts with "role" and "content", see ``prepare_messages``) through
    template ``source`` (a str, or a ChatTemplate that knows its origin).

    ``variables`` (bos_token, eos_token, tools, ...) are passed to the template as well. Any
    error inside the template (``raise_exception``, a Python error, a rendering limit) gives a
    ValueError naming the template's origin.
    """
    prepared = prepare_messages(messages)
    template = compile_template(source)
    token = _budget.set(_Budget())
    try:
        return template.render(messages=prepared, add_generation_prompt=add_generation_prompt, **variables)
    except RenderLimitError as exc:
        raise ValueError(f"{template_origin(source)} stopped: {exc}") from None
    except jinja2.TemplateError as exc:
        raise ValueError(f"{template_origin(source)} failed: {exc}") from exc
    except Exception as exc:  # the template's own Python errors: MemoryError and RecursionError included
        raise ValueError(f"{template_origin(source)} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        _budget.reset(token)
