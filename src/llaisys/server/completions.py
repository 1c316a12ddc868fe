"""/v1/chat/completions and /v1/completions: a checked request handed to the request builder
(``requests.build_request``: prompt ids, configs, grammar; one engine request per choice), the
engine requests submitted, and their outputs turned into OpenAI's responses, whole or streamed
as server-sent events. A chat reply is read for reasoning and tool calls (``reasoning``,
``tool_calls``) as it streams, and whole with the same reader. ``responses`` and ``anthropic``
answer through the same steps (``ChatFormat``, ``submit_jobs``, ``Run``, ``answer``).

A client that goes away ends its requests: a stream's response watches for the disconnect
while it sends, and a whole response races the generation against it; either way the
engine requests are aborted (``ModelService.release``) and their blocks freed within a step.
One that goes away while its prompt is prepared and its grammar compiled stops the compile.

A request whose grammar the library gives up on midway ends with an error (400 naming the
constraint's field, or an error event in a stream), never with text that breaks it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine import AsyncRequestStream, EngineStopped, RequestOutput
from ..generation import SampledToken
from .errors import APIError, bad_request, shutting_down
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from .reasoning import ReasoningParser, ReplyDeltas, ReplyReader
from .requests import EngineRequest, Job, build_request
from .service import ModelService
from .tool_calls import new_parser

log = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0  # what OpenAI reports for a token of probability 0 (JSON has no -inf)


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)  # all of them (whole responses)
    pending: list[SampledToken] = field(default_factory=list)  # not yet sent (streams)
    text_offset: int = 0  # completions: where the next token's text starts
    last: RequestOutput | None = None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _logprob(value: float | None) -> float:
    return MIN_LOGPROB if value is None or value < MIN_LOGPROB else float(value)


class ChatFormat:
    """OpenAI's chat completion objects."""

    prefix, object, chunk_object, prompt_what = "chatcmpl", "chat.completion", "chat.completion.chunk", "messages"

    def __init__(self, service: ModelService, tool_fmt: str | None = None, reasoning: bool = False,
                 parallel_tool_calls: bool = True) -> None:
        self.service = service
        self.tool_fmt = tool_fmt  # the format tool calls are parsed in; None: no tools
        self.reasoning = reasoning  # whether <think> blocks are split off as reasoning_content
        self.max_calls = None if parallel_tool_calls else 1  # calls kept of a reply (the rest dropped)

    def reader(self, job: Job) -> ReplyReader | None:
        """What reads one choice's reply (reasoning, tool calls), or None: the text is all content."""
        if not self.tool_fmt and not self.reasoning:
            return None
        think = ReasoningParser(started=self.service.prompt_opens_think(job.prompt_ids)) if self.reasoning else None
        return ReplyReader(think, new_parser(self.tool_fmt) if self.tool_fmt else None, self.max_calls)

    def logprobs(self, tokens: list[SampledToken], state: ChoiceState) -> dict[str, Any]:
        def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
            text = self.service.token_text(token_id)
            return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(t.token_id, t.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in (t.top_logprobs or [])]} for t in tokens]}

    def first_delta(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
              parts: ReplyDeltas | None = None) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text else {}
        if parts is not None and parts.reasoning:
            delta = {"reasoning_content": parts.reasoning, **delta}
        if parts is not None and parts.calls:
            delta["tool_calls"] = parts.calls
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def choice(self, job: Job, text: str, logprobs: dict | None, finish_reason: str | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reader = self.reader(job)
        if reader is not None:
            reasoning, content, calls = reader.whole(text)
            message["content"] = content
            if self.reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"index": job.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


class CompletionFormat(ChatFormat):
    """OpenAI's (legacy) completion objects."""

    prefix, object, chunk_object, prompt_what = "cmpl", "text_completion", "text_completion", "prompt"

    def logprobs(self, tokens: list[SampledToken], state: ChoiceState) -> dict[str, Any]:
        texts, offsets = [], []
        for t in tokens:
            text = self.service.token_text(t.token_id)
            texts.append(text)
            offsets.append(state.text_offset)
            state.text_offset += len(text)
        tops = []
        for t in tokens:
            top: dict[str, float] = {}
            for i, lp in t.top_logprobs or []:
                top.setdefault(self.service.token_text(i), _logprob(lp))
            tops.append(top)
        return {"tokens": texts, "token_logprobs": [_logprob(t.logprob) for t in tokens], "top_logprobs": tops,
                "text_offset": offsets}

    def first_delta(self, index: int) -> dict[str, Any] | None:
        return None

    def delta(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
              parts: ReplyDeltas | None = None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def choice(self, job: Job, text: str, logprobs: dict | None, finish_reason: str | None) -> dict[str, Any]:
        return self.delta(job.index, text, logprobs, finish_reason)


# ---- entry points ---------------------------------------------------------------------------
async def chat_completion(service: ModelService, req: ChatCompletionRequest, request: Request) -> Response:
    """Answer POST /v1/chat/completions."""
    built = await until_disconnected(request.receive, build_request(service, req))
    if built is None:  # the client left while its prompt and grammar were prepared
        return Response(status_code=499)
    return await _respond(service, chat_format(service, built, req), req, built.jobs, request)


async def completion(service: ModelService, req: CompletionRequest, request: Request) -> Response:
    """Answer POST /v1/completions (one prompt or several, n choices each)."""
    built = await until_disconnected(request.receive, build_request(service, req))
    if built is None:  # the client left while its prompts and grammar were prepared
        return Response(status_code=499)
    return await _respond(service, CompletionFormat(service), req, built.jobs, request)


def chat_format(service: ModelService, built: EngineRequest, req: ChatCompletionRequest) -> ChatFormat:
    """How the reply of a built chat request is read and written: tool calls in the template's
    format, reasoning when the template writes it, at most one call without parallel_tool_calls."""
    return ChatFormat(service, built.tool_format, built.reasoning, req.parallel_tool_calls)


async def submit_jobs(service: ModelService, jobs: list[Job], response_id: str) -> list[AsyncRequestStream]:
    """The jobs added to the engine, before any response starts (so a refusal is a plain 400)."""
    streams: list[AsyncRequestStream] = []
    try:
        for job in jobs:
            streams.append(await service.submit(f"{response_id}-{job.index}", job.prompt_ids, job.config,
                                                job.images))
    except BaseException:
        service.release(streams)
        raise
    return streams


async def _respond(service: ModelService, fmt: ChatFormat, req: SamplingRequest, jobs: list[Job],
                   request: Request) -> Response:
    response_id = f"{fmt.prefix}-{uuid.uuid4().hex}"
    streams = await submit_jobs(service, jobs, response_id)
    run = Run(service, fmt, req, jobs, streams, response_id)
    return await answer(service, streams, run, req.stream, request)


async def answer(service: ModelService, streams: Any, run: Any, stream: bool, request: Request) -> Response:
    """The response of a submitted ``run`` (anything with ``events()`` and ``whole()``): its
    events as a stream, or its whole body once done (499 when the client left first). The
    engine streams are released either way."""
    if stream:
        return EventStreamResponse(run.events(), on_close=lambda: service.release(streams))
    try:
        body = await until_disconnected(request.receive, run.whole())
    finally:
        service.release(streams)
    if body is None:  # the client left: nobody reads this
        return Response(status_code=499)
    return JSONResponse(body)


# ---- one response ---------------------------------------------------------------------------
class Run:
    """The outputs of one response's engine requests, turned into its body or its events."""

    def __init__(self, service: ModelService, fmt: ChatFormat, req: SamplingRequest, jobs: list[Job],
                 streams: list[AsyncRequestStream], response_id: str) -> None:
        self.service, self.fmt, self.req, self.jobs, self.streams = service, fmt, req, jobs, streams
        self.id = response_id
        self.created = int(time.time())
        self.want_logprobs = jobs[0].config.logprobs is not None
        self.states = [ChoiceState() for _ in jobs]
        self._merged = Merge(streams)
        # every chunk's envelope up to its choices, as json.dumps writes it (the same bytes)
        self._head = (f'data: {{"id":{_dumps(self.id)},"object":{_dumps(self.fmt.chunk_object)},'
                      f'"created":{self.created},"model":{_dumps(service.model_name)},"choices":')

    def ready(self) -> bool:
        """Whether the next output is here already (it came with the same engine step)."""
        return self._merged.ready()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice, output) pairs as they come, until every choice finished. Raises APIError
        when the server ends the requests (shutdown) or the engine fails."""
        try:
            async for i, out in self._merged:
                if out.error is not None:
                    raise not_enforced(self.jobs[i].grammar_param, out)
                if out.finish_reason == "abort":
                    raise shutting_down()
                self.states[i].last = out
                yield i, out
        except EngineStopped:
            raise APIError(503, self.service.failure(), code="engine_unavailable") from None

    def usage(self) -> dict[str, Any]:
        n = self.req.n
        prompt = sum(len(job.prompt_ids) for job in self.jobs if job.index % n == 0)
        cached = sum(s.last.cached_tokens for job, s in zip(self.jobs, self.states) if job.index % n == 0 and s.last)
        completion = sum(s.last.completion_tokens for s in self.states if s.last)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.service.model_name,
                "choices": choices}

    async def whole(self) -> dict[str, Any]:
        """The non-streamed response body."""
        async for i, out in self.outputs():
            state = self.states[i]
            state.text.append(out.text_delta)
            if out.logprobs:
                state.logprobs += out.logprobs
        choices = []
        for job, state in zip(self.jobs, self.states):
            lp = self.fmt.logprobs(state.logprobs, state) if self.want_logprobs else None
            reason = state.last.finish_reason if state.last else None
            choices.append(self.fmt.choice(job, "".join(state.text), lp, reason))
        return {**self._envelope(self.fmt.object, choices), "usage": self.usage()}

    def _event(self, choices: list[dict[str, Any]], usage: Any = None) -> str:
        """One chunk's event: ``data: {envelope, choices[, usage]}`` (``_head`` is the envelope)."""
        tail = f',"usage":{_dumps(usage)}}}\n\n' if self.req.include_usage else "}\n\n"
        return self._head + _dumps(choices) + tail

    async def events(self) -> AsyncIterator[str]:
        """The server-sent events of a streamed response, ending with ``data: [DONE]``. Text a
        possible stop string holds back is sent once it cannot be one; logprobs go with the
        text of their tokens. Events that are ready together go out as one write: those of the
        outputs of one engine step (the choices of a request), and the last chunk with the
        usage and ``[DONE]``."""
        readers = [self.fmt.reader(job) for job in self.jobs]  # reasoning, tool calls: read as the text streams
        batch: list[str] = []  # events not yet written
        try:
            for job in self.jobs:
                first = self.fmt.first_delta(job.index)
                if first is not None:
                    batch.append(self._event([first]))
            if batch:
                yield "".join(batch)
                batch = []
            async for i, out in self.outputs():
                event = self._chunk(i, out, readers[i])
                if event is not None:
                    batch.append(event)
                if batch and not self.ready() and not all(s.finished for s in self.streams):
                    yield "".join(batch)  # nothing more is here: the rest waits for a step
                    batch = []
            if self.req.include_usage:
                batch.append(self._event([], self.usage()))
        except APIError as err:
            batch.append(err.sse())
        batch.append("data: [DONE]\n\n")
        yield "".join(batch)

    def _chunk(self, i: int, out: RequestOutput, reader: ReplyReader | None) -> str | None:
        """The event of choice ``i``'s output ``out``, or None when it has nothing to send yet."""
        state = self.states[i]
        if out.logprobs:
            state.pending += out.logprobs
        if not out.text_delta and not out.finished:
            return None
        text, parts, reason = out.text_delta, None, out.finish_reason
        if reader is not None:
            parts = reader.read(text, out.finished)
            text = parts.content
            if reader.calls:
                text = text if text.strip() else ""  # blanks between calls are not content
                reason = "tool_calls" if reason == "stop" else reason
            if not (parts or out.finished or (self.want_logprobs and state.pending)):
                return None
        lp = None
        if self.want_logprobs:
            lp, state.pending = self.fmt.logprobs(state.pending, state), []
        return self._event([self.fmt.delta(self.jobs[i].index, text, lp, reason, parts)])


def not_enforced(param: str | None, out: RequestOutput) -> APIError:
    """The 400 of a request whose grammar the library gave up on after ``out``'s tokens."""
    return bad_request(f"{param or 'the constraint'}: the output could not be kept to this constraint (the grammar "
                       f"library gave up after {out.completion_tokens} tokens: {out.error}); no answer is returned",
                       param=param, code="grammar_not_enforced")


class Merge:
    """The outputs of several streams as they come, tagged with the stream's position:
    ``async for i, out in Merge(streams)``."""

    def __init__(self, streams: Sequence[AsyncRequestStream]) -> None:
        self.streams = streams
        self._queue: asyncio.Queue | None = None  # outputs taken from the streams, not yet read

    def ready(self) -> bool:
        """Whether an output is here already (reading it will not wait for a step)."""
        return bool(self._queue is not None and self._queue.qsize()) or any(s.ready() for s in self.streams)

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._merged() if len(self.streams) > 1 else self._single()

    async def _single(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        async for out in self.streams[0]:
            yield 0, out

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue = self._queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncRequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as exc:  # noqa: BLE001  (handed to the reader)
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            left = len(self.streams)
            while left:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield i, item
                left -= item.finished
        finally:
            for task in tasks:
                task.cancel()


async def until_disconnected(receive: Receive, work: Any) -> Any:
    """Run the coroutine ``work``; its result, or None if the client disconnected first
    (``work`` is then cancelled)."""
    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
    if task in done:
        return task.result()
    with suppress(asyncio.CancelledError):
        await task
    return None


class EventStreamResponse(StreamingResponse):
    """A server-sent event stream that stops as soon as the client disconnects (whatever the
    server's ASGI version) and then calls ``on_close`` once, however it ended."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self.stream_response(send))
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({sending, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, listening):
                task.cancel()
            await asyncio.gather(sending, listening, return_exceptions=True)
            with suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.on_close()
        if sending.done() and not sending.cancelled() and sending.exception() is not None:
            exc = sending.exception()
            if not isinstance(exc, OSError):  # OSError: the client went away mid-send
                raise exc
