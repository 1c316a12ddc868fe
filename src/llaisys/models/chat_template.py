"""Rendering chat templates (Jinja2, sandboxed) the way Hugging Face tokenizers do."""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Sequence

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
def compile_template(source: str) -> jinja2.Template:
    """The compiled template; a syntax error becomes a ValueError naming the line."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template has a syntax error at line {exc.lineno}: {exc.message}") from exc


def render_chat(source: str, messages: Sequence[dict], add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render ``messages`` (dicts with "role" and "content") through template ``source``.

    ``variables`` (bos_token, eos_token, tools, ...) are passed to the template as well. A
    template that calls ``raise_exception`` gives a ValueError with its message.
    """
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise TypeError(f"messages must be a list of dicts with 'role' and 'content', got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no 'role'; expected a dict with 'role' and 'content'")
    try:
        return compile_template(source).render(messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template failed: {exc}") from exc
