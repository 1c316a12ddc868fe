"""Tool calls: tools into the prompt, tool calls out of the model's text, and the grammar that
forces a call (tool_choice "required" or a named function).

Two formats of the models' own:

- **hermes** (Qwen2.5, Qwen3, NousResearch Hermes and most templates that know tools):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call, text
  around them allowed;
- **llama3_json** (Llama 3.1 to 3.3, whose templates speak of ``<|python_tag|>`` / ``ipython``):
  the whole reply is ``{"name": ..., "parameters": {...}}`` (after an optional
  ``<|python_tag|>``).

A template that knows no tools (its source never mentions ``tools``, as SmolLM2's) gets the
**fallback**: the tools described in a system block in the hermes format (Qwen2.5's wording),
earlier tool calls written back as ``<tool_call>`` blocks in the assistant's text and tool
results as user messages in ``<tool_response>`` blocks; the output is parsed as hermes.

``ToolCallParser`` reads the text as it streams and hands back what OpenAI streams: content,
then for each call its id and name first and its arguments in fragments. A whole response
runs the same parser over the whole text, so a stream's deltas reassemble into it exactly.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.grammar import JSON_OPTIONS
from .protocol import ChatMessage, Tool

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
HERMES, LLAMA3_JSON = "hermes", "llama3_json"
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')

FALLBACK_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_knows_tools(source: str) -> bool:
    """Whether a chat template renders a ``tools`` variable."""
    return re.search(r"\btools\b", str(source)) is not None


def tool_format(source: str) -> str:
    """The tool call format a model with chat template ``source`` writes: LLAMA3_JSON for the
    Llama 3 templates, else HERMES (the fallback's too)."""
    text = str(source)
    if template_knows_tools(text) and CALL_OPEN not in text and (PYTHON_TAG in text or "ipython" in text):
        return LLAMA3_JSON
    return HERMES


def new_call_id() -> str:
    """An id for a tool call, as OpenAI's look."""
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- prompts ---------------------------------------------------------------------------------
def _hermes_call(call: dict[str, Any]) -> str:
    fn = call["function"]
    return f"{CALL_OPEN}\n{json.dumps({'name': fn['name'], 'arguments': fn['arguments']}, ensure_ascii=False)}\n" \
           f"{CALL_CLOSE}"


def template_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool] | None,
                      knows_tools: bool) -> list[dict[str, Any]]:
    """The messages a template renders. For a template that knows tools: as they are (tool
    calls' arguments parsed into objects). Otherwise the fallback: the tools in a system block,
    tool calls as ``<tool_call>`` blocks, tool results as user ``<tool_response>`` blocks."""
    out = [m.as_template_message() for m in messages]
    if knows_tools:
        return out
    for m, msg in zip(messages, out):
        if m.role == "assistant" and m.tool_calls:
            calls = "\n".join(_hermes_call(c) for c in msg.pop("tool_calls"))
            msg["content"] = f"{m.text}\n{calls}" if m.text else calls
        elif m.role == "tool":
            msg.pop("tool_call_id", None)
            msg.pop("name", None)
            msg.update(role="user", content=f"<tool_response>\n{m.text}\n</tool_response>")
    if tools:
        block = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t.as_template_tool(), ensure_ascii=False)
                                                       for t in tools))
        if out and out[0]["role"] == "system":
            first = messages[0].text
            out[0] = {**out[0], "content": f"{first}\n\n{block}" if first else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# ---- the grammar of a forced call ------------------------------------------------------------
def _call_rule(i: int, tool: Tool, args_key: str) -> str:
    """Lark rules of one call of ``tool``: the call object written out up to its arguments,
    which follow the function's ``parameters`` as a schema of their own (so its local
    ``$defs``/``$ref`` resolve against it, as pydantic writes them)."""
    params = tool.function.parameters or {"type": "object"}
    head = f'{{"name": {json.dumps(tool.function.name, ensure_ascii=False)}, "{args_key}": '
    schema = json.dumps({**params, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)
    return f"call{i}: {json.dumps(head)} args{i} \"}}\"\nargs{i}: %json {schema}"


def forced_call_grammar(tools: Sequence[Tool], mode: str, parallel: bool, fmt: str) -> str:
    """A Lark grammar (llguidance's, with ``%json``) of the output when a call is forced:
    ``mode`` "required" (any of ``tools``, several when ``parallel``) or "function:NAME" (that
    one, once). Each call's arguments follow the function's ``parameters`` schema. Several calls
    are written back to back: after a whole call the model chooses between the next call and
    the end, and a newline there (what a model that means to go on in prose writes) would
    commit it to another call."""
    named = mode.removeprefix("function:") if mode.startswith("function:") else None
    chosen = [t for t in tools if named is None or t.function.name == named]
    args_key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    rules = "\n".join(_call_rule(i, t, args_key) for i, t in enumerate(chosen))
    obj = "obj: " + " | ".join(f"call{i}" for i in range(len(chosen)))
    if fmt == LLAMA3_JSON:
        return f"start: obj\n{obj}\n{rules}"
    calls = "call+" if parallel and named is None else "call"
    return f'start: {calls}\ncall: "{CALL_OPEN}\\n" obj "\\n{CALL_CLOSE}"\n{obj}\n{rules}'


# ---- parsing ---------------------------------------------------------------------------------
@dataclass(slots=True)
class ParsedCall:
    """A tool call read from the output: id, name, arguments (JSON text, as the model wrote it)."""

    id: str
    name: str
    arguments: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(slots=True)
class Deltas:
    """What one piece of text released: content text, calls begun (index, id, name) and
    argument fragments (index, text), in order of the calls."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def start(self, index: int, call: ParsedCall) -> None:
        self.calls.append({"index": index, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.calls[-1] if self.calls else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] += text
        else:
            self.calls.append({"index": index, "function": {"arguments": text}})

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _json_value_end(text: str, start: int = 0) -> int | None:
    """The end of the JSON object or array at ``text[start:]`` (its closing bracket + 1), or
    None while it is not complete."""
    depth, in_string, escape = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class ToolCallParser:
    """Reads a streamed reply in the hermes format (``feed`` each text delta, then ``finish``).

    Text outside ``<tool_call>`` blocks is content (text that may begin one is held back);
    inside one, the call's id and name go out as soon as ``{"name": "...", "arguments": `` is
    read, then the arguments as they come, up to the end of their JSON object. A block that is
    not such a call is given back as content when it closes."""

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self._pending = ""  # content not yet released (may begin CALL_OPEN)
        self._body: str | None = None  # text of the open block, None outside one
        self._args_at = -1  # where the open call's arguments start in _body (-1: name not read)
        self._args_sent = 0  # characters of them released
        self._args_done = False

    def feed(self, text: str) -> Deltas:
        """The deltas ``text`` releases."""
        out = Deltas()
        if self._body is None:
            self._pending += text
        else:
            self._body += text
        self._advance(out)
        return out

    def finish(self) -> Deltas:
        """The deltas left at the end of the text (a block never closed is read as it is)."""
        out = Deltas()
        if self._body is not None:
            self._close(out, self._body, closed=False)
        elif self._pending:
            out.content += self._pending
            self._pending = ""
        return out

    def _advance(self, out: Deltas) -> None:
        while True:
            if self._body is None:
                at = self._pending.find(CALL_OPEN)
                if at < 0:
                    keep = _held_prefix(self._pending, CALL_OPEN)
                    out.content += self._pending[:len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep:]
                    return
                out.content += self._pending[:at]
                self._body, self._pending = self._pending[at + len(CALL_OPEN):], ""
                self._args_at, self._args_sent, self._args_done = -1, 0, False
            body = self._body
            if self._args_at < 0:
                head = _HERMES_HEAD.match(body)
                if head is not None:
                    call = ParsedCall(new_call_id(), json.loads(f'"{head[1]}"'))
                    self.calls.append(call)
                    out.start(len(self.calls) - 1, call)
                    self._args_at = head.end()
            if self._args_at >= 0 and not self._args_done:
                end = _json_value_end(body, self._args_at) if body[self._args_at:self._args_at + 1] in "{[" else None
                upto = end if end is not None else len(body)
                fragment = body[self._args_at + self._args_sent:upto]
                self._args_sent += len(fragment)
                self.calls[-1].arguments += fragment
                out.arguments(len(self.calls) - 1, fragment)
                self._args_done = end is not None
            search_from = self._args_at + self._args_sent if self._args_done else 0
            close = body.find(CALL_CLOSE, search_from) if self._args_done or self._args_at < 0 else -1
            if close < 0:
                return
            self._close(out, body[:close], closed=True)
            self._pending = body[close + len(CALL_CLOSE):]

    def _close(self, out: Deltas, body: str, closed: bool) -> None:
        """End the open block, whose text is ``body``."""
        self._body = None
        if self._args_at >= 0:
            return  # its call went out already
        try:
            value = json.loads(body)
            name = value["name"]
            args = value.get("arguments", value.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError, AttributeError):
            out.content += CALL_OPEN + body + (CALL_CLOSE if closed else "")
            return
        call = ParsedCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        out.start(len(self.calls) - 1, call)
        out.arguments(len(self.calls) - 1, call.arguments)


class JsonToolCallParser:
    """Reads a reply in the llama3_json format: a reply that begins (after blanks and an
    optional ``<|python_tag|>``) with ``{`` is held to its end and read as one call
    ``{"name", "parameters"}`` (or several, joined by ``;``); any other reply is content."""

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self._text = ""
        self._mode: str | None = None  # None: undecided, "content", "call"

    def feed(self, text: str) -> Deltas:
        out = Deltas()
        self._text += text
        if self._mode is None:
            head = self._text.lstrip()
            if head.startswith(PYTHON_TAG) or head.startswith("{"):
                self._mode = "call"
            elif head and not PYTHON_TAG.startswith(head):
                self._mode = "content"
        if self._mode == "content":
            out.content, self._text = self._text, ""
        return out

    def finish(self) -> Deltas:
        out = Deltas()
        text, self._text = self._text, ""
        if self._mode != "call":
            out.content = text
            return out
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        found = []
        for part in body.split(";") if not body.startswith("[") else [body]:
            try:
                value = json.loads(part)
            except ValueError:
                out.content = text
                return out
            for item in value if isinstance(value, list) else [value]:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    out.content = text
                    return out
                found.append(item)
        for item in found:
            args = item.get("parameters", item.get("arguments", {}))
            call = ParsedCall(new_call_id(), item["name"], json.dumps(args, ensure_ascii=False))
            self.calls.append(call)
            out.start(len(self.calls) - 1, call)
            out.arguments(len(self.calls) - 1, call.arguments)
        return out


def new_parser(fmt: str) -> ToolCallParser | JsonToolCallParser:
    """A parser of tool calls in format ``fmt``."""
    return JsonToolCallParser() if fmt == LLAMA3_JSON else ToolCallParser()


def parse_tool_calls(text: str, fmt: str = HERMES) -> tuple[str | None, list[ParsedCall]]:
    """The content (None when only blanks are left) and the tool calls of a whole reply."""
    parser = new_parser(fmt)
    content = parser.feed(text).content + parser.finish().content
    return (content if content.strip() or not parser.calls else None), parser.calls
