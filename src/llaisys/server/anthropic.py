"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, over the chat path.

A request is checked in Anthropic's terms (errors name its fields: ``messages[1].content[0]``),
then turned into a chat completion request (``system`` into a first system message, content
blocks into chat messages: ``tool_use`` blocks into an assistant's ``tool_calls``, each
``tool_result`` into a ``tool`` message, a user's ``image`` blocks (base64 or url sources)
into image parts, which the request builder fetches, decodes and limits; ``tools`` with their
``input_schema``, ``tool_choice``, ``stop_sequences``, ``thinking`` into the template's
``enable_thinking``), built by
``requests.build_request`` and run as one, and its reply given back as content blocks:
``thinking`` (a ``<think>`` block), ``text`` and ``tool_use``. A stream sends Anthropic's
events: ``message_start``, ``ping``, per block ``content_block_start`` /
``content_block_delta`` (``text_delta``, ``thinking_delta``, ``input_json_delta``) /
``content_block_stop``, then ``message_delta`` (stop reason, usage) and ``message_stop``; an
error after the start is an ``error`` event. A whole response is built by the same steps as a
stream, so the two agree block for block.

Every error on these routes has Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}`` (``bodies.error_body``): ``middleware.AnthropicErrors`` reshapes the server's own
(OpenAI-shaped) error answers, those of the API key check, the body guards and unknown routes
included.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, ValidationError, field_validator, model_validator

from ..engine import RequestOutput
from .bodies import error_body, json_kind
from .completions import ChatFormat, Run, answer, chat_format, submit_jobs, until_disconnected
from .errors import APIError, bad_request, validation_error
from .middleware import AnthropicErrors, reshape_error  # noqa: F401  (the Messages API's, importable from here too)
from .protocol import MAX_TOOLS, ChatCompletionRequest, FastList, PositiveInt, Strict
from .reasoning import ReplyDeltas
from .requests import Job, build_request, chat_prompt
from .service import ModelService

log = logging.getLogger(__name__)

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # Anthropic's rule for a custom tool's name
_thinking_noted: set[str] = set()  # models whose template cannot think, logged once each


# ---- request ------------------------------------------------------------------------------------
class AnthropicTool(Strict):
    """A custom tool: its name, what it does, and the JSON schema of its input."""

    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _custom(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"type: {kind!r} tools (Anthropic's server tools) are not supported; give custom tools "
                             "{'name', 'description', 'input_schema'}")
        return value


class AnthropicToolChoice(Strict):
    """``auto`` (the model decides), ``any`` (a call is required), ``tool`` (the named tool must be
    called) or ``none``; ``disable_parallel_tool_use``: at most one call."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicThinking(Strict):
    """Extended thinking: ``enabled`` (``budget_tokens``: the chat request's ``reasoning_budget``,
    thinking tokens before ``</think>`` is forced), ``disabled``, or ``adaptive`` /
    ``between_tools`` (the template's default)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: PositiveInt | None = None


class AnthropicOutputConfig(Strict):
    """``format``: a JSON schema the reply follows (``{"type": "json_schema", "schema": ...}``);
    ``effort`` is accepted and ignored."""

    effort: str | None = None
    format: dict[str, Any] | None = None

    @field_validator("format")
    @classmethod
    def _format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and (value.get("type") != "json_schema" or not isinstance(value.get("schema"), dict)):
            raise ValueError("must be {'type': 'json_schema', 'schema': {...}}")
        return value


class AnthropicMessage(Strict):
    """One turn: its role and its content, text or a list of blocks (checked by ``chat_request``)."""

    role: Literal["user", "assistant"]
    content: str | FastList[dict[str, Any]]


class AnthropicCountTokensRequest(Strict):
    """POST /v1/messages/count_tokens: what makes the prompt of a Messages request."""

    model: str | None = None
    system: str | FastList[dict[str, Any]] | None = None
    messages: Annotated[FastList[AnthropicMessage], Field(min_length=1)]
    tools: Annotated[FastList[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None

    @model_validator(mode="after")
    def _tool_choice(self) -> "AnthropicCountTokensRequest":
        choice, names = self.tool_choice, [t.name for t in self.tools or ()]
        if choice is None or choice.type in ("auto", "none"):
            return self
        if not names:
            raise ValueError(f"tool_choice: type {choice.type!r} needs tools")
        if choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice.name: must name one of the tools ({', '.join(names)}), "
                             f"got {choice.name!r}")
        return self

    def sampling(self) -> dict[str, Any]:
        """The chat request's fields of generation (none for counting tokens)."""
        return {}


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """POST /v1/messages (unknown fields ignored, as elsewhere)."""

    max_tokens: PositiveInt
    stop_sequences: FastList[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # 0: off
    metadata: dict[str, Any] | None = None
    output_config: AnthropicOutputConfig | None = None
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        for i, stop in enumerate(value or ()):
            if not stop:
                raise ValueError(f"must be non-empty strings (item {i} is empty)")
        return value

    def sampling(self) -> dict[str, Any]:
        """The chat request's fields of generation: limits, stops, sampling, output format, stream."""
        fmt = self.output_config.format if self.output_config is not None else None
        return {"max_tokens": self.max_tokens, "stop": self.stop_sequences or None, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream,
                "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
                if fmt is not None else None}


def _typed_blocks(blocks: list[Any], where: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Each content block of ``blocks`` (at ``where``) with its place, ``where[j]``, and its type;
    400 for an item that is not a block with a type."""
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise bad_request(f"{at}: must be a content block {{'type': ..., ...}}, got {json_kind(block)}", param=at)
        yield at, kind, block


def _unsupported(kind: str, where: str, allowed: str) -> APIError:
    if kind == "image":
        return bad_request(f"{where}: image blocks go in a user message's content, not here ({allowed})",
                           param=f"{where}.type")
    if kind == "document":
        return bad_request(f"{where}: document blocks are not supported by this server; send text",
                           param=f"{where}.type")
    return bad_request(f"{where}.type: {kind!r} blocks are not supported here ({allowed})", param=f"{where}.type")


def _str_field(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: must be a string, got {json_kind(value)}", param=f"{where}.{key}")
    return value


def _texts(blocks: str | list[Any] | None, where: str, allowed: str = "text") -> str:
    """Text content (a string, or text blocks joined by newlines); 400 for any other block."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    if not isinstance(blocks, list):
        raise bad_request(f"{where}: must be a string or a list of text blocks, got {json_kind(blocks)}",
                          param=where)
    texts = []
    for at, kind, block in _typed_blocks(blocks, where):
        if kind != "text":
            raise _unsupported(kind, at, allowed)
        texts.append(_str_field(block, "text", at))
    return "\n".join(texts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """The chat image part of an ``image`` block: its base64 source as a data: URL, or its url."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type = _str_field(source, "media_type", f"{where}.source")
        if not re.fullmatch(r"image/[A-Za-z0-9.+-]+", media_type):
            raise bad_request(f"{where}.source.media_type: must be an image type such as image/png or image/jpeg, "
                              f"got {media_type[:40]!r}", param=f"{where}.source.media_type")
        url = f"data:{media_type};base64,{_str_field(source, 'data', f'{where}.source')}"
    elif kind == "url":
        url = _str_field(source, "url", f"{where}.source")
    else:
        raise bad_request(f"{where}.source: must be {{'type': 'base64', 'media_type': 'image/png', 'data': ...}} or "
                          f"{{'type': 'url', 'url': ...}}, got {json_kind(source) if kind is None else repr(kind)}",
                          param=f"{where}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _user_turn(blocks: list[dict[str, Any]], where: str, image_fields: list[str]) -> list[dict[str, Any]]:
    """The chat messages of a user turn: a tool message per ``tool_result``, then its text and
    images (their fields appended to ``image_fields``)."""
    tools, parts, images = [], [], []
    for at, kind, block in _typed_blocks(blocks, where):
        if kind == "text":
            parts.append({"type": "text", "text": _str_field(block, "text", at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
            images.append(at)
        elif kind == "tool_result":
            result = _texts(block.get("content"), f"{at}.content", "text blocks")
            is_error = block.get("is_error", False)
            if not isinstance(is_error, bool):
                raise bad_request(f"{at}.is_error: must be a boolean, got {json_kind(is_error)}",
                                  param=f"{at}.is_error")
            tools.append({"role": "tool", "tool_call_id": _str_field(block, "tool_use_id", at),
                          "content": f"Error: {result}" if is_error else result})
        elif kind == "tool_use":
            raise bad_request(f"{at}: a tool_use block belongs in an assistant message", param=f"{at}.type")
        else:
            raise _unsupported(kind, at, "a user message takes text, image and tool_result blocks")
    if not parts:
        return tools + ([] if tools else [{"role": "user", "content": ""}])
    image_fields += images
    content = parts if images else "\n".join(p["text"] for p in parts)
    return tools + [{"role": "user", "content": content}]


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """The chat message of an assistant turn: its text and its ``tool_use`` blocks as tool calls
    (earlier thinking is not shown to the model again)."""
    texts, calls = [], []
    for at, kind, block in _typed_blocks(blocks, where):
        if kind == "text":
            texts.append(_str_field(block, "text", at))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad_request(f"{at}.input: must be an object, got {json_kind(arguments)}", param=f"{at}.input")
            calls.append({"id": _str_field(block, "id", at), "type": "function",
                          "function": {"name": _str_field(block, "name", at),
                                       "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind == "tool_result":
            raise bad_request(f"{at}: a tool_result block belongs in a user message", param=f"{at}.type")
        else:
            raise _unsupported(kind, at, "an assistant message takes text, tool_use and thinking blocks")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(req: AnthropicCountTokensRequest, image_fields: list[str]) -> list[dict[str, Any]]:
    """The chat messages of ``system`` and ``messages``; the fields of their images are
    appended to ``image_fields``, in order."""
    if req.messages[-1].role == "assistant":
        last = len(req.messages) - 1
        raise bad_request(f"messages[{last}]: the last message must be the user's; continuing a final assistant "
                          "message (prefill) is not supported by this server", param=f"messages[{last}].role")
    out: list[dict[str, Any]] = []
    system = _texts(req.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out += _user_turn(m.content, where, image_fields)
        else:
            out.append(_assistant_turn(m.content, where))
    return out


def _tools(req: AnthropicCountTokensRequest) -> list[dict[str, Any]] | None:
    """The chat tools of ``tools``: each a function whose parameters are its input_schema."""
    tools = []
    for t in req.tools or ():
        fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
        tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return tools or None


def _tool_choice(choice: AnthropicToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request(req: AnthropicCountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request that answers (or, for count_tokens, renders the prompt of)
    ``req``; 400 naming the field for what the server cannot take."""
    thinking = req.thinking.type if req.thinking is not None else None
    image_fields: list[str] = []
    body = {"model": req.model, "messages": _messages(req, image_fields), "tools": _tools(req),
            "tool_choice": _tool_choice(req.tool_choice),
            "parallel_tool_calls": not (req.tool_choice and req.tool_choice.disable_parallel_tool_use),
            "chat_template_kwargs": {"enable_thinking": thinking == "enabled"}
            if thinking in ("enabled", "disabled") else None,
            "reasoning_budget": req.thinking.budget_tokens if thinking == "enabled" else None, **req.sampling()}
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None
    return chat.name_images(image_fields)


# ---- response: content blocks -------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ContentBlocks:
    """A reply's content blocks, built as it streams: ``feed`` each piece's deltas (reasoning,
    content, tool calls) and get the events that stream it. Blank text is held until text
    follows (blanks beside tool calls are not content)."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []  # as content_block_start showed them, their text added
        self.arguments: dict[int, str] = {}  # tool_use block -> its input's JSON text so far
        self.calls: dict[int, int] = {}  # tool call index -> its block
        self.open = False  # whether the last block still takes deltas
        self.blank = ""

    def _open(self, kind: str) -> bool:
        return self.open and self.blocks[-1]["type"] == kind

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.blocks.append(block)
        self.open = True
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": index, "delta": delta}

    def close(self) -> list[dict[str, Any]]:
        """The events that end the open block (none when no block is open)."""
        if not self.open:
            return []
        self.open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def feed(self, parts: ReplyDeltas) -> list[dict[str, Any]]:
        """The events of one piece of the reply."""
        events: list[dict[str, Any]] = []
        if parts.reasoning:
            if not self._open("thinking"):
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += parts.reasoning
            events.append(self._delta(len(self.blocks) - 1, {"type": "thinking_delta", "thinking": parts.reasoning}))
        text = parts.content
        if text and not self._open("text"):
            if not text.strip():
                self.blank, text = self.blank + text, ""
            else:
                events += self._start({"type": "text", "text": ""})
                self.blank, text = "", self.blank + text
        if text:
            self.blocks[-1]["text"] += text
            events.append(self._delta(len(self.blocks) - 1, {"type": "text_delta", "text": text}))
        for call in parts.calls:
            if "id" in call:
                self.blank = ""
                events += self._start({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                                       "name": call["function"]["name"], "input": {}})
                self.calls[call["index"]] = len(self.blocks) - 1
                self.arguments[len(self.blocks) - 1] = ""
            fragment = call["function"].get("arguments") or ""
            block = self.calls.get(call["index"])
            if fragment and block is not None:
                self.arguments[block] += fragment
                events.append(self._delta(block, {"type": "input_json_delta", "partial_json": fragment}))
        return events

    def content(self) -> list[dict[str, Any]]:
        """The whole reply's blocks. A tool call whose input is not a JSON object (cut off by
        max_tokens, or written so by the model) is left out."""
        out = []
        for i, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                try:
                    value = json.loads(self.arguments[i])
                except ValueError:
                    value = None
                if not isinstance(value, dict):
                    log.warning("left out tool call %s of %s: its input is not a JSON object: %.200s",
                                block["name"], block["id"], self.arguments[i])
                    continue
                block = {**block, "input": value}
            out.append(block)
        return out


def stop_reason(finish_reason: str | None, has_calls: bool, stop_sequence: str | None) -> str:
    """Anthropic's stop reason of a reply that ended with the engine's ``finish_reason``."""
    if finish_reason == "length":
        return "max_tokens"
    if has_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def matched_stop(text: str, stops: list[str] | None) -> str | None:
    """The stop sequence that ended a reply, given the text its tokens decode to (up to and
    past the stop, which is not shown): the first one in it. None: none of them is there (the
    reply ended at end-of-sequence)."""
    found = [(text.find(s), len(s), s) for s in stops or () if s in text]
    return min(found)[2] if found else None


def _event(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


class MessageRun:
    """One Messages request's run: its message, or its events."""

    def __init__(self, service: ModelService, req: AnthropicMessagesRequest, fmt: ChatFormat, job: Job,
                 run: Run) -> None:
        self.service, self.req, self.run = service, req, run
        self.reader = fmt.reader(job)
        self.blocks = ContentBlocks()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None

    def usage(self) -> dict[str, Any]:
        """Anthropic's usage: the prompt tokens found in the prefix cache are
        ``cache_read_input_tokens``, the others ``input_tokens``."""
        u = self.run.usage()
        cached = u["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": u["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": u["completion_tokens"]}

    def message(self, content: list[dict[str, Any]], reason: str | None, stop: str | None) -> dict[str, Any]:
        """The message object: ``content`` blocks, stop reason and sequence, usage so far."""
        return {"id": self.run.id, "type": "message", "role": "assistant", "model": self.service.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": stop, "usage": self.usage()}

    def take(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The block events of one engine output."""
        self.token_ids += out.token_ids
        self.finish_reason = out.finish_reason or self.finish_reason
        text = out.text_delta
        parts = self.reader.read(text, out.finished) if self.reader is not None else ReplyDeltas(content=text)
        return self.blocks.feed(parts)

    async def stop_sequence(self) -> str | None:
        """The stop sequence that ended the reply, if one did (its tokens decoded in a worker)."""
        stops = self.req.stop_sequences
        if self.finish_reason != "stop" or not stops:
            return None
        return matched_stop(await self.service.in_worker(lambda: self.service.tokenizer.decode(self.token_ids)), stops)

    async def whole(self) -> dict[str, Any]:
        """The non-streamed message."""
        async for _, out in self.run.outputs():
            self.take(out)
        content = self.blocks.content()
        stop = await self.stop_sequence()
        has_calls = any(b["type"] == "tool_use" for b in content)
        return self.message(content, stop_reason(self.finish_reason, has_calls, stop), stop)

    async def events(self) -> AsyncIterator[str]:
        """The server-sent events of a streamed message: ``message_start`` (with the first
        output, when the prompt's cached tokens are known) and a ``ping``, the blocks' events,
        ``message_delta`` and ``message_stop``; an ``error`` event if the run fails."""
        started = False
        try:
            async for _, out in self.run.outputs():
                events = self.take(out)
                chunk = "".join(_event(e["type"], e) for e in events)
                if not started:
                    started = True
                    start = {"type": "message_start", "message": self.message([], None, None)}
                    chunk = _event("message_start", start) + _event("ping", {"type": "ping"}) + chunk
                if chunk:
                    yield chunk
            stop = await self.stop_sequence()
            has_calls = any(b["type"] == "tool_use" for b in self.blocks.blocks)
            delta = {"type": "message_delta", "usage": self.usage(),
                     "delta": {"stop_reason": stop_reason(self.finish_reason, has_calls, stop), "stop_sequence": stop}}
            yield "".join(_event(e["type"], e) for e in self.blocks.close()) + _event("message_delta", delta) \
                + _event("message_stop", {"type": "message_stop"})
        except APIError as err:
            yield _event("error", error_body(err.status, err.message))


def _note_thinking(service: ModelService) -> None:
    if service.model_name not in _thinking_noted:
        _thinking_noted.add(service.model_name)
        log.info("thinking is ignored for %s: its chat template writes no <think> blocks", service.model_name)


async def create_message(service: ModelService, req: AnthropicMessagesRequest, chat: ChatCompletionRequest,
                         request: Request) -> Response:
    """Answer POST /v1/messages, given ``chat``: ``chat_request(req)`` (made off the event loop)."""
    built = await until_disconnected(request.receive, build_request(service, chat))
    if built is None:  # the client left while its prompt and grammar were prepared
        return Response(status_code=499)
    fmt, jobs = chat_format(service, built, chat), built.jobs
    if req.thinking is not None and req.thinking.type == "enabled" and not fmt.reasoning:
        _note_thinking(service)
    message_id = _id("msg")
    streams = await submit_jobs(service, jobs, message_id)
    run = MessageRun(service, req, fmt, jobs[0], Run(service, fmt, chat, jobs, streams, message_id))
    return await answer(service, streams, run, req.stream, request)


async def count_tokens(service: ModelService, chat: ChatCompletionRequest) -> dict[str, int]:
    """Answer POST /v1/messages/count_tokens, given ``chat``: ``chat_request(req)``: the tokens of
    the prompt the same Messages request would have (rendered and counted in a worker)."""
    return {"input_tokens": len(await chat_prompt(service, chat))}
