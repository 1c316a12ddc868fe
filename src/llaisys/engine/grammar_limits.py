"""Bounds on what a grammar may be, checked before anything compiles it.

    limits = GrammarLimits(max_bytes=128 << 10, max_choices=4096, max_depth=128)
    limits.check("json_schema", schema)   # GrammarTooLarge (a ValueError) naming the limit

The grammar library recurses as deep as a grammar nests: a Lark grammar whose rules chain
3,000 deep, or a schema whose ``$ref``s chain through 3,000 definitions, overflows the stack of
the thread that compiles it (the process dies). So the depth a grammar can reach is bounded
here, counting nesting and references together: a schema's JSON nesting plus one level per
``$ref`` followed (a reference back into a definition being expanded is recursion, which the
library handles lazily, and counts nothing), a Lark grammar's longest chain of rules and
terminals referring to each other, and the schemas of its ``%json`` blocks. Sizes are bounded
too: the grammar text (a regular expression, a grammar, a schema as JSON, all the choices
together) and the number of choices. Every walk here is iterative or bounded by the depth limit.
"""
from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_BYTES = 128 << 10
DEFAULT_MAX_CHOICES = 4096
DEFAULT_MAX_DEPTH = 128
_DATA_KEYWORDS = ("enum", "const", "default", "examples")  # JSON values, not schemas: no $ref inside counts


class GrammarTooLarge(ValueError):
    """A grammar beyond one of the limits; ``limit`` names the GrammarLimits field."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """How large a grammar may be: ``max_bytes`` of text (UTF-8; a schema as compact JSON, the
    choices together), ``max_choices`` strings in a choice, ``max_depth`` levels of nesting and
    references (see the module's docstring)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_choices: int = DEFAULT_MAX_CHOICES
    max_depth: int = DEFAULT_MAX_DEPTH

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_choices", "max_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GrammarLimits.{name} must be a positive integer, got {value!r}")

    def check(self, kind: str, value: Any) -> None:
        """Raise GrammarTooLarge when ``value`` given as ``kind`` (see ``grammar.grammar_source``)
        is beyond a limit, ValueError when it is not of the kind's type. A schema given as JSON
        text is parsed here without recursion limits mattering (too deep is GrammarTooLarge)."""
        if kind == "json_schema":
            self.check_schema(parse_schema(value, self.max_depth) if isinstance(value, str) else value,
                              text=value if isinstance(value, str) else None)
        elif kind == "choice":
            self._check_choices(value)
        elif kind in ("regex", "grammar", "lark") and isinstance(value, str):
            self._check_size(value, "the regular expression" if kind == "regex" else "the grammar")
            if kind != "regex":
                self.check_lark(lark_text(value) if kind == "grammar" else value)

    def _check_size(self, text: str, what: str) -> None:
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise GrammarTooLarge(f"{what} has {size} bytes; at most {self.max_bytes} are allowed", "max_bytes")

    def _check_choices(self, value: Any) -> None:
        if not isinstance(value, list):
            return  # grammar_source says what a choice must be
        if len(value) > self.max_choices:
            raise GrammarTooLarge(f"the choice has {len(value)} strings; at most {self.max_choices} are allowed",
                                  "max_choices")
        size = sum(len(s.encode("utf-8", "surrogatepass")) for s in value if isinstance(s, str))
        if size > self.max_bytes:
            raise GrammarTooLarge(f"the choices have {size} bytes together; at most {self.max_bytes} are allowed",
                                  "max_bytes")

    def check_schema(self, schema: Any, text: str | None = None) -> None:
        """Size (as compact JSON) and depth (nesting plus ``$ref`` hops) of a parsed schema."""
        self._check_size(text if text is not None else json.dumps(schema, separators=(",", ":")), "the JSON schema")
        nesting = json_nesting(schema, self.max_depth)
        if nesting > self.max_depth:
            raise GrammarTooLarge(f"the JSON schema is nested more than {self.max_depth} levels deep", "max_depth")
        if schema_depth(schema, self.max_depth) > self.max_depth:
            raise GrammarTooLarge(f"the JSON schema reaches more than {self.max_depth} levels deep, counting one "
                                  "level for each $ref it follows", "max_depth")

    def check_lark(self, text: str) -> None:
        """Depth of a Lark grammar's chains of rules, and its ``%json`` schemas."""
        rules, schemas = lark_rules(text, self.max_depth)
        for schema in schemas:
            self.check_schema(schema)
        chain = longest_chain(rules)
        if chain > self.max_depth:
            raise GrammarTooLarge(f"the grammar's rules refer to each other {chain} deep; at most {self.max_depth} "
                                  "levels are allowed", "max_depth")


# ---- JSON schemas ---------------------------------------------------------------------------
def parse_schema(text: str, max_depth: int) -> Any:
    """The JSON value of ``text``; GrammarTooLarge when it nests deeper than the parser can go,
    ValueError when it is not JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise GrammarTooLarge(f"the JSON schema is nested more than {max_depth} levels deep", "max_depth") from None
    except ValueError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None


def _children(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        yield from node.values()
    elif isinstance(node, list):
        yield from node


def json_nesting(value: Any, stop: int) -> int:
    """Levels of objects and arrays in ``value`` (a scalar: 0), counted without recursion; the
    walk ends as soon as it passes ``stop``."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > stop:
            return deepest
        stack.extend((child, depth + 1) for child in _children(node))
    return deepest


def resolve_pointer(root: Any, ref: str) -> Any:
    """The value a local ``$ref`` (``#``, ``#/$defs/a``...) points at in ``root``; None when
    it is not a local JSON pointer or points nowhere."""
    if not ref.startswith("#"):
        return None
    node = root
    pointer = urllib.parse.unquote(ref[1:])
    if not pointer:
        return root
    if not pointer.startswith("/"):
        return None  # a named anchor
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def schema_depth(schema: Any, stop: int) -> int:
    """The deepest a compiler expanding ``schema`` goes: nesting levels plus one per local
    ``$ref`` followed; a reference back into a schema being expanded (recursion) counts 0.
    Each schema's depth is computed once; the walk ends once it passes ``stop``."""
    done: dict[int, int] = {}  # id(node) -> its depth
    open_: set[int] = set()  # nodes being expanded

    def depth(node: Any, level: int) -> int:
        if not isinstance(node, (dict, list)):
            return 0
        key = id(node)
        if key in done:
            return done[key]
        if key in open_ or level > stop:
            return 0 if key in open_ else stop + 1
        open_.add(key)
        best = 0
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                target = resolve_pointer(schema, ref)
                if target is not None:  # in place of the $ref: one level more
                    best = depth(target, level + 1)
            items = [v for k, v in node.items() if k not in _DATA_KEYWORDS]
        else:
            items = node
        for child in items:
            best = max(best, depth(child, level + 1))
            if best > stop:
                break
        open_.discard(key)
        done[key] = result = 1 + best
        return result

    try:
        return depth(schema, 1)
    except RecursionError:
        return stop + 1


# ---- Lark ------------------------------------------------------------------------------------
_LARK_TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<comment>//[^\n]*)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[a-z]*)
  | (?P<json>%json\b)
  | (?P<special><\[[^\]\n]*\]>|<\|[^\n]*?\|>)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<newline>\n)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
_BLANKS = re.compile(r"\s*")
_DEFINITION = re.compile(r"[ \t]*(?:\[[^\]\n]*\])?[ \t]*(?:\.[ \t]*-?\d+)?[ \t]*:")


def lark_text(text: str) -> str:
    """The Lark form of a "grammar" value (Lark already, or llama.cpp's GBNF); ValueError when
    it converts to neither."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except RecursionError:
        raise GrammarTooLarge("the grammar nests too deeply to read", "max_depth") from None
    except Exception as exc:  # noqa: BLE001  (the converter raises its own error types)
        raise ValueError(f"the grammar is neither Lark nor GBNF: {exc}") from None


def lark_rules(text: str, max_depth: int) -> tuple[dict[str, set[str]], list[Any]]:
    """The rules and terminals a Lark grammar defines, each with the names its definition
    refers to, and the schemas of its ``%json`` blocks. Strings, regular expressions and
    comments are skipped, so a name inside them is not a reference."""
    rules: dict[str, set[str]] = {}
    schemas: list[Any] = []
    current: set[str] | None = None
    line_start = True
    decoder = json.JSONDecoder()
    at = 0
    while at < len(text):
        m = _LARK_TOKEN.match(text, at)
        kind, at = m.lastgroup, m.end()
        if kind == "newline":
            line_start = True
            continue
        if kind == "other" and m.group() in " \t\r?!":
            continue  # blanks, and the ?/! before a rule's name, keep the line's start
        if kind == "json":
            start = _BLANKS.match(text, at).end()
            try:
                schema, at = decoder.raw_decode(text, start)
            except RecursionError:
                raise GrammarTooLarge(f"a %json schema is nested more than {max_depth} levels deep",
                                      "max_depth") from None
            except ValueError:
                pass  # not JSON: the grammar library says so
            else:
                schemas.append(schema)
        elif kind == "name":
            name = m.group()
            definition = _DEFINITION.match(text, at) if line_start else None
            if definition is not None:
                current = rules.setdefault(name, set())
                at = definition.end()
            elif current is not None:
                current.add(name)
        line_start = False
    return rules, schemas


def longest_chain(edges: dict[str, set[str]]) -> int:
    """The most definitions a chain of references passes through (iteratively; a reference
    back to a definition on the chain, recursion, ends it)."""
    depth: dict[str, int] = {}
    for root in edges:
        if root in depth:
            continue
        on_chain = {root}
        stack = [(root, iter(edges[root]))]
        while stack:
            node, refs = stack[-1]
            for ref in refs:
                if ref in edges and ref not in depth and ref not in on_chain:
                    on_chain.add(ref)
                    stack.append((ref, iter(edges[ref])))
                    break
            else:
                stack.pop()
                on_chain.discard(node)
                depth[node] = 1 + max((depth[r] for r in edges[node] if r in depth), default=0)
    return max(depth.values(), default=0)
