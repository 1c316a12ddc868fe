"""One request inside the engine: its sequence, its own sampler and text stream, its timings,
and the outputs it hands back step by step."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from ..generation import GenerationConfig, Sampler
from ..generation.results import SampledToken
from ..generation.text_stream import TextStream
from .scheduler import Sequence

EngineFinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class RequestTimes:
    """perf_counter instants of one request's life (0.0 until reached)."""

    arrival: float = 0.0
    first_scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    finished: float = 0.0

    @property
    def queue_s(self) -> float:
        """Arrival to first scheduled."""
        return max(self.first_scheduled - self.arrival, 0.0)

    @property
    def ttft_s(self) -> float:
        """Arrival to first token."""
        return max(self.first_token - self.arrival, 0.0)

    @property
    def e2e_s(self) -> float:
        """Arrival to finish."""
        return max(self.finished - self.arrival, 0.0)


@dataclass(slots=True)
class RequestOutput:
    """What one step did for one request: the new tokens, the text they release (may be ""
    while a character or a possible stop string is held back), their logprobs when asked,
    and on the last output the finish reason ("stop", "length" or "abort")."""

    request_id: str
    text_delta: str
    token_ids: list[int]
    logprobs: list[SampledToken] | None
    finished: bool
    finish_reason: EngineFinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    times: RequestTimes = field(default_factory=RequestTimes)


class Request:
    """Engine-side state of one request."""

    __slots__ = ("request_id", "seq", "config", "sampler", "text", "times", "finish_reason")

    def __init__(self, request_id: str, prompt_ids: list[int], config: GenerationConfig, max_tokens: int,
                 tokenizer, eos: set[int]) -> None:
        self.request_id = request_id
        self.config = config
        self.seq = Sequence(request_id, list(prompt_ids), max_tokens)
        self.sampler = Sampler(config, stop_token_ids=eos)
        self.text = TextStream(tokenizer, prompt_ids, config.stop, eos, max_tokens, config.skip_special_tokens)
        self.times = RequestTimes(arrival=time.perf_counter())
        self.finish_reason: EngineFinishReason | None = None

    def take(self, logits) -> RequestOutput:
        """Pick the next token from ``logits`` (V,), append it, and say what it released."""
        seq = self.seq
        picked = self.sampler.sample(logits, seq.token_ids, seq.output_ids)
        seq.output_ids.append(picked.token_id)
        delta = self.text.push(picked.token_id)
        now = time.perf_counter()
        if not self.times.first_token:
            self.times.first_token = now
        self.times.last_token = now
        self.finish_reason = self.text.finish_reason
        if self.finish_reason is not None:
            self.times.finished = now
        return self.output(delta, [picked.token_id], [picked] if self.config.logprobs is not None else None)

    def abort(self) -> RequestOutput:
        """Finish now with reason "abort"."""
        self.finish_reason = "abort"
        self.times.finished = time.perf_counter()
        return self.output("", [], None)

    def output(self, delta: str, tokens: list[int], logprobs: list[SampledToken] | None) -> RequestOutput:
        seq = self.seq
        return RequestOutput(self.request_id, delta, tokens, logprobs, self.finish_reason is not None,
                             self.finish_reason, len(seq.prompt_ids), len(seq.output_ids), seq.num_cached,
                             self.times)
