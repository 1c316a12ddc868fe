"""Structured outputs: the grammar a request asks for, from OpenAI's ``response_format`` or
vLLM's ``structured_outputs`` and ``guided_*`` fields, checked and named for errors.

    spec = requested_constraint(req)   # None, or a GrammarSpec naming the field it came from
    pending = service.grammars.prepare(spec.kind, spec.value, spec.param)   # limits: 400 naming spec.param
    grammar = await service.grammars.compile(pending)   # 400 naming spec.param when it does not compile
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import bad_request
from .protocol import SamplingRequest

# vLLM's structured_outputs keys (and its older guided_* fields) -> our grammar kinds
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A grammar asked for: its kind (see ``engine.grammar.grammar_source``), its value, and
    the request field that gave it (for errors)."""

    kind: str
    value: Any
    param: str


def _response_format(fmt: dict[str, Any]) -> GrammarSpec | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", None, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema: must be an object with 'name' and 'schema'",
                              param="response_format.json_schema")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema: must be a JSON schema (an object), got "
                              f"{type(schema).__name__}", param="response_format.json_schema.schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("response_format.json_schema.strict: must be a boolean",
                              param="response_format.json_schema.strict")
        return GrammarSpec("json_schema", schema, "response_format.json_schema.schema")
    raise bad_request(f"response_format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      param="response_format.type")


def requested_constraint(req: SamplingRequest) -> GrammarSpec | None:
    """The grammar ``req`` asks for, if any. 400 when it asks for several, or gives one of a
    wrong shape (the grammar itself is checked when compiled)."""
    specs: list[GrammarSpec] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            specs.append(spec)
    so = req.structured_outputs
    if so is not None:
        given = [k for k in so if so[k] is not None and so[k] is not False]
        unknown = [k for k in given if k not in STRUCTURED_KEYS]
        if unknown:
            raise bad_request(f"structured_outputs.{unknown[0]}: not supported; give one of "
                              f"{', '.join(STRUCTURED_KEYS)}", param=f"structured_outputs.{unknown[0]}")
        specs += [GrammarSpec(STRUCTURED_KEYS[k], so[k], f"structured_outputs.{k}") for k in given]
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            specs.append(GrammarSpec(kind, value, name))
    if len(specs) > 1:
        raise bad_request(f"{specs[1].param}: give one output constraint, not several "
                          f"({', '.join(s.param for s in specs)})", param=specs[1].param)
    return specs[0] if specs else None
