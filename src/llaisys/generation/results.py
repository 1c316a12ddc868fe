"""What generation hands back: sampled tokens, stream events, the final result and its timings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(slots=True)
class Timings:
    """Where the time of one request went, in seconds (perf_counter)."""

    prompt_tokens: int = 0  # tokens in the prompt
    cached_tokens: int = 0  # of those, reused from a cache and not run again
    generated_tokens: int = 0
    prefill_s: float = 0.0  # running the prompt's uncached tokens up to the first logits
    ttft_s: float = 0.0  # first step of the stream to the first token picked (prefill and sampling included)
    decode_s: float = 0.0  # running and picking the tokens after the first (time with the consumer left out)
    total_s: float = 0.0  # first step to the last token, wall clock
    drafted_tokens: int = 0  # speculative decoding: draft tokens run in verifying passes
    accepted_tokens: int = 0  # of those, the ones kept (each saved a forward pass)

    @property
    def prefill_tokens_per_s(self) -> float:
        """Uncached prompt tokens run per second of prefill (0 when nothing ran)."""
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first one (each needs one forward step)."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """Plain numbers, rates included (for JSON and logs)."""
        return {
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens, "prefill_s": self.prefill_s, "ttft_s": self.ttft_s,
            "decode_s": self.decode_s, "total_s": self.total_s,
            "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
            "prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
        }


@dataclass(slots=True, frozen=True)
class SampledToken:
    """One token picked by ``Sampler.sample``.

    ``logprob`` is the token's log-probability under the model's own distribution (log_softmax
    of the raw logits, before penalties, temperature and filters; computed in float64) and
    ``top_logprobs`` the ``config.logprobs`` most likely tokens as ``(token_id, logprob)``, by
    descending logprob, ties by lower id. Both are None when ``config.logprobs`` is None.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True, frozen=True)
class StreamEvent:
    """One generated token: the text it releases (may be "" while held back), its id, and the
    finish reason on the last event ("stop": eos or stop string; "length": token limit)."""

    text_delta: str
    token_id: int
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class GenerationResult:
    """A finished request. ``text`` excludes the stop string; ``token_ids`` are all tokens picked,
    the eos token that ended it included (as Hugging Face's generate returns them)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)
