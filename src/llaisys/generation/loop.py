"""The generation loop: prefill the prompt, then pick, stream and feed back one token at a time
(or, with speculation, a token and a draft of the next ones, checked in one pass)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ..models.decoder import PREFILL_CHUNK  # pieces of the decoder's own chunk: what one call computes
from .config import GenerationConfig
from .prompt_cache import PromptCache
from .protocol import LanguageModel
from .results import FinishReason, GenerationResult, StreamEvent, Timings
from .sampler import Sampler
from .speculative import Drafter, verifies_exactly
from .text_stream import TextStream

logger = logging.getLogger(__name__)


# Called as progress(done, total) after each piece of the prompt's uncached tokens has run.
PrefillProgress = Callable[[int, int], None]


def has_tokenizer(model: LanguageModel) -> bool:
    """False for a model that takes token ids only (its tokenizer says what is ``missing``)."""
    return getattr(model.tokenizer, "missing", None) is None


def _context_limit(model: LanguageModel) -> int | None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(limit) if limit else None


def encode_prompt(model: LanguageModel, prompt: str | Sequence[int] | np.ndarray) -> list[int]:
    """Token ids (S,) of ``prompt``: text is encoded with the tokenizer's special tokens (BOS),
    ids are checked against the vocabulary. Raises ValueError for an empty or bad prompt."""
    if isinstance(prompt, str):
        ids = list(model.tokenizer.encode(prompt, add_special_tokens=True))
    elif isinstance(prompt, (np.ndarray, Sequence)) and not isinstance(prompt, (bytes, bytearray)):
        arr = np.asarray(prompt)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"prompt ids must be a 1-D sequence of ints, got {arr.dtype} array of shape {arr.shape}")
        ids = [int(t) for t in arr]
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty: give some text or at least one token id")
    vocab = getattr(model.tokenizer, "vocab_size", None) or getattr(model.config, "vocab_size", None)
    bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
    return ids


class GenerationStream:
    """Iterate for StreamEvents, one per generated token; the last carries the finish reason.

    While and after iterating, ``text``, ``token_ids``, ``finish_reason`` and ``timings`` tell
    the state so far; ``result()`` runs to the end and returns a GenerationResult. A model
    without a tokenizer streams token ids with empty text. ``prefill_progress`` is called as
    ``(done, total)`` while the prompt runs (see ``PrefillProgress``).
    """

    def __init__(self, model: LanguageModel, prompt_ids: list[int], config: GenerationConfig,
                 prompt_cache: PromptCache | None = None, prefill_progress: PrefillProgress | None = None) -> None:
        self.model = model
        self.config = config
        self.prompt_ids = prompt_ids
        self.prefill_progress = prefill_progress
        if config.stop and not has_tokenizer(model):
            raise ValueError(f"stop strings {list(config.stop)!r} need text, and this model has no tokenizer "
                             f"({model.tokenizer.missing}); stop at token ids with eos_token_ids instead")
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.timings = Timings(prompt_tokens=len(prompt_ids))
        limit = _context_limit(model)
        if limit is not None and len(prompt_ids) >= limit:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context holds {limit}, "
                             "leaving no room to generate")
        if prompt_cache is None:
            want = len(prompt_ids) + config.max_new_tokens
            prompt_cache = PromptCache(model, min(want, limit) if limit else want)
        elif len(prompt_ids) >= prompt_cache.max_tokens:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the cache holds {prompt_cache.max_tokens}")
        self.prompt_cache = prompt_cache
        self._events = self._run()

    def __iter__(self) -> Iterator[StreamEvent]:
        return self

    def __next__(self) -> StreamEvent:
        return next(self._events)

    def close(self) -> None:
        """Stop early; the cache keeps what was run so far."""
        self._events.close()

    def result(self) -> GenerationResult:
        """Run to the end (if not there yet) and return the whole result."""
        for _ in self:
            pass
        assert self.finish_reason is not None
        return GenerationResult(self.text, list(self.token_ids), self.finish_reason,
                                len(self.prompt_ids), self.timings)

    def _forward(self, ids: list[int]) -> np.ndarray:
        logits = self.model.forward(ids, self.prompt_cache.cache)  # (V,)
        self.prompt_cache.token_ids.extend(ids)
        return logits

    def _greedy_on_device(self) -> bool:
        """Whether decoding steps may take their token as the argmax on the model's device
        (``forward_greedy``: only the id crosses to the host): a greedy config with no penalty,
        on a model off the CPU that offers it. (The min-tokens mask is checked per step.)"""
        c, device = self.config, getattr(self.model, "device", None)
        return (c.greedy and c.repetition_penalty == 1.0 and c.presence_penalty == 0.0 and c.frequency_penalty == 0.0
                and hasattr(self.model, "forward_greedy") and device is not None and not device.is_cpu)

    def _speculates(self) -> bool:
        """Whether to draft and verify (``config.speculative_tokens``): on the CPU only (or a
        model with no device), whose passes give multi-token logits bit for bit as one-token
        passes do; elsewhere that is not established, so decoding goes one token at a time."""
        if not self.config.speculative_tokens:
            return False
        if not verifies_exactly(self.model):
            logger.warning("speculative_tokens: speculation runs on the CPU only (on %s its output is not shown "
                           "to equal plain decoding's); decoding without it", self.model.device)
            return False
        return True

    def _forward_greedy(self, ids: list[int]) -> int:
        token = self.model.forward_greedy(ids, self.prompt_cache.cache)
        self.prompt_cache.token_ids.extend(ids)
        return token

    def _prefill(self, ids: list[int]) -> np.ndarray:
        """Run the prompt's uncached ``ids``: in one call, or piece by piece with progress reports."""
        if self.prefill_progress is None:
            return self._forward(ids)
        for begin in range(0, len(ids), PREFILL_CHUNK):
            logits = self._forward(ids[begin:begin + PREFILL_CHUNK])  # (V,)
            self.prefill_progress(min(begin + PREFILL_CHUNK, len(ids)), len(ids))
        return logits

    def _run(self) -> Iterator[StreamEvent]:
        cfg, tok = self.config, self.model.tokenizer
        t0 = time.perf_counter()
        eos = set() if cfg.ignore_eos else {*cfg.eos_token_ids, *self.model.eos_token_ids}
        sampler = Sampler(cfg, stop_token_ids=eos)  # eos cannot be picked before cfg.min_tokens tokens
        context = list(self.prompt_ids)  # every id so far, for the repetition penalty

        cached = self.prompt_cache.reuse(self.prompt_ids)
        self.timings.cached_tokens = cached
        logits = self._prefill(self.prompt_ids[cached:])  # (V,)
        t_prefill = time.perf_counter()
        self.timings.prefill_s = t_prefill - t0
        t_resume = t_prefill  # when the generator last got control back from its consumer
        room = self.prompt_cache.max_tokens - len(self.prompt_cache.token_ids)
        limit = min(cfg.max_new_tokens, room + 1)  # the last token picked is never run
        text = TextStream(tok if has_tokenizer(self.model) else None, self.prompt_ids, cfg.stop, eos, limit,
                          cfg.skip_special_tokens)
        on_device = self._greedy_on_device()
        picked: int | None = None  # the next token when the device picked it
        rows: list[np.ndarray] = [logits]  # logits (V,) of the next steps: 1, or 1 + len(draft) after verifying
        draft: list[int] = []  # draft tokens run but not yet accepted: the cache's tail
        drafter = Drafter(cfg.speculative_tokens)
        speculate = self._speculates()
        try:
            for step in range(limit):
                token = picked if picked is not None else sampler(rows.pop(0), context, self.token_ids)
                if step == 0:
                    self.timings.ttft_s = time.perf_counter() - t0
                self.token_ids.append(token)
                context.append(token)
                self.timings.generated_tokens = len(self.token_ids)
                delta = text.push(token)
                finish = text.finish_reason
                self.text += delta
                if finish is not None:
                    self.finish_reason = finish
                    self.timings.total_s = time.perf_counter() - t0
                    logger.debug("finished (%s): %s", finish, self.timings.as_dict())
                if step > 0:  # time spent by the consumer between events is not decode time
                    self.timings.decode_s += time.perf_counter() - t_resume
                yield StreamEvent(delta, token, finish)
                if finish is not None:
                    return
                t_resume = time.perf_counter()
                if draft and token == draft[0]:  # the draft guessed right: the next row is already computed
                    draft.pop(0)
                    self.timings.accepted_tokens += 1
                    continue
                self._drop(draft)
                # up to limit - generated tokens remain, and the verifying pass picks 1 + len(draft) of them
                guess = drafter.propose(context, limit - len(self.token_ids) - 1) if speculate else []
                if guess:
                    rows, draft = self._verify([token, *guess]), guess
                    picked = None
                elif on_device and (not eos or len(self.token_ids) >= cfg.min_tokens):  # (no min-tokens mask)
                    picked = self._forward_greedy([token])
                else:
                    picked, rows = None, [self._forward([token])]
        finally:
            self._drop(draft)  # the cache keeps what was picked, as without speculation

    def _verify(self, ids: list[int]) -> list[np.ndarray]:
        """Run the last token and a draft in one pass: the logits (V,) after each of ``ids``.
        The kernels compute each row as one-at-a-time decoding would, bit for bit."""
        logits = self.model.forward(ids, self.prompt_cache.cache, all_logits=True)  # (1 + k, V)
        self.prompt_cache.token_ids.extend(ids)
        self.timings.drafted_tokens += len(ids) - 1
        return list(logits)

    def _drop(self, draft: list[int]) -> None:
        """Take the rejected ``draft`` tokens (the cache's last ones) out of the cache; their
        K/V are overwritten by later passes."""
        if draft:
            self.prompt_cache.cache.truncate(self.prompt_cache.cache.length - len(draft))
            del self.prompt_cache.token_ids[-len(draft):]
            draft.clear()


def stream(model: LanguageModel, prompt: str | Sequence[int] | np.ndarray,
           config: GenerationConfig | None = None, *, prompt_cache: PromptCache | None = None,
           prefill_progress: PrefillProgress | None = None) -> GenerationStream:
    """Generate from ``prompt`` (text, or token ids (S,)) and stream it: iterate the returned
    GenerationStream for StreamEvents. ``prompt_cache`` lets consecutive calls share the KV of
    a common prompt prefix; ``prefill_progress(done, total)`` hears how the prompt is going.
    Text prompts are encoded with the tokenizer's special tokens."""
    return GenerationStream(model, encode_prompt(model, prompt), config or GenerationConfig(), prompt_cache,
                            prefill_progress)


def generate(model: LanguageModel, prompt: str | Sequence[int] | np.ndarray,
             config: GenerationConfig | None = None, *, prompt_cache: PromptCache | None = None,
             prefill_progress: PrefillProgress | None = None) -> GenerationResult:
    """Generate from ``prompt`` (text, or token ids (S,)) to the end; returns the text, the
    generated ids, the finish reason ("stop" or "length"), the prompt length and timings."""
    return stream(model, prompt, config, prompt_cache=prompt_cache, prefill_progress=prefill_progress).result()
