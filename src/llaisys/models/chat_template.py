"""Rendering chat templates (Jinja2, sandboxed) the way Hugging Face tokenizers do.

A chat template comes with the model file, so it is untrusted code: it renders in the bounded
sandbox of ``template_sandbox`` (a deadline, loop iterations, the size of each value and what
one rendering writes and builds). Any failure inside the template, at compile time or while
it renders, becomes a ValueError naming where the template came from.
"""
from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Any, Sequence

import jinja2
from jinja2.ext import Extension

from . import template_sandbox
from .template_sandbox import BoundedSandbox, InsertGuards, RenderLimitError  # noqa: F401
from .template_source import ChatTemplate, template_origin  # noqa: F401  (ChatTemplate: imported from here too)

_SURROGATE = re.compile("[\ud800-\udfff]")


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
    if len(fmt) > template_sandbox.MAX_CHARS // 64:  # a directive writes a few dozen characters at most
        raise RenderLimitError(f"a strftime format of {len(fmt)} characters is over the limit")
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, optimized=False,
                         extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.guard_filters()
    return env.from_string(InsertGuards().visit(env.parse(source)))


def compile_template(source: str) -> jinja2.Template:
    """The compiled template, with the rendering guards built in (``render_chat`` sets the
    limits of each rendering). A syntax error, a template over ``MAX_TEMPLATE_CHARS`` or one
    nested too deeply for the parser or for Python is a ValueError naming the template's origin."""
    if len(source) > template_sandbox.MAX_TEMPLATE_CHARS:
        raise ValueError(f"{template_origin(source)} is {len(source)} characters long, over the limit of "
                         f"{template_sandbox.MAX_TEMPLATE_CHARS} for a chat template")
    try:
        return _compile(str(source))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{template_origin(source)} has a syntax error at line {exc.lineno}: "
                         f"{exc.message}") from exc
    except (RecursionError, MemoryError, SyntaxError) as exc:  # the parser's stack, Python's nested blocks
        raise ValueError(f"{template_origin(source)} cannot be compiled: it is nested too deeply "
                         f"({type(exc).__name__}: {exc})") from None


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


def _content_parts(content: "str | list", where: str) -> list[dict]:
    """``content`` as the list of parts a vision-language template iterates: a str becomes one
    text part; text parts and image parts ({"type": "image"}, whatever else it holds) are kept,
    an image part as {"type": "image"}; any other part is an error."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            parts.append({"type": "image"})
        else:
            what = f"a {kind!r} part" if isinstance(kind, str) else repr(part)[:80]
            raise ValueError(f"{where}[{j}] is {what}; expected a text part {{'type': 'text', 'text': '...'}} or "
                             "an image part {'type': 'image'}")
    return parts


def prepare_messages(messages: Sequence[dict], parts: bool = False) -> list[dict]:
    """Copies of ``messages`` ready for a template: each a dict whose "role" is a str and whose
    "content" is a str, a list of text parts (joined into one str) or, for an assistant
    message, None. With ``parts`` (a vision-language model's template), content is a list of
    text and image parts instead, a str becoming one text part. Raises TypeError or ValueError
    naming the bad message."""
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
        if parts and isinstance(content, (str, list)):
            m = {**m, "content": _content_parts(content, f"messages[{i}]['content']")}
        elif isinstance(content, list):
            m = {**m, "content": _content_text(content, f"messages[{i}]['content']")}
        elif not (isinstance(content, str) or (content is None and role == "assistant")):
            allowed = "a str, a list of text parts or None" if role == "assistant" else "a str or a list of text parts"
            raise TypeError(f"messages[{i}]['content'] ({role}) must be {allowed}, got {type(content).__name__}")
        out.append(dict(m))
    return out


def render_chat(source: str, messages: Sequence[dict], add_generation_prompt: bool = True, *, parts: bool = False,
                **variables: Any) -> str:
    """Render ``messages`` (dicts with "role" and "content", see ``prepare_messages``; with
    ``parts``, contents as lists of text and image parts) through template ``source`` (a str,
    or a ChatTemplate that knows its origin).

    ``variables`` (bos_token, eos_token, tools, ...) are passed to the template as well;
    ``tools`` and ``documents`` are None unless given, as transformers has them. Any error
    inside the template (``raise_exception``, a Python error, a rendering limit) and a result
    that is not valid Unicode (a lone surrogate) give a ValueError naming the template's origin.
    """
    prepared = prepare_messages(messages, parts)
    template = compile_template(source)
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    token = template_sandbox.start_budget()
    try:
        text = template.render(messages=prepared, add_generation_prompt=add_generation_prompt, **variables)
    except RenderLimitError as exc:
        raise ValueError(f"{template_origin(source)} stopped: {exc}") from None
    except jinja2.TemplateError as exc:
        raise ValueError(f"{template_origin(source)} failed: {exc}") from exc
    except Exception as exc:  # the template's own Python errors: MemoryError and RecursionError included
        raise ValueError(f"{template_origin(source)} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        template_sandbox.end_budget(token)
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise ValueError(f"{template_origin(source)} rendered a lone surrogate U+{ord(bad.group()):04X} at "
                         f"character {bad.start()}, which is not valid Unicode text (from the template or "
                         "the messages)")
    return text
