"""POST /v1/responses: the stateless part of OpenAI's Responses API, over the chat path.

A request is turned into a chat completion request (``input`` text or items into messages,
``instructions`` into a system message first, ``max_output_tokens`` into ``max_tokens``, function
``tools``, ``text.format`` into ``response_format``), built by ``requests.build_request`` and
run as one, and its reply given back as Responses output items:
``reasoning`` (a ``<think>`` block), ``message`` (``output_text``) and ``function_call``.
``input_image`` parts of user messages become the chat's image parts (a vision model's; the
request builder fetches, decodes and limits them, errors naming the Responses field). A
stream sends the Responses events: ``response.created``, ``response.in_progress``, per item
``response.output_item.added`` ... ``response.output_item.done`` with the text, reasoning or
argument deltas between, then ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut it). Nothing is stored: ``previous_response_id``, ``conversation`` and
``background`` are refused.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, ValidationError, field_validator

from .bodies import json_kind
from .completions import ChatFormat, Run, answer, chat_format, submit_jobs, until_disconnected
from .errors import APIError, bad_request, validation_error
from .protocol import IMAGE_DETAILS, MAX_TOOLS, ChatCompletionRequest, FastList, Strict
from .reasoning import ReplyDeltas
from .requests import Job, build_request
from .service import ModelService


class ResponsesRequest(Strict):
    """POST /v1/responses (unknown fields ignored, as elsewhere)."""

    model: str | None = None
    input: str | FastList[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None  # an extension, as vLLM's
    tools: Annotated[FastList[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, v in (value or {}).items():
            if not isinstance(v, str):
                raise ValueError(f"metadata.{key}: values must be strings, got {json_kind(v)}")
        return value


# ---- request: to a chat completion request -----------------------------------------------------
def _part(part: Any, where: str, role: str) -> dict[str, Any]:
    """The chat content part of one Responses content part: text, or for a user message an
    ``input_image`` as an ``image_url`` part."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text"):
        if isinstance(part.get("text"), str):
            return {"type": "text", "text": part["text"]}
        raise bad_request(f"{where}.text: must be a string, got {json_kind(part.get('text'))}", param=f"{where}.text")
    if kind == "input_image":
        if role != "user":
            raise bad_request(f"{where}: input_image parts go in user messages, not in a {role} message", param=where)
        url, detail = part.get("image_url"), part.get("detail") or "auto"
        if url is None and part.get("file_id") is not None:
            raise bad_request(f"{where}.file_id: this server stores no files; send the image as image_url (a data: "
                              "URL, data:image/png;base64,...)", param=f"{where}.file_id")
        if not isinstance(url, str) or not url:
            raise bad_request(f"{where}.image_url: must be the image's URL as a string (data:image/png;base64,...), "
                              f"got {json_kind(url)}", param=f"{where}.image_url")
        if detail not in IMAGE_DETAILS:
            raise bad_request(f"{where}.detail: must be one of {', '.join(IMAGE_DETAILS)}, got {detail!r:.40}",
                              param=f"{where}.detail")
        return {"type": "image_url", "image_url": {"url": url, "detail": detail}}
    what = f"{kind!r} part" if kind is not None else json_kind(part)
    raise bad_request(f"{where}: {what} is not supported; content parts are input_text and input_image", param=where)


def _content(content: list[Any], where: str, role: str, image_fields: list[str]) -> str | list[dict[str, Any]]:
    """A message's chat content: its text parts joined by newlines, or with images the list of
    parts (each image's field appended to ``image_fields``)."""
    parts = [_part(p, f"{where}[{j}]", role) for j, p in enumerate(content)]
    images = [f"{where}[{j}]" for j, p in enumerate(parts) if p["type"] == "image_url"]
    if not images:
        return "\n".join(p["text"] for p in parts)
    image_fields += images
    return parts


def _messages(req: ResponsesRequest, image_fields: list[str]) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``; the fields of their images are
    appended to ``image_fields``, in order."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    if not req.input:
        raise bad_request("input: give text or a non-empty list of items", param="input")
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role, content = item.get("role"), item.get("content")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role: must be user, system, developer or assistant, got {role!r}",
                                  param=f"{where}.role")
            if isinstance(content, list):
                content = _content(content, f"{where}.content", role, image_fields)
            if not isinstance(content, (str, list)):
                raise bad_request(f"{where}.content: must be text or a list of content parts", param=f"{where}.content")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output, ensure_ascii=False)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise bad_request(f"{where}.type: {kind!r} items are not supported (message, function_call, "
                              "function_call_output, reasoning)", param=f"{where}.type")
    return messages


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}].type: only function tools are supported, got {tool.get('type')!r}",
                              param=f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        tools.append({"type": "function", "function": fn})
    return tools


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """The chat ``response_format`` of ``text.format`` (None: plain text)."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f"text.format: must be an object such as {{'type': 'json_schema', 'name': ..., 'schema': "
                          f"...}}, got {json_kind(fmt)}", param="text.format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that answers ``req``; 400 for what the server cannot do."""
    for name in ("previous_response_id", "conversation"):
        if getattr(req, name) is not None:
            raise bad_request(f"{name}: this server keeps no responses (the Responses API is served stateless); "
                              "send the whole conversation as input", param=name)
    if req.background:
        raise bad_request("background: not supported by this server", param="background")
    choice: Any = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice: must be none, auto, required or {'type': 'function', 'name': ...}",
                              param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    image_fields: list[str] = []
    body = {"model": req.model, "messages": _messages(req, image_fields), "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "tools": _tools(req),
            "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req), "stream": req.stream}
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None
    return chat.name_images(image_fields)


# ---- response: output items -------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" \
        else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponseRun:
    """One Responses request's run: its body, or its events."""

    def __init__(self, service: ModelService, req: ResponsesRequest, chat: ChatCompletionRequest, fmt: ChatFormat,
                 job: Job, run: Run) -> None:
        self.service, self.req, self.chat, self.fmt, self.job, self.run = service, req, chat, fmt, job, run
        self.created = int(time.time())
        self.seq = itertools.count()

    def envelope(self, status: str, output: list[dict[str, Any]], finish_reason: str | None = None) -> dict[str, Any]:
        usage = None
        if status != "in_progress":
            u = self.run.usage()
            usage = {"input_tokens": u["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u["total_tokens"]}
        req = self.req
        return {"id": self.run.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "model": self.service.model_name, "output": output, "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
                "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
                "metadata": req.metadata or {}, "store": False, "previous_response_id": None, "background": False}

    @staticmethod
    def status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    async def whole(self) -> dict[str, Any]:
        """The non-streamed response body."""
        text, reason = [], None
        async for _, out in self.run.outputs():
            text.append(out.text_delta)
            reason = out.finish_reason or reason
        reader = self.fmt.reader(self.job)
        reasoning, content, calls = reader.whole("".join(text)) if reader is not None else (None, "".join(text), [])
        output: list[dict[str, Any]] = []
        if reasoning:
            output.append(reasoning_item(_id("rs"), reasoning))
        if content or not (calls or reasoning):
            output.append(message_item(_id("msg"), content or ""))
        output += [call_item(_id("fc"), c.id, c.name, c.arguments) for c in calls]
        return self.envelope(self.status(reason), output, reason)

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": next(self.seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """The server-sent events of a streamed response."""
        output: list[dict[str, Any]] = []
        current: dict[str, Any] | None = None  # the open item: kind, id, index, text, and for calls call_id, name
        yield self.event("response.created", response=self.envelope("in_progress", []))
        yield self.event("response.in_progress", response=self.envelope("in_progress", []))

        def close() -> list[str]:
            nonlocal current
            if current is None:
                return []
            c, current = current, None
            where = {"item_id": c["id"], "output_index": c["index"]}
            if c["kind"] == "message":
                item = message_item(c["id"], c["text"])
                part = item["content"][0]
                events = [self.event("response.output_text.done", **where, content_index=0, text=c["text"],
                                     logprobs=[]),
                          self.event("response.content_part.done", **where, content_index=0, part=part)]
            elif c["kind"] == "reasoning":
                item = reasoning_item(c["id"], c["text"])
                events = [self.event("response.reasoning_text.done", **where, content_index=0, text=c["text"])]
            else:
                item = call_item(c["id"], c["call_id"], c["name"], c["text"])
                events = [self.event("response.function_call_arguments.done", **where, arguments=c["text"])]
            output.append(item)
            return events + [self.event("response.output_item.done", output_index=c["index"], item=item)]

        def open_item(kind: str, **extra: Any) -> list[str]:
            nonlocal current
            events = close()
            prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
            current = {"kind": kind, "id": _id(prefix), "index": len(output), "text": "", **extra}
            if kind == "message":
                item = message_item(current["id"], "", "in_progress")
            elif kind == "reasoning":
                item = reasoning_item(current["id"], "", "in_progress")
            else:
                item = call_item(current["id"], extra["call_id"], extra["name"], "", "in_progress")
            events.append(self.event("response.output_item.added", output_index=current["index"], item=item))
            if kind == "message":
                events.append(self.event("response.content_part.added", item_id=current["id"],
                                         output_index=current["index"], content_index=0,
                                         part={"type": "output_text", "text": "", "annotations": [],
                                               "logprobs": []}))
            return events

        def emit(parts: ReplyDeltas, has_calls: bool) -> list[str]:
            events: list[str] = []
            if parts.reasoning:
                if current is None or current["kind"] != "reasoning":
                    events += open_item("reasoning")
                current["text"] += parts.reasoning
                events.append(self.event("response.reasoning_text.delta", item_id=current["id"],
                                         output_index=current["index"], content_index=0, delta=parts.reasoning))
            text = parts.content
            if text and (text.strip() or (current is not None and current["kind"] == "message")) \
                    and not (has_calls and not text.strip()):
                if current is None or current["kind"] != "message":
                    events += open_item("message")
                current["text"] += text
                events.append(self.event("response.output_text.delta", item_id=current["id"],
                                         output_index=current["index"], content_index=0, delta=text, logprobs=[]))
            for c in parts.calls:
                if "id" in c:
                    events += open_item("function_call", call_id=c["id"], name=c["function"]["name"])
                fragment = c["function"].get("arguments") or ""
                if fragment and current is not None and current["kind"] == "function_call":
                    current["text"] += fragment
                    events.append(self.event("response.function_call_arguments.delta", item_id=current["id"],
                                             output_index=current["index"], delta=fragment))
            return events

        reader = self.fmt.reader(self.job)
        reason = None
        try:
            async for _, out in self.run.outputs():
                if reader is None:
                    parts = ReplyDeltas(content=out.text_delta)
                else:
                    parts = reader.read(out.text_delta, out.finished)
                for e in emit(parts, bool(reader is not None and reader.calls)):
                    yield e
                reason = out.finish_reason or reason
            if not output and current is None:  # nothing at all: an empty message, as the whole response has
                for e in open_item("message"):
                    yield e
            for e in close():
                yield e
            status = self.status(reason)
            kind = "response.completed" if status == "completed" else "response.incomplete"
            yield self.event(kind, response=self.envelope(status, output, reason))
        except APIError as err:
            yield self.event("error", code=err.code, message=err.message, param=err.param)


async def create_response(service: ModelService, req: ResponsesRequest, chat: ChatCompletionRequest,
                          request: Request) -> Response:
    """Answer POST /v1/responses, given ``chat``: ``chat_request(req)`` (made off the event loop)."""
    built = await until_disconnected(request.receive, build_request(service, chat))
    if built is None:  # the client left while its prompt and grammar were prepared
        return Response(status_code=499)
    fmt, jobs = chat_format(service, built, chat), built.jobs
    response_id = _id("resp")
    streams = await submit_jobs(service, jobs, response_id)
    run = ResponseRun(service, req, chat, fmt, jobs[0], Run(service, fmt, chat, jobs, streams, response_id))
    return await answer(service, streams, run, req.stream, request)
