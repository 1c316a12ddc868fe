"""GenerationConfig: the knobs of one generation request, checked when it is built."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20  # most top tokens one step may report (OpenAI's limit)
MAX_SPECULATIVE_TOKENS = 64  # most draft tokens one verifying pass may run


def _number(name: str, value: object, *, integer: bool = False) -> None:
    """Raise TypeError unless ``value`` is a real number (an int when ``integer``); bools are refused."""
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        kind = "an int" if integer else "a number"
        raise TypeError(f"GenerationConfig.{name} must be {kind}, got {type(value).__name__} {value!r}")
    if not integer and not math.isfinite(value):  # type: ignore[arg-type]
        raise ValueError(f"GenerationConfig.{name} must be finite, got {value!r}")


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    """``ids`` as a tuple of token ids >= 0; ValueError naming ``name`` otherwise."""
    out = tuple(ids)  # type: ignore[arg-type]
    for t in out:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"GenerationConfig.{name} must hold token ids >= 0, got {t!r}")
    return out


@dataclass(slots=True)
class GenerationConfig:
    """How to pick tokens and when to stop.

    The logits are first penalized, in vLLM's order: ``repetition_penalty`` (CTRL's, on every
    token of the prompt and the generated text; 1 = off), then OpenAI's ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2], 0 = off): ``logits[t] -= presence_penalty * (count[t] > 0)
    + frequency_penalty * count[t]``, ``count[t]`` counting token t among the generated tokens
    only. Then temperature, top_k, top_p and min_p (Hugging Face's order). temperature == 0
    means greedy decoding (argmax after the penalties); temperature and the filters are then
    ignored. top_k == 0, top_p == 1 and min_p == 0 switch those filters off. ``seed`` makes
    sampling reproducible: each request draws from its own ``numpy.random.Generator(seed)``.

    Generation stops at any of ``eos_token_ids`` (the model's own are added unless
    ``ignore_eos``), at the first of ``stop`` strings (not emitted), or after
    ``max_new_tokens`` tokens. Until ``min_tokens`` tokens were generated the eos ids cannot be
    picked (their logits are -inf, as vLLM's min_tokens does; at most ``max_new_tokens``); stop
    strings are not held back by it.

    ``logprobs`` None returns no log-probabilities; an int k in [0, 20] returns, at each step,
    the picked token's logprob and the k most likely tokens' logprobs, of the model's own
    distribution (log_softmax of the raw logits, before penalties, temperature and filters).

    ``speculative_tokens`` k > 0 turns on speculative decoding (single-sequence ``generate`` and
    ``stream``, and the serving engine, on the CPU): k tokens drafted by prompt lookup are
    checked in one forward pass; the output is identical to decoding without it (0 = off; see
    ``generation.speculative``).

    ``reasoning_budget`` N (None: unlimited) caps a reasoning model's thinking, as llama-server's
    ``--reasoning-budget``: once N tokens were generated inside the think block without closing
    it, the ``reasoning_end`` ids (the tokens of ``</think>`` and what follows it) are forced one
    per step, and the answer is sampled as usual after them. The block opens at the first
    generated token when ``reasoning_open`` is empty (the prompt opened it), else once the reply
    begins with the ``reasoning_open`` ids; a reply that begins otherwise is not held to it. A
    request with a grammar ignores the budget: its grammar decides every token.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens_to_keep: int = 1
    skip_special_tokens: bool = True
    min_tokens: int = 0
    logprobs: int | None = None
    speculative_tokens: int = 0
    reasoning_budget: int | None = None
    reasoning_open: tuple[int, ...] = ()
    reasoning_end: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _number("max_new_tokens", self.max_new_tokens, integer=True)
        if self.max_new_tokens < 1:
            raise ValueError(f"GenerationConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"GenerationConfig.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _number("top_k", self.top_k, integer=True)
        if self.top_k < 0:
            raise ValueError(f"GenerationConfig.top_k must be >= 0 (0 = off), got {self.top_k}")
        _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"GenerationConfig.top_p must be in (0, 1] (1 = off), got {self.top_p}")
        _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"GenerationConfig.min_p must be in [0, 1] (0 = off), got {self.min_p}")
        _number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"GenerationConfig.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _number(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"GenerationConfig.{name} must be in [-2, 2] (0 = off), got {value}")
        _number("min_tokens", self.min_tokens, integer=True)
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"GenerationConfig.min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_tokens}")
        if self.logprobs is not None:
            _number("logprobs", self.logprobs, integer=True)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"GenerationConfig.logprobs must be None or in [0, {MAX_LOGPROBS}] "
                                 f"(how many top tokens to report), got {self.logprobs}")
        _number("speculative_tokens", self.speculative_tokens, integer=True)
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"GenerationConfig.speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] "
                             f"(draft tokens per step, 0 = off), got {self.speculative_tokens}")
        if self.reasoning_budget is not None:
            _number("reasoning_budget", self.reasoning_budget, integer=True)
            if self.reasoning_budget < 0:
                raise ValueError(f"GenerationConfig.reasoning_budget must be None or >= 0 (thinking tokens), "
                                 f"got {self.reasoning_budget}")
        self.reasoning_open = _token_ids("reasoning_open", self.reasoning_open)
        self.reasoning_end = _token_ids("reasoning_end", self.reasoning_end)
        if self.reasoning_budget is not None and not self.reasoning_end:
            raise ValueError("GenerationConfig.reasoning_budget needs reasoning_end: the token ids that close "
                             "the thinking (the tokenizer's encoding of '</think>')")
        _number("min_tokens_to_keep", self.min_tokens_to_keep, integer=True)
        if self.min_tokens_to_keep < 1:
            raise ValueError(f"GenerationConfig.min_tokens_to_keep must be >= 1, got {self.min_tokens_to_keep}")
        if self.seed is not None:
            _number("seed", self.seed, integer=True)
            if self.seed < 0:
                raise ValueError(f"GenerationConfig.seed must be >= 0 or None, got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"GenerationConfig.stop must hold non-empty strings, got {s!r}")
        if isinstance(self.eos_token_ids, int):
            self.eos_token_ids = (self.eos_token_ids,)
        self.eos_token_ids = tuple(self.eos_token_ids)
        for t in self.eos_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"GenerationConfig.eos_token_ids must hold token ids >= 0, got {t!r}")

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1

    def replace(self, **changes: Any) -> "GenerationConfig":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_defaults(cls, defaults: Mapping[str, Any] | None, **overrides: Any) -> "GenerationConfig":
        """Build from a model's ``generation_config.json`` values, then ``overrides`` (None = keep).

        Keys this class does not know (pad_token_id, bos_token_id...) are ignored. As in
        Hugging Face, ``do_sample: false`` means greedy and ``do_sample: true`` without a
        temperature means temperature 1; sampling values without ``do_sample`` are taken as
        meant to be used.
        """
        known = {f.name for f in dataclasses.fields(cls)} - {"eos_token_ids"}
        values: dict[str, Any] = {}
        for key, value in (defaults or {}).items():
            if key in known and value is not None:
                values[key] = value
        do_sample = (defaults or {}).get("do_sample")
        if do_sample is False:
            values["temperature"] = 0.0
        elif do_sample is True and "temperature" not in values:
            values["temperature"] = 1.0
        for key, value in overrides.items():
            if key not in known and key != "eos_token_ids":
                raise TypeError(f"GenerationConfig has no field {key!r}")
            if value is not None:
                values[key] = value
        return cls(**values)
