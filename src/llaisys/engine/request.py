"""One request inside the engine: its sequence, its own sampler and text stream, its timings,
and the outputs it hands back step by step."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..generation import GenerationConfig, Sampler
from ..generation.processors import penalties_apply
from ..generation.results import SampledToken
from ..generation.text_stream import TextStream
from .grammar import GrammarMatcher, MaskBatch, grammar_of
from .pooling import Pooler, pooling_of
from .scheduler import Sequence
from .thinking import ThinkingBudget, close_ids

log = logging.getLogger(__name__)

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
    and on the last output the finish reason ("stop", "length" or "abort"). A request whose
    grammar could not be enforced (the library gave up midway) ends with "abort" and ``error``
    saying why: its text does not follow the grammar."""

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
    embedding: np.ndarray | None = None  # (D,) float32: the pooled hidden states of an embedding request
    error: str | None = None  # why the request failed (its grammar could not be enforced), on its last output

    def then(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by ``later`` of the same request and step (the tokens of an
        accepted speculative draft): deltas, tokens and logprobs joined, the later state kept."""
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        return RequestOutput(self.request_id, self.text_delta + later.text_delta, self.token_ids + later.token_ids,
                             logprobs, later.finished, later.finish_reason, later.prompt_tokens,
                             later.completion_tokens, later.cached_tokens, later.times, later.embedding, later.error)


class Request:
    """Engine-side state of one request."""

    __slots__ = ("request_id", "seq", "config", "sampler", "text", "times", "finish_reason", "matcher", "eos",
                 "pooler", "device_rng", "drafted", "accepted", "error", "images", "thinking")

    def __init__(self, request_id: str, prompt_ids: list[int], config: GenerationConfig, max_tokens: int,
                 tokenizer, eos: set[int]) -> None:
        self.request_id = request_id
        self.config = config
        self.seq = Sequence(request_id, list(prompt_ids), max_tokens)
        self.sampler = Sampler(config, stop_token_ids=eos)
        self.text = TextStream(tokenizer, prompt_ids, config.stop, eos, max_tokens, config.skip_special_tokens)
        self.times = RequestTimes(arrival=time.perf_counter())
        self.finish_reason: EngineFinishReason | None = None
        self.eos = np.array(sorted(eos), dtype=np.int64)  # (E,)
        grammar = grammar_of(config)
        self.matcher: GrammarMatcher | None = grammar.matcher() if grammar is not None else None
        pooling = pooling_of(config)
        self.pooler = Pooler(pooling, len(prompt_ids)) if pooling is not None else None
        self.device_rng = None  # its generator on the model's device, made at its first draw there
        self.drafted = 0  # speculative decoding: draft tokens run, and those that held
        self.accepted = 0
        self.error: str | None = None  # why its grammar could not be enforced
        self.images = None  # the rows of its prompt's image tokens (PromptImages), if any
        # its reasoning budget (None: unlimited); a grammar decides every token itself, so it has none
        self.thinking = (ThinkingBudget(config, close_ids(config.reasoning_end, tokenizer))
                         if config.reasoning_budget is not None and self.matcher is None else None)

    def device_pickable(self, allowed: np.ndarray | None) -> bool:
        """Whether this step's token may be picked on the model's device (``prepare`` done):
        argmax, or temperature, top-k and top-p only; no grammar mask (``allowed``), no
        penalty or min-tokens mask that applies now, no logprobs, no min-p."""
        c, seq = self.config, self.seq
        if allowed is not None or c.logprobs is not None or penalties_apply(
                seq.token_ids, seq.output_ids, repetition=c.repetition_penalty, presence=c.presence_penalty,
                frequency=c.frequency_penalty, stop_token_ids=self.sampler.stop_token_ids, min_tokens=c.min_tokens):
            return False
        return c.greedy or (c.min_p == 0.0 and c.min_tokens_to_keep == 1)

    def penalized_context(self) -> list[int]:
        """The ids the repetition penalty counts (prompt and generated), or [] when it is off
        (1.0) and nothing reads them: the sampler's ``context_ids``."""
        return self.seq.token_ids if self.config.repetition_penalty != 1.0 else []

    def allowed(self, mask: np.ndarray, vocab: int) -> np.ndarray:
        """The tokens (vocab,) bool this request may pick next, from its grammar's bitmask (W,):
        its end-of-sequence ids only where the grammar is complete (none at all when the library
        gave up: ``prepare`` then ends the request with an error)."""
        allowed = MaskBatch.allowed(mask, vocab).copy()  # (vocab,)
        eos = self.eos[self.eos < vocab]
        allowed[eos] = self.matcher is None or self.matcher.accepting
        return allowed

    def take(self, logits, allowed: np.ndarray | None = None) -> RequestOutput:
        """Pick the next token from ``logits`` (V,) (among ``allowed`` (V,) bool, a grammar's
        mask, when given), append it, and say what it released: ``prepare``, this request's
        sampler, then ``accept`` (the engine samples a whole step's requests at once between the
        two)."""
        out = self.prepare(allowed)
        if out is not None:
            return out
        seq = self.seq
        return self.accept(self.sampler.sample(logits, seq.token_ids, seq.output_ids, allowed=allowed))

    def prepare(self, allowed: np.ndarray | None = None) -> RequestOutput | None:
        """Get ready to pick among ``allowed`` (V,) bool (a grammar's mask, or None): None when a
        token is to be picked, else the request's last output: an error when its grammar allows
        nothing, not even an end (the library gave up on it)."""
        if allowed is not None and not allowed.any():
            failure = self.matcher.failure if self.matcher is not None else None
            self._fail(failure or "the grammar allows no next token")
            return self.output("", [], None)
        if allowed is not None and len(self.seq.output_ids) < self.config.min_tokens:
            eos = self.eos[self.eos < allowed.shape[0]]
            if np.count_nonzero(allowed) == np.count_nonzero(allowed[eos]):
                # the grammar can only end here: min_tokens gives way (it would mask every token)
                self.sampler.config = self.config = self.config.replace(min_tokens=0)
        return None

    def accept(self, picked: SampledToken) -> RequestOutput:
        """Append the token ``picked`` by this request's sampler (or the one its reasoning budget
        forces instead), and say what it released."""
        if self.thinking is not None:
            picked = self.thinking.pick(picked)
        seq = self.seq
        seq.output_ids.append(picked.token_id)
        delta = self.text.push(picked.token_id)
        failure = None
        if self.matcher is not None and self.text.finish_reason is None:
            assert self.matcher.consumed == len(seq.output_ids) - 1, "the matcher lost track of the sequence"
            self.matcher.consume(picked.token_id)
            failure = self.matcher.failure
            if failure is None and self.matcher.done:  # the grammar takes nothing more
                if self.matcher.accepting:
                    delta += self._end()
                else:
                    failure = "the grammar library stopped before the output was complete"
        now = time.perf_counter()
        if not self.times.first_token:
            self.times.first_token = now
        self.times.last_token = now
        self.finish_reason = self.text.finish_reason
        if failure is not None:
            self._fail(failure)
        elif self.finish_reason is not None:
            self.times.finished = now
        return self.output(delta, [picked.token_id], [picked] if self.config.logprobs is not None else None)

    def pooled(self) -> RequestOutput:
        """Finish an embedding request (its whole prompt ran): the output carries the embedding."""
        assert self.pooler is not None
        self.finish_reason = "stop"
        self.times.first_token = self.times.last_token = self.times.finished = time.perf_counter()
        out = self.output("", [], None)
        out.embedding = self.pooler.result()
        return out

    def _end(self) -> str:
        """Finish with reason "stop" now: release the text held back (detokenizer, stop strings)."""
        text = self.text
        delta = text.stops.push(text.detok.flush())
        if not text.stops.stopped:
            delta += text.stops.flush()
        text.finish_reason = "stop"
        text.text += delta
        return delta

    def _fail(self, why: str) -> None:
        """Finish with reason "abort" and ``error``: the grammar could not be enforced."""
        self.error = why
        self.finish_reason = "abort"
        self.times.finished = time.perf_counter()
        digest = self.matcher.digest if self.matcher is not None else ""
        log.warning("request %s: its grammar %s could not be enforced: %s", self.request_id, digest, why)

    def abort(self) -> RequestOutput:
        """Finish now with reason "abort"."""
        self.finish_reason = "abort"
        self.times.finished = time.perf_counter()
        return self.output("", [], None)

    def output(self, delta: str, tokens: list[int], logprobs: list[SampledToken] | None) -> RequestOutput:
        seq = self.seq
        return RequestOutput(self.request_id, delta, tokens, logprobs, self.finish_reason is not None,
                             self.finish_reason, len(seq.prompt_ids), len(seq.output_ids), seq.num_cached,
                             self.times, error=self.error)
