"""One request on an ``LLMEngine``, streamed token by token: what ``llaisys generate``, ``chat``
and ``bench`` run, through the same engine steps and ``RequestOutput``s the server reads.

    from llaisys.engine import generate, stream
    result = generate(model, "Once upon a time", GenerationConfig(max_new_tokens=32))
    for event in stream(model, "Once upon a time", GenerationConfig(temperature=0.7, seed=1)):
        print(event.text_delta, end="")

Given a model, each call runs on an engine of its own, sized for the request; given an engine
(``LLMEngine(model)``, kept across calls), consecutive requests share its prefix cache, so the
next turn of a chat runs only the blocks the previous turns did not fill.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..generation import GenerationConfig, GenerationResult, StreamEvent, Timings, encode_prompt
from ..generation.chat import chat_prompt
from ..generation.prompts import image_prompt
from .engine import LLMEngine
from .request import RequestOutput

# Called as progress(done, total) after each engine step that ran part of the prompt's uncached tokens.
PrefillProgress = Callable[[int, int], None]

BLOCK_ROUND = 16  # a request's own engine holds its KV in one block of a multiple of this


def engine_for(model, prompt_tokens: int, max_new_tokens: int) -> LLMEngine:
    """An engine of one request on ``model``: KV room for ``prompt_tokens`` + ``max_new_tokens``
    (at most the context) in one block, as a contiguous cache holds them (attention reads one
    run of keys); no prefix cache (nothing comes after it to share it)."""
    context = int(model.config.max_position_embeddings)
    tokens = min(prompt_tokens + max_new_tokens, context)
    tokens = max(-(-tokens // BLOCK_ROUND), 1) * BLOCK_ROUND
    return LLMEngine(model, kv_cache_tokens=tokens, block_size=tokens, max_seqs=1, prefix_caching=False)


class GenerationStream:
    """Iterate for StreamEvents, one per generated token; the last carries the finish reason.

    While and after iterating, ``text``, ``token_ids``, ``finish_reason`` and ``timings`` tell
    the state so far; ``result()`` runs to the end and returns a GenerationResult; ``close()``
    stops early (the request leaves the engine). A model without a tokenizer streams token ids
    with empty text. ``prefill_progress`` is called as ``(done, total)`` while the prompt runs.
    The engine runs this request alone: streams on one engine take turns, one to the end (or
    closed) before the next starts.
    """

    def __init__(self, engine: LLMEngine, prompt_ids: list[int], config: GenerationConfig,
                 prefill_progress: PrefillProgress | None = None, images: Any = None) -> None:
        if engine.has_unfinished():
            raise RuntimeError("this engine is running other requests; a GenerationStream runs one request alone "
                               "(finish or close the previous stream first)")
        self.engine = engine
        self.config = config
        self.prompt_ids = prompt_ids
        self.prefill_progress = prefill_progress
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason = None
        self.timings = Timings(prompt_tokens=len(prompt_ids))
        self.request_id = engine.add_request(None, prompt_ids, config, images)
        self._request = engine.requests[self.request_id]
        self._events = self._run()

    def __iter__(self) -> Iterator[StreamEvent]:
        return self

    def __next__(self) -> StreamEvent:
        return next(self._events)

    def close(self) -> None:
        """Stop early: the request leaves the engine (its blocks stay cached where they can)."""
        self._events.close()
        self.engine.abort(self.request_id)

    def result(self) -> GenerationResult:
        """Run to the end (if not there yet) and return the whole result."""
        for _ in self:
            pass
        assert self.finish_reason is not None
        return GenerationResult(self.text, list(self.token_ids), self.finish_reason,
                                len(self.prompt_ids), self.timings)

    def _next_output(self) -> RequestOutput:
        """Step the engine until it hands this request an output (reporting prefill progress)."""
        seq = self._request.seq
        while True:
            for out in self.engine.step():
                if out.request_id == self.request_id:
                    return out
            if self.prefill_progress is not None and not self.token_ids:
                total = len(self.prompt_ids) - seq.num_cached
                self.prefill_progress(min(seq.num_computed - seq.num_cached, total), total)

    def _run(self) -> Iterator[StreamEvent]:
        t0 = time.perf_counter()
        timings, request = self.timings, self._request
        try:
            while self.finish_reason is None:
                t_step = time.perf_counter()
                out = self._next_output()
                now = time.perf_counter()
                if out.error is not None:
                    raise ValueError(f"the request's grammar could not be enforced: {out.error}")
                if not self.token_ids:
                    timings.cached_tokens = out.cached_tokens
                    timings.prefill_s = timings.ttft_s = now - t0
                    if self.prefill_progress is not None:
                        total = len(self.prompt_ids) - out.cached_tokens
                        self.prefill_progress(total, total)
                else:  # the time the consumer held an event is not decode time
                    timings.decode_s += now - t_step
                self.token_ids.extend(out.token_ids)
                self.text += out.text_delta
                timings.generated_tokens = len(self.token_ids)
                timings.drafted_tokens, timings.accepted_tokens = request.drafted, request.accepted
                if out.finished:
                    self.finish_reason = out.finish_reason
                    timings.total_s = now - t0
                last = len(out.token_ids) - 1  # a verified draft hands several tokens at once
                for i, token in enumerate(out.token_ids):
                    yield StreamEvent(out.text_delta if i == last else "", token,
                                      self.finish_reason if i == last else None)
        finally:
            self.engine.abort(self.request_id)  # a no-op once it finished


def _engine_of(target, prompt_ids: list[int], config: GenerationConfig) -> LLMEngine:
    """``target`` when it is an engine, else an engine of its own for this request."""
    return target if isinstance(target, LLMEngine) else engine_for(target, len(prompt_ids), config.max_new_tokens)


def stream(target, prompt: str | Sequence[int] | np.ndarray, config: GenerationConfig | None = None, *,
           prefill_progress: PrefillProgress | None = None, images: Sequence = ()) -> GenerationStream:
    """Generate from ``prompt`` (text, encoded with the tokenizer's special tokens, or token ids
    (S,)) on ``target`` (a model, or an ``LLMEngine`` whose prefix cache consecutive calls
    share) and stream it: iterate the returned GenerationStream for StreamEvents. ``images``
    (RGB PIL images, for a text prompt to a vision-language model) take the places of the
    image placeholders in the text (``generation.prompts.image_prompt``)."""
    config = config or GenerationConfig()
    model = target.model if isinstance(target, LLMEngine) else target
    placed = None
    if images:
        if not isinstance(prompt, str):
            raise TypeError("images go with a text prompt, whose placeholders say where they sit")
        ids, placed = image_prompt(model, prompt, images)
        ids = encode_prompt(model, ids)
    else:
        ids = encode_prompt(model, prompt)
    return GenerationStream(_engine_of(target, ids, config), ids, config, prefill_progress, placed)


def generate(target, prompt: str | Sequence[int] | np.ndarray, config: GenerationConfig | None = None, *,
             prefill_progress: PrefillProgress | None = None, images: Sequence = ()) -> GenerationResult:
    """Generate from ``prompt`` (text, or token ids (S,)) to the end; returns the text, the
    generated ids, the finish reason ("stop" or "length"), the prompt length and timings.
    ``images`` as ``stream`` takes them."""
    return stream(target, prompt, config, prefill_progress=prefill_progress, images=images).result()


def stream_chat(target, messages: Sequence[dict], config: GenerationConfig | None = None, *,
                prefill_progress: PrefillProgress | None = None) -> GenerationStream:
    """Stream the assistant's reply to ``messages`` (rendered with the chat template; image
    parts {"type": "image", "image": <RGB PIL image>} for a vision-language model); see
    ``stream``. On an engine kept across turns, each turn runs only what earlier ones did not."""
    config = config or GenerationConfig()
    model = target.model if isinstance(target, LLMEngine) else target
    ids, placed = chat_prompt(model, messages)
    return GenerationStream(_engine_of(target, ids, config), ids, config, prefill_progress, placed)


def chat(target, messages: Sequence[dict], config: GenerationConfig | None = None, *,
         prefill_progress: PrefillProgress | None = None) -> GenerationResult:
    """The assistant's reply to ``messages`` as a GenerationResult."""
    return stream_chat(target, messages, config, prefill_progress=prefill_progress).result()
