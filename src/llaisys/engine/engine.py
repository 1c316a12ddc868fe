"""The serving engine: many requests decoded together, one forward pass per step.

    engine = LLMEngine(model)
    engine.add_request("a", "Once upon a time", GenerationConfig(max_new_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.text_delta)

Each ``step`` asks the scheduler for a batch (decode tokens of running requests, prefill chunks
of new ones), runs it through the model's runner (``forward_batch``) over the paged KV cache so every weight
is read once for all of them, then lets each request that reached its end pick its next token
with its own sampler, all of the step's rows in one ``sample_batch`` call (the tokens each
sampler would pick alone). A request whose config carries a grammar (``grammar.GuidedConfig``)
picks among the tokens its grammar allows: the masks of the step's constrained requests are
filled together, unconstrained requests are untouched. On an nvidia device the logits stay
there and the rows that need no host processing are sampled on the device, only their ids
crossing (``kernels.nvidia.sampling``; docs/nvidia.md).

Speculative decoding (``speculative_tokens``, per request or the engine's default): a decoding
request runs its last token and a draft of the next k (prompt lookup) as one chunk, with logits
for every row; its sampler then picks each position in turn, exactly as plain decoding would
pick it, while the draft matches, so the output is unchanged and only the pass count drops. On
the CPU only (multi-row passes are bit for bit one-row passes there); grammar-constrained and
embedding requests do not speculate. A reasoning budget (``GenerationConfig.reasoning_budget``)
swaps the picks for the forced end of thinking in ``Request.accept``, so every token still runs
through the model, the text stream and a draft's check one at a time. Not thread-safe:
``EngineThread`` runs it behind a queue.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..generation import GenerationConfig, GenerationResult, Timings, encode_prompt, has_tokenizer
from ..generation.sampler import sample_batch
from ..generation.config import MAX_SPECULATIVE_TOKENS
from ..generation.results import SampledToken
from ..generation.speculative import Drafter, verifies_exactly
from ..models.paged_cache import TokenBatch, parse_kv_cache_dtype
from ..runtime.device import DeviceType
from ..runtime.dtypes import DataType
from .blocks import KVBlockManager
from .grammar import Grammar, MaskBatch, grammar_of
from .kv_events import KVEventLog
from .pooling import pooling_of
from .prefix_tiers import open_tiers
from .request import Request, RequestOutput
from .scheduler import Chunk, Scheduler

if TYPE_CHECKING:
    from ..models.multimodal.tower import PromptImages

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30  # reserved, not touched: pages are committed as blocks are used
MAX_BATCHED_TOKENS = 512  # tokens one step runs by default: a longer prompt runs in pieces of this


@dataclass(slots=True)
class EngineStats:
    """Counters and gauges for metrics: requests running and waiting, KV pool usage (0..1),
    prefix-cache lookups (tokens queried and hit; of the hits, those restored from the host and
    disk tiers), tokens processed, preemptions, steps, and
    speculative decoding's drafts, draft tokens run and draft tokens accepted (the acceptance
    rate is accepted / drafted)."""

    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    steps: int
    drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefix_restored_host: int = 0  # prompt tokens restored from the prefix cache's host tier (in prefix_hits)
    prefix_restored_disk: int = 0  # ... and from its disk tier


def _device_sampling(model):
    """The module that samples on the model's device (``kernels.nvidia.sampling``) for a
    single-process model on an nvidia device, else None (the CPU, plugins, tensor
    parallelism: host logits and ``sample_batch``). ``LLAISYS_NVIDIA_SAMPLING=0`` turns it off."""
    if (getattr(getattr(model, "device", None), "type", None) is not DeviceType.NVIDIA
            or getattr(model, "shard", None) is not None
            or os.environ.get("LLAISYS_NVIDIA_SAMPLING", "1") == "0"):
        return None
    from ..kernels.nvidia import sampling

    return sampling


class LLMEngine:
    """Continuous batching over one model.

    kv_cache_tokens / kv_cache_bytes: size of the paged KV pool (default 1 GiB, at least one
    full-context sequence); block_size: tokens per block; max_batched_tokens: tokens per step;
    max_seqs: sequences running at once; prefix_caching: reuse full blocks of equal prefixes;
    speculative_tokens: draft tokens per decoding step for requests whose config leaves
    ``speculative_tokens`` at 0 (0: off; a request's own value wins); speculative_max_seqs:
    no drafts while more sequences than this run (None: no limit; vLLM's
    ``speculative_disable_by_batch_size``); kv_events: where each step's prefix-cache events go
    (a ``kv_events.KVEventPublisher``, or anything with its ``publish``; None: not collected);
    prefix_cache_host_bytes: host memory kept for blocks the pool drops (0: none);
    prefix_cache_dir / prefix_cache_dir_bytes: a directory where blocks are written through, found
    again after a restart, and its byte budget (None: ``prefix_tiers.DEFAULT_DIR_BYTES``); the
    tiers need prefix_caching (``prefix_tiers``; ``close()`` writes what is queued);
    kv_cache_dtype: "auto" (the model's type) or "int8" (alias "q8_0": keys and values in 8 bits
    with a float32 scale per head of each slot, about half of f16's bytes; ValueError on a device
    without those kernels).
    """

    def __init__(self, model, *, kv_cache_tokens: int | None = None, kv_cache_bytes: int | None = None,
                 block_size: int = 16, max_batched_tokens: int = MAX_BATCHED_TOKENS, max_seqs: int = 64,
                 prefix_caching: bool = True, speculative_tokens: int = 0,
                 speculative_max_seqs: int | None = None, kv_events: Any = None,
                 prefix_cache_host_bytes: int = 0, prefix_cache_dir: "str | os.PathLike[str] | None" = None,
                 prefix_cache_dir_bytes: int | None = None, kv_cache_dtype: str = "auto") -> None:
        if kv_cache_tokens is not None and kv_cache_bytes is not None:
            raise ValueError("give kv_cache_tokens or kv_cache_bytes, not both")
        for name, value in (("block_size", block_size), ("max_batched_tokens", max_batched_tokens),
                            ("max_seqs", max_seqs)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LLMEngine: {name} must be a positive integer, got {value!r}")
        if (not isinstance(speculative_tokens, int) or isinstance(speculative_tokens, bool)
                or not 0 <= speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"LLMEngine: speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] "
                             f"(draft tokens per step, 0 = off), got {speculative_tokens!r}")
        if speculative_max_seqs is not None and (not isinstance(speculative_max_seqs, int)
                                                 or isinstance(speculative_max_seqs, bool) or speculative_max_seqs < 1):
            raise ValueError(f"LLMEngine: speculative_max_seqs must be a positive integer or None, "
                             f"got {speculative_max_seqs!r}")
        self.model = model
        self.speculative_tokens = speculative_tokens
        self.context_length = int(model.config.max_position_embeddings)
        self.runner = model.runner  # runs the model's passes (models.runner.ModelRunner)
        kv_dtype = parse_kv_cache_dtype(kv_cache_dtype)  # None: the model's own type
        self.kv_cache_dtype = "int8" if kv_dtype is DataType.I8 else "auto"
        kv = {} if kv_dtype is None else {"kv_dtype": kv_dtype}  # (a runner of the model's type only needs none)
        per_token = self.runner.kv_bytes_per_token(**kv)
        if kv_cache_tokens is None:
            budget = DEFAULT_KV_CACHE_BYTES if kv_cache_bytes is None else kv_cache_bytes
            if not isinstance(budget, int) or budget < 1:
                raise ValueError(f"kv_cache_bytes must be a positive integer, got {budget!r}")
            kv_cache_tokens = budget // per_token
            if kv_cache_bytes is None:
                kv_cache_tokens = max(kv_cache_tokens, self.context_length)
        if not isinstance(kv_cache_tokens, int) or kv_cache_tokens < block_size:
            raise ValueError(f"the KV cache must hold at least one block of {block_size} tokens; "
                             f"got {kv_cache_tokens!r} tokens ({per_token} bytes each)")
        num_blocks = kv_cache_tokens // block_size
        self.cache = self.runner.new_paged_cache(num_blocks, block_size, **kv)
        config = getattr(model, "config", None)
        window = config.kv_window() if hasattr(config, "kv_window") else 0
        self.blocks = KVBlockManager(num_blocks, block_size, prefix_caching, window)
        self.tiers = open_tiers(model, self.cache, prefix_caching, prefix_cache_host_bytes, prefix_cache_dir,
                                prefix_cache_dir_bytes)  # the prefix cache beyond the pool (None: none)
        self.blocks.tiers = self.tiers
        self.kv_events = kv_events
        if kv_events is not None:
            self.blocks.events = KVEventLog()
        self.scheduler = Scheduler(self.blocks, max_batched_tokens, max_seqs, speculative_max_seqs)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._eos = set(model.eos_token_ids)
        self._tokenizer = model.tokenizer if has_tokenizer(model) else None
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self._masks = MaskBatch()
        self._special = 0  # requests in the engine with a grammar or pooling (most steps have none)
        self._device_sampling = _device_sampling(model)
        self._speculation = verifies_exactly(model)
        self._warned = False  # whether the log says speculation is off on this device
        self.drafts = 0
        self.drafted_tokens = 0
        self.accepted_tokens = 0

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: "str | Sequence[int] | np.ndarray",
                    config: GenerationConfig | None = None, images: "PromptImages | None" = None) -> str:
        """Queue a request (text, encoded with the tokenizer's special tokens, or token ids);
        returns its id (a new one when ``request_id`` is None). ``images``: the rows of the
        prompt's image tokens (``VisionTower.place``), which take those tokens' places in the
        model's input. Raises ValueError for a bad or
        duplicate id, a prompt that fills the model's context, or one that could never fit in
        the KV pool, for stop strings on a model without a tokenizer, and for a grammar compiled
        for another vocabulary size than the model's (TypeError for a grammar that is not a
        ``Grammar``)."""
        config = config or GenerationConfig()
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        ids = encode_prompt(self.model, prompt)
        if len(ids) >= self.context_length:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context holds {self.context_length}, "
                             "leaving no room to generate")
        if config.stop and self._tokenizer is None:
            raise ValueError(f"stop strings {list(config.stop)!r} need text, and this model has no tokenizer "
                             f"({self.model.tokenizer.missing}); stop at token ids with eos_token_ids instead")
        pooling = pooling_of(config)
        if pooling is not None and pooling.pooling == "mean" and self.blocks.prefix_caching:
            raise ValueError("mean pooling needs every prompt token computed: use an engine without prefix "
                             "caching (LLMEngine(model, prefix_caching=False)), or last-token pooling")
        grammar = grammar_of(config)
        if grammar is not None and not isinstance(grammar, Grammar):
            raise TypeError(f"the config's grammar must be a Grammar (GrammarCompiler.compile), got "
                            f"{type(grammar).__name__}")
        if grammar is not None and grammar.vocab_size != int(self.model.config.vocab_size):
            raise ValueError(f"the grammar was compiled for a vocabulary of {grammar.vocab_size} tokens; this model "
                             f"has {self.model.config.vocab_size} (compile it with GrammarCompiler(..., "
                             "vocab_size=model.config.vocab_size))")
        max_tokens = min(config.max_new_tokens, self.context_length - len(ids) + 1)
        eos = set() if config.ignore_eos else {*config.eos_token_ids, *self._eos}
        request = Request(request_id, ids, config, max_tokens, self._tokenizer, eos)
        if images is not None and len(images.positions):
            self._check_images(images, ids)
            request.images = images
            request.seq.prompt_keys = images.key_ids(ids)
            request.seq.spans = images.spans
        request.seq.drafter = self._drafter(config, grammar is not None or pooling is not None)
        self.scheduler.add(request.seq)  # raises when it alone could never fit
        self.requests[request_id] = request
        self._special += request.matcher is not None or request.pooler is not None
        return request_id

    def _check_images(self, images: "PromptImages", ids: list[int]) -> None:
        """ValueError unless ``images`` fit the prompt ``ids``: its rows at positions inside
        the prompt, ascending, each as wide as the model's hidden size."""
        d = int(self.model.config.hidden_size)
        pos = images.positions
        if images.rows.shape != (len(pos), d):
            raise ValueError(f"the prompt's image rows have shape {images.rows.shape}; expected ({len(pos)}, {d}) "
                             "for its image positions and this model's hidden size")
        if pos.min() < 0 or pos.max() >= len(ids) or np.any(np.diff(pos) <= 0):
            raise ValueError(f"the prompt's image positions must be ascending positions of its {len(ids)} tokens")

    def _drafter(self, config: GenerationConfig, constrained: bool) -> Drafter | None:
        """The drafter of a request with ``config``: None when it does not speculate (k = 0, a
        grammar or an embedding, whose masks and rows are not per position, or a device where
        multi-row passes are not shown to equal one-row ones)."""
        k = config.speculative_tokens or self.speculative_tokens
        if not k or constrained:
            return None
        if not self._speculation:
            if not self._warned:
                self._warned = True
                logger.warning("speculative_tokens: speculation runs on the CPU only (on %s its output is not "
                               "shown to equal plain decoding's); decoding without it", self.model.device)
            return None
        return Drafter(k)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its blocks; returns its last output (reason "abort"),
        or None when it is not in the engine (finished already, or unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._special -= request.matcher is not None or request.pooler is not None
        self.scheduler.finish(request.seq)
        return request.abort()

    def has_unfinished(self) -> bool:
        """Whether any request is running or waiting."""
        return bool(self.requests)

    # ---- stepping ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that picked a token."""
        step = self.scheduler.schedule()
        if not step.chunks:
            return []
        if self.tiers is not None:  # copies of blocks committed or dropped, before this pass overwrites any
            self.tiers.capture()
        self.steps += 1
        now = time.perf_counter()
        chunks = []
        logit_rows: list[int] = []  # the last row of each sampling chunk, every row of a speculating one
        first_row: list[int] = []  # each sampling chunk's first row of logits
        at = 0
        given: list[tuple[np.ndarray, np.ndarray]] = []  # rows of the batch whose input is an image's
        ends: list[tuple[int, np.ndarray]] = []  # (first row, key ends) of chunks that meet a two-way span
        rope: list[tuple[int, np.ndarray]] = []  # (first row, rope positions (3, E)) of multimodal-rope chunks
        for c in step.chunks:
            seq = c.seq
            request = self.requests[seq.seq_id]
            if not request.times.first_scheduled:
                request.times.first_scheduled = now
            chunks.append((c.token_ids, c.start, self.blocks.block_table(seq.seq_id), c.samples))
            if c.start < len(seq.prompt_ids):  # prompt tokens (recomputed ones too) count as prompt work
                self.prompt_tokens += min(c.length, len(seq.prompt_ids) - c.start)
                if request.images is not None:
                    offsets, rows = request.images.between(c.start, c.start + c.length - len(c.draft))
                    if len(offsets):
                        given.append((offsets + at, rows))
                    if request.seq.spans:
                        span_ends = request.images.key_ends(c.start, c.start + c.length - len(c.draft))
                        if span_ends is not None:
                            ends.append((at, span_ends))
            if request.images is not None and request.images.rope_positions is not None:
                rope.append((at, request.images.rope_rows(c.start, c.start + c.length)))
            at += c.length
            if c.samples:
                first_row.append(len(logit_rows))
                logit_rows.extend(range(at - 1 - len(c.draft), at))
        batch = TokenBatch.build(chunks, self.cache.block_size, self.cache.max_blocks)
        batch.logit_rows = np.asarray(logit_rows, np.int64)  # (R,)
        if given:
            batch.input_rows = (np.concatenate([g[0] for g in given]), np.concatenate([g[1] for g in given]))
        if rope:
            batch.rope_positions = np.repeat(batch.positions[None], 3, axis=0)  # (3, N)
            for first, rows in rope:
                batch.rope_positions[:, first:first + rows.shape[1]] = rows
        if ends:
            batch.key_ends = batch.positions + 1  # (N,)
            for first, span_ends in ends:
                batch.key_ends[first:first + len(span_ends)] = span_ends
        if self._device_sampling is None:
            logits = self.runner.forward_batch(batch, self.cache)  # (R, V) float32 on the host
        else:
            logits = self.runner.forward_batch_logits(batch, self.cache)  # (R, V) on the device
        if self._special:
            self._pool(step.chunks, batch.num_tokens)
        self.scheduler.commit(step)
        if self.kv_events is not None:  # the blocks this step took (and so dropped) and filled
            self.kv_events.publish(self.blocks.events.drain())
        sampled = [c for c in step.chunks if c.samples]  # logits row order
        sampling = [self.requests[c.seq.seq_id] for c in sampled]
        allowed = self._grammar_masks(sampling, logits.shape[-1]) if self._special else {}
        outputs: list[RequestOutput | None] = []
        picking = []  # requests that pick a token, all sampled in one call
        for i, request in enumerate(sampling):
            if request.pooler is not None:  # an embedding: its prompt ran, nothing is generated
                outputs.append(request.pooled())
                continue
            outputs.append(request.prepare(allowed.get(i)))
            self.generation_tokens += 1
            if outputs[-1] is None:
                picking.append(i)
        if picking:
            tokens = self._pick([sampling[i] for i in picking], [first_row[i] for i in picking], logits,
                                [allowed.get(i) for i in picking])
            for i, token in zip(picking, tokens):
                outputs[i] = sampling[i].accept(token)
            drafted = [i for i in picking if sampled[i].draft]
            if drafted:
                self._verify([sampled[i] for i in drafted], [sampling[i] for i in drafted],
                             [first_row[i] for i in drafted], logits, outputs, drafted)
        for request, out in zip(sampling, outputs):
            if out.finished:
                self.scheduler.finish(request.seq)
                del self.requests[request.request_id]
                self._special -= request.matcher is not None or request.pooler is not None
        return outputs

    def _verify(self, chunks: list[Chunk], requests: list[Request], rows: list[int], logits,
                outputs: list, slots: list[int]) -> None:
        """Check the drafts of speculating ``requests`` (their ``chunks``; their logits from row
        ``rows[j]`` on; their first pick already in ``outputs[slots[j]]``). While a request's
        pick equals its draft's id at that position, the next row holds the logits plain
        decoding would compute next, so its sampler picks again from it, in the state plain
        decoding would have it (all such requests in one call per position). Each output
        gathers its request's picks; the draft positions that held count as computed, the
        others are rolled back."""
        accepted = [0] * len(requests)
        going = []
        for j, chunk in enumerate(chunks):
            out = outputs[slots[j]]
            if out.token_ids[0] == chunk.draft[0]:
                accepted[j] = 1
                if not out.finished:
                    going.append(j)
        pos = 1
        while going:
            tokens = self._pick([requests[j] for j in going], [rows[j] + pos for j in going], logits,
                                [None] * len(going))
            still = []
            for j, token in zip(going, tokens):
                later = requests[j].accept(token)
                out = outputs[slots[j]] = outputs[slots[j]].then(later)
                self.generation_tokens += 1
                # the token kept (a reasoning budget may force another) decides whether the draft held
                if pos < len(chunks[j].draft) and later.token_ids[0] == chunks[j].draft[pos]:
                    accepted[j] += 1
                    if not out.finished:
                        still.append(j)
            going, pos = still, pos + 1
        for j, (chunk, request) in enumerate(zip(chunks, requests)):
            request.drafted += len(chunk.draft)
            request.accepted += accepted[j]
            self.drafts += 1
            self.drafted_tokens += len(chunk.draft)
            self.accepted_tokens += accepted[j]
            if not outputs[slots[j]].finished:
                self.scheduler.accept_draft(request.seq, accepted[j])

    def _pick(self, requests: list[Request], rows: list[int], logits, allowed: list[np.ndarray | None]
              ) -> list[SampledToken]:
        """The token each of ``requests`` picks from its row ``rows[j]`` of ``logits`` (R, V)
        (among ``allowed[j]``, a grammar's mask, when given): host float32 logits go to
        ``sample_batch``; device logits (an nvidia model) are sampled there for the requests the
        device can serve (``Request.device_pickable``), only their ids crossing, and only the
        other rows are copied to the host for ``sample_batch``."""
        if self._device_sampling is None:  # host logits: every row to the host sampler
            picks = logits if rows == list(range(logits.shape[0])) else logits[rows]  # (P, V)
            return self._sample_on_host(requests, picks, allowed)
        on_device = [j for j, r in enumerate(requests) if r.device_pickable(allowed[j])]
        device_set = set(on_device)
        on_host = [j for j in range(len(requests)) if j not in device_set]
        picked: dict[int, SampledToken] = {}
        if on_device:
            picked.update(zip(on_device, self._sample_on_device([requests[j] for j in on_device], logits,
                                                                [rows[j] for j in on_device])))
        if on_host:
            picks = self._device_sampling.rows_to_host(logits, [rows[j] for j in on_host])  # (P, V) only these cross
            picked.update(zip(on_host, self._sample_on_host([requests[j] for j in on_host], picks,
                                                            [allowed[j] for j in on_host])))
        return [picked[j] for j in range(len(requests))]

    @staticmethod
    def _sample_on_host(requests: list[Request], logits: np.ndarray, allowed: list[np.ndarray | None]
                        ) -> list[SampledToken]:
        """``sample_batch`` of ``requests`` over their host rows ``logits`` (P, V)."""
        return sample_batch([r.sampler for r in requests], logits, [r.penalized_context() for r in requests],
                            [r.seq.output_ids for r in requests], allowed)

    def _sample_on_device(self, requests: list[Request], logits, rows: list[int]) -> list[SampledToken]:
        """One ``sample`` call for ``rows`` of the device ``logits``: greedy rows take the
        argmax, the others draw with their request's own device generator (seeded from its
        seed: reproducible, but not the draws the host sampler would make)."""
        sampling = self._device_sampling
        configs = [r.config for r in requests]
        for r in requests:
            if r.device_rng is None and not r.config.greedy:
                r.device_rng = sampling.new_generator(self.model.device, r.config.seed)
        ids = sampling.sample(logits, [0.0 if c.greedy else c.temperature for c in configs],
                              [c.top_k for c in configs], [c.top_p for c in configs],
                              [r.device_rng for r in requests], rows=rows)  # (P,) int64
        return [SampledToken(int(t)) for t in ids]

    def _pool(self, chunks: list, num_tokens: int) -> None:
        """Hand each embedding request of the step its rows of the final hidden states."""
        if not any(self.requests[c.seq.seq_id].pooler is not None for c in chunks):
            return
        hidden = self.model_hidden(num_tokens)  # (N, D)
        offset = 0
        for c in chunks:
            pooler = self.requests[c.seq.seq_id].pooler
            if pooler is not None:
                pooler.add(hidden[offset:offset + c.length], c.start)
            offset += c.length

    def model_hidden(self, num_tokens: int) -> np.ndarray:
        """The final hidden states (N, D) float32 (after the last norm) of the batch of
        ``num_tokens`` tokens the model just ran over this engine's cache."""
        hidden_states = getattr(self.runner, "hidden_states", None)
        if hidden_states is None:
            raise RuntimeError("this model does not expose its hidden states; it cannot give embeddings")
        return hidden_states(self.cache, num_tokens)[:num_tokens]

    def _grammar_masks(self, sampling: list[Request], vocab: int) -> dict[int, np.ndarray]:
        """The tokens (vocab,) bool each constrained request of ``sampling`` may pick, by row:
        every grammar's mask filled in one call (llguidance's threads)."""
        rows = [i for i, r in enumerate(sampling) if r.matcher is not None]
        if not rows:
            return {}
        masks = self._masks.fill([sampling[i].matcher for i in rows])  # (C, W) int32
        return {i: sampling[i].allowed(masks[j], vocab) for j, i in enumerate(rows)}

    def stats(self) -> EngineStats:
        """The engine's counters and gauges now."""
        running, waiting = self.scheduler.counts()
        tiers = self.tiers
        return EngineStats(running, waiting, self.blocks.usage, self.blocks.prefix_queries, self.blocks.prefix_hits,
                           self.prompt_tokens, self.generation_tokens, self.scheduler.num_preemptions, self.steps,
                           self.drafts, self.drafted_tokens, self.accepted_tokens,
                           tiers.restored_host if tiers else 0, tiers.restored_disk if tiers else 0)

    def close(self, timeout: float | None = 10.0) -> bool:
        """Hand the prefix cache's disk tier what it has pending and wait for its writer (at
        most ``timeout`` s), then stop it; the engine can still run, without writing to disk.
        True when nothing was left unwritten. ``EngineThread`` calls it when it stops."""
        return self.tiers.close(timeout) if self.tiers is not None else True

    # ---- offline -----------------------------------------------------------------------
    def generate(self, prompts: "Iterable[str | Sequence[int]]",
                 config: "GenerationConfig | Sequence[GenerationConfig] | None" = None) -> list[GenerationResult]:
        """Run every prompt to the end, together; return their results in prompt order.
        ``config`` is one for all, or one per prompt. Raises ValueError, once all are done, when
        a prompt's grammar could not be enforced (its text would not follow it)."""
        prompts = list(prompts)
        configs = list(config) if isinstance(config, (list, tuple)) else [config] * len(prompts)
        if len(configs) != len(prompts):
            raise ValueError(f"{len(configs)} configs for {len(prompts)} prompts")
        start = time.perf_counter()
        ids = [self.add_request(None, p, c) for p, c in zip(prompts, configs)]
        requests = {i: self.requests[i] for i in ids}
        text = {i: "" for i in ids}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.request_id in text:
                    text[out.request_id] += out.text_delta
                    tokens[out.request_id] += out.token_ids
                    if out.finished:
                        done[out.request_id] = out
        failed = [(k, done[i].error) for k, i in enumerate(ids) if done[i].error is not None]
        if failed:
            raise ValueError(f"prompt {failed[0][0]}: its grammar could not be enforced: {failed[0][1]}")
        results = []
        for i in ids:
            out = done[i]
            t = out.times
            timings = Timings(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
                              generated_tokens=out.completion_tokens, ttft_s=t.ttft_s,
                              prefill_s=t.ttft_s, decode_s=max(t.last_token - t.first_token, 0.0),
                              total_s=max(t.finished - start, 0.0), drafted_tokens=requests[i].drafted,
                              accepted_tokens=requests[i].accepted)
            results.append(GenerationResult(text[i], tokens[i], out.finish_reason, out.prompt_tokens, timings))
        return results
