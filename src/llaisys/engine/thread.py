"""The engine loop in its own thread, fed through a queue, so callers on other threads (an HTTP
server's, a CLI's) submit requests and read their outputs while steps keep running.

Every touch of the engine happens on the loop's thread: ``submit`` and ``abort`` post a
command and wait for the loop to run it between two steps (at most one step's time), so a
bad request is refused to its caller at once with the engine's own error.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..generation import GenerationConfig
from .engine import LLMEngine
from .request import RequestOutput

if TYPE_CHECKING:
    from ..models.multimodal.tower import PromptImages

log = logging.getLogger(__name__)

STEP_LOG = 4096  # recent steps kept in EngineThread.step_log


@dataclass(slots=True, frozen=True)
class StepRecord:
    """One ``engine.step()`` as the engine thread saw it."""

    start: float  # time.perf_counter() when the step began
    end: float  # and when it returned
    outputs: int  # requests that picked a token (or finished) in the step
    prompt_tokens: int  # prompt tokens the step computed (0: a decode-only step)

    @property
    def seconds(self) -> float:
        """The step's wall time (forward pass, sampling, detokenizing)."""
        return self.end - self.start


class EngineStopped(RuntimeError):
    """The engine loop has stopped (shut down, or failed: the message says why)."""


class RequestStream:
    """The outputs of one request, in order. Iterate to block for each one; the last has
    ``finished`` set. ``close()`` aborts the request (its blocks are freed within one step)."""

    def __init__(self, loop: "EngineThread", request_id: str) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.finished = False

    def push(self, item: "RequestOutput | BaseException") -> None:
        """Called by the engine thread with each output (or the error that ended the loop)."""
        self._queue.put(item)

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> RequestOutput:
        if self.finished:
            raise StopIteration
        return self._take(self._queue.get())

    def _take(self, item: "RequestOutput | BaseException") -> RequestOutput:
        """The next output read: ``item``, or raised when it is the error that ended the request."""
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request if it is still going."""
        if not self.finished:
            self.finished = True
            self._loop.abort(self.request_id)


class AsyncRequestStream(RequestStream):
    """A RequestStream for asyncio: ``async for out in stream`` on the event loop it was made on."""

    def __init__(self, loop: "EngineThread", request_id: str) -> None:
        super().__init__(loop, request_id)
        self._event_loop = asyncio.get_running_loop()
        self._items: deque[RequestOutput | BaseException] = deque()  # delivered, not yet read
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits

    def push(self, item: "RequestOutput | BaseException") -> None:
        post(self._event_loop, [(self, item)])

    def deliver(self, item: "RequestOutput | BaseException") -> None:
        """Hand ``item`` to the reader (on the stream's event loop)."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def ready(self) -> bool:
        """Whether the next output is here already (reading it will not wait for a step)."""
        return bool(self._items)

    def __aiter__(self) -> "AsyncRequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = self._event_loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take(self._items.popleft())


def _deliver_all(items: list[tuple[AsyncRequestStream, "RequestOutput | BaseException"]]) -> None:
    for stream, item in items:
        stream.deliver(item)


def post(event_loop: asyncio.AbstractEventLoop,
         items: list[tuple[AsyncRequestStream, "RequestOutput | BaseException"]]) -> None:
    """Deliver ``items`` to their streams on ``event_loop``: one wake-up of the loop for all of
    them (each wake-up is a write to the loop's self-pipe and a GIL hand-off). A closed loop
    has no reader left: the items are dropped."""
    try:
        event_loop.call_soon_threadsafe(_deliver_all, items)
    except RuntimeError:  # the loop is closed
        pass


class EngineThread:
    """Runs ``engine.step()`` in a daemon thread while requests are in; sleeps when idle."""

    def __init__(self, engine: LLMEngine, name: str = "llaisys-engine") -> None:
        self.engine = engine
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self.error: BaseException | None = None
        # called on the engine thread after each step with its outputs and its seconds (e.g. metrics)
        self.on_step: Callable[[list[RequestOutput], float], None] | None = None
        self.steps = 0  # steps run, and their seconds in all
        self.step_seconds = 0.0
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG)  # the most recent steps
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ---- called from any thread --------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the engine thread between steps; its result or error in the Future."""
        future: Future = Future()
        with self._wake:
            if self._stopping or self.error is not None:
                future.set_exception(EngineStopped(self._why()))
                return future
            self._commands.append((fn, future))
            self._wake.notify()
        return future

    def submit(self, prompt: "str | Sequence[int]", config: GenerationConfig | None = None,
               request_id: str | None = None, stream_type: type[RequestStream] = RequestStream,
               images: "PromptImages | None" = None) -> RequestStream:
        """Add a request; returns its stream. ``images``: where the prompt's image rows go
        (``VisionTower.place``, encoded before the call, off this thread). Raises what
        ``LLMEngine.add_request`` raises."""
        stream = stream_type(self, request_id or "")
        return self.call(self._adding(stream, prompt, config, request_id, images)).result()

    async def submit_async(self, prompt: "str | Sequence[int]", config: GenerationConfig | None = None,
                           request_id: str | None = None, images: "PromptImages | None" = None) -> AsyncRequestStream:
        """``submit`` for asyncio code: returns an AsyncRequestStream without blocking the event loop."""
        stream = AsyncRequestStream(self, request_id or "")
        return await asyncio.wrap_future(self.call(self._adding(stream, prompt, config, request_id, images)))

    def _adding(self, stream: RequestStream, prompt: "str | Sequence[int]", config: GenerationConfig | None,
                request_id: str | None, images: "PromptImages | None" = None) -> Callable[[], RequestStream]:
        """The command that adds the request to the engine and gives ``stream`` its outputs (run
        on the engine thread by ``call``)."""
        def add() -> RequestStream:
            if images is None:  # an engine-like object that takes no images still serves text
                rid = self.engine.add_request(request_id, prompt, config)
            else:
                rid = self.engine.add_request(request_id, prompt, config, images)
            self._streams[rid] = stream
            stream.request_id = rid
            return stream

        return add

    def abort(self, request_id: str) -> None:
        """Abort a request (no wait); its stream gets a last output with reason "abort"."""
        def drop() -> None:
            out = self.engine.abort(request_id)
            stream = self._streams.pop(request_id, None)
            if out is not None and stream is not None:
                stream.push(out)

        self.call(drop)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop: running requests end with reason "abort", then the engine's ``close``
        writes its prefix cache's queued blocks (at most 5 s); waits up to ``timeout`` s."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    # ---- the loop ----------------------------------------------------------------------
    def _why(self) -> str:
        return f"the engine failed: {self.error!r}" if self.error is not None else "the engine has stopped"

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._commands and not self._stopping and not self.engine.has_unfinished():
                        self._wake.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                for fn, future in commands:
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001  (handed to the caller)
                        future.set_exception(exc)
                if stopping:
                    break
                if self.engine.has_unfinished():
                    prompt_before = getattr(self.engine, "prompt_tokens", 0)
                    start = time.perf_counter()
                    outputs = self.engine.step()
                    end = time.perf_counter()
                    self._record(start, end, len(outputs), getattr(self.engine, "prompt_tokens", 0) - prompt_before)
                    if self.on_step is not None:  # before the readers wake: they would hold the GIL meanwhile
                        self.on_step(outputs, end - start)
                    self._dispatch(outputs)
        except BaseException as exc:  # noqa: BLE001  (a failed step ends every request with the reason)
            log.exception("the engine loop failed")
            self.error = exc
        finally:
            self._shutdown()

    def _record(self, start: float, end: float, outputs: int, prompt_tokens: int) -> None:
        self.steps += 1
        self.step_seconds += end - start
        self.step_log.append(StepRecord(start, end, outputs, prompt_tokens))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop for the whole
        step, not one per output, so a step of 16 requests costs the event loop one hand-off."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            if isinstance(stream, AsyncRequestStream):
                batches.setdefault(stream._event_loop, []).append((stream, out))
            else:
                stream.push(out)
        for event_loop, items in batches.items():
            post(event_loop, items)

    def _shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            pending = list(self._commands)
            self._commands.clear()
        for _, future in pending:
            future.set_exception(EngineStopped(self._why()))
        for rid, stream in list(self._streams.items()):
            if self.error is not None:
                stream.push(EngineStopped(self._why()))
            else:
                out = self.engine.abort(rid)
                stream.push(out if out is not None else EngineStopped(self._why()))
        self._streams.clear()
        close = getattr(self.engine, "close", None)  # the prefix cache's disk writer: its queue written
        if close is not None:
            try:
                close(5.0)
            except Exception:  # noqa: BLE001  (stopping goes on)
                log.exception("closing the engine failed")
