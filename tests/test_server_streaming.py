"""The streaming path from the engine thread to the SSE bytes, without a model: one event-loop
wake-up per engine step, the step-time record, chunks written as json.dumps writes them, and
the events of one step (and the end of a stream) coalesced into one write."""
from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

from llaisys.engine import EngineThread, RequestOutput
from llaisys.engine.request import RequestTimes
from llaisys.engine.thread import AsyncRequestStream
from llaisys.generation import GenerationConfig
from llaisys.server.completions import ChatFormat, CompletionFormat, Job, Run
from llaisys.server.metrics import Metrics
from llaisys.server.protocol import ChatCompletionRequest, CompletionRequest


class FakeEngine:
    """What EngineThread needs of an LLMEngine: each step gives every request one token, once
    ``expected`` requests are in; a request finishes after ``tokens``."""

    def __init__(self, expected: int, tokens: int = 3) -> None:
        self.expected, self.tokens = expected, tokens
        self.requests: dict[str, int] = {}
        self.added = 0
        self.prompt_tokens = 0

    def add_request(self, request_id, prompt, config) -> str:
        rid = request_id or f"r{self.added}"
        self.requests[rid] = 0
        self.added += 1
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.added < self.expected:
            return []
        outputs = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            done = self.requests[rid] == self.tokens
            if done:
                del self.requests[rid]
            outputs.append(RequestOutput(rid, "x", [1], None, done, "length" if done else None, 2,
                                         self.tokens, 0, RequestTimes()))
        return outputs

    def abort(self, request_id):
        self.requests.pop(request_id, None)
        return None


def test_one_wakeup_per_step_and_step_record():
    n, tokens = 4, 3
    thread = EngineThread(FakeEngine(n, tokens))
    seen: list[tuple[list, float]] = []
    thread.on_step = lambda outputs, seconds: seen.append((outputs, seconds))

    async def main() -> tuple[list[list[str]], int]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            nonlocal wakeups
            wakeups += getattr(callback, "__name__", "") == "_deliver_all"
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        streams = [await thread.submit_async([1, 2], GenerationConfig()) for _ in range(n)]
        texts = [[out.text_delta async for out in s] for s in streams]
        return texts, wakeups

    try:
        texts, wakeups = asyncio.run(main())
    finally:
        thread.stop()
    assert texts == [["x"] * tokens] * n
    steps = [r for r in thread.step_log if r.outputs]
    assert len(steps) == tokens and all(r.outputs == n and r.prompt_tokens == 0 for r in steps)
    assert wakeups == tokens  # one per step, not one per output
    assert thread.steps >= tokens and thread.step_seconds >= 0
    assert all(seconds >= 0 for _, seconds in seen)


def test_metrics_record_step_time():
    metrics = Metrics("m")
    metrics.on_step([], 0.042)
    text = metrics.render().decode()
    assert 'llaisys:engine_step_seconds_count{model_name="m"} 1.0' in text
    assert 'llaisys:engine_step_seconds_sum{model_name="m"} 0.042' in text


def _service(name: str = "módel") -> SimpleNamespace:
    return SimpleNamespace(model_name=name, failure=lambda: "stopped", token_text=lambda i: str(i),
                           prompt_opens_think=lambda ids: False)


def _out(rid: str, text: str, finished: bool = False, tokens: int = 1) -> RequestOutput:
    return RequestOutput(rid, text, [1], None, finished, "length" if finished else None, 3, tokens, 0,
                         RequestTimes())


def _run(fmt_cls, req, n: int) -> tuple[Run, list[AsyncRequestStream]]:
    service = _service()
    streams = [AsyncRequestStream(None, f"cmpl-1-{i}") for i in range(n)]
    jobs = [Job(i, [1, 2, 3], GenerationConfig()) for i in range(n)]
    return Run(service, fmt_cls(service), req, jobs, streams, "cmpl-1"), streams


def test_chunks_are_json_dumps_of_the_envelope():
    async def main() -> None:
        for usage in (False, True):
            req = CompletionRequest(prompt="hi", stream=True, stream_options={"include_usage": True} if usage else None)
            run, _ = _run(CompletionFormat, req, 1)
            choices = [{"index": 0, "text": "é\n\"", "logprobs": None, "finish_reason": None}]
            body = {"id": run.id, "object": "text_completion", "created": run.created, "model": "módel",
                    "choices": choices}
            if usage:
                body["usage"] = {"prompt_tokens": 3}
            expected = f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
            assert run._event(choices, {"prompt_tokens": 3} if usage else None) == expected

    asyncio.run(main())


def test_events_of_one_step_go_out_together():
    async def main() -> tuple[list[str], list[str]]:
        req = CompletionRequest(prompt="hi", stream=True, n=2, stream_options={"include_usage": True})
        run, streams = _run(CompletionFormat, req, 2)
        events = run.events()
        writes = []
        for s in streams:  # step 1: a token for each choice
            s.deliver(_out(s.request_id, "a"))
        writes.append(await events.__anext__())
        for s in streams:  # step 2: the last tokens
            s.deliver(_out(s.request_id, "b", finished=True, tokens=2))
        writes += [w async for w in events]
        return writes, [run._event([], run.usage())]

    writes, usage = asyncio.run(main())
    assert len(writes) == 2  # one write per step; the last with the usage and [DONE]
    events = [e + "\n\n" for w in writes for e in w.split("\n\n") if e]
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert [(p["choices"][0]["index"], p["choices"][0]["text"]) for p in payloads[:4]] == \
        [(0, "a"), (1, "a"), (0, "b"), (1, "b")]
    assert events[-2] == usage[0] and events[-1] == "data: [DONE]\n\n"


def test_chat_first_deltas_then_tokens():
    async def main() -> list[str]:
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True, n=2)
        run, streams = _run(ChatFormat, req, 2)
        events = run.events()
        writes = [await events.__anext__()]  # the role deltas, before any token
        for s in streams:
            s.deliver(_out(s.request_id, "a", finished=True))
        writes += [w async for w in events]
        return writes

    writes = asyncio.run(main())
    assert len(writes) == 2
    first = [json.loads(e[6:]) for e in writes[0].split("\n\n") if e]
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}] * 2
    assert writes[1].endswith("data: [DONE]\n\n") and writes[1].count("data: ") == 3
