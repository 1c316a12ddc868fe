"""The scheduler: which sequences run in the next step, and how many of their tokens.

Plain Python over token counts and block ids; no tensors, no model. Each step has a budget of
tokens (``max_batched_tokens``). Running sequences come first, oldest first: a decoding one
takes one token, one still prefilling takes the next chunk of its prompt. Waiting sequences
are then admitted first come, first served while budget, sequence slots and blocks last; a
long prompt is prefilled over several steps in chunks. A request whose next prompt block is
being computed by another sequence waits until it is, so a prefix shared by requests that
arrive together is computed once. When the pool cannot give a running
sequence its next block, the most recently admitted running sequence is preempted: its blocks
are freed and it goes back to the head of the queue to be recomputed later (its prompt and
the tokens it generated so far), so no request fails for lack of memory unless it alone could
never fit, which ``add`` refuses at once.

Speculative decoding: a decoding sequence with a ``drafter`` may run its last token plus a
draft of the next ones (prompt lookup, ``generation.speculative``) as one chunk, when the
budget and the free blocks left once every running sequence has its token allow it; drafts
never preempt anyone and come before admissions, and none are made while more than
``speculative_max_seqs`` sequences run (a full batch gains nothing from them). The engine checks the draft and reports how
much of it held (``accept_draft``): only verified positions count as computed, and the blocks
past the sequence's end are handed back.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from ..generation.speculative import Drafter
from .blocks import KVBlockManager


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens: the prompt, the tokens generated so far, and how many of all of
    them have their keys and values in the pool (``num_computed``). The next step runs tokens
    ``num_computed:num_tokens``; when that reaches the end, the step's last logits pick the
    next token."""

    seq_id: object
    prompt_ids: list[int]
    max_tokens: int  # tokens the sequence may generate at most
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens found in the prefix cache when last admitted
    status: Status = Status.WAITING
    preemptions: int = 0
    drafter: Drafter | None = None  # speculative decoding: drafts for its decoding steps (None: off)
    # the prompt ids its cached blocks are hashed by, where they differ from ``prompt_ids`` (an
    # image's tokens stand for its digest: ``PromptImages.key_ids``); None: the prompt ids
    prompt_keys: list[int] | None = None
    # prompt spans [a, b) whose tokens see each other both ways (an image of Gemma 3): a chunk
    # runs all of a span's uncomputed tokens or none (``fit_spans``)
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then generated ids."""
        return self.prompt_ids + self.output_ids

    @property
    def block_ids(self) -> list[int]:
        """The ids its blocks are named by in the prefix cache: prompt (as ``prompt_keys``
        says) then generated ids."""
        return (self.prompt_keys if self.prompt_keys is not None else self.prompt_ids) + self.output_ids

    @property
    def prefilling(self) -> bool:
        """Whether more than one token is left to run (a prompt, or a recomputation)."""
        return self.num_tokens - self.num_computed > 1


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens ``start:start + length`` of ``seq`` run in this step; ``samples`` when they reach
    the sequence's end (the step's last logits for it pick a token). With a ``draft`` (a
    decoding sequence speculating), the chunk is the sequence's last token followed by the
    draft's ids (``length`` counts both), and every row's logits are wanted."""

    seq: Sequence
    start: int
    length: int
    samples: bool
    draft: tuple[int, ...] = ()

    @classmethod
    def of(cls, seq: Sequence, length: int, draft: tuple[int, ...] = ()) -> "Chunk":
        """The next ``length`` tokens of ``seq`` to compute (then ``draft``, when given)."""
        return cls(seq, seq.num_computed, length + len(draft), seq.num_computed + length == seq.num_tokens, draft)

    @property
    def token_ids(self) -> list[int]:
        """The ids this chunk runs: the sequence's own, then the draft's."""
        seq, begin, end = self.seq, self.start, self.start + self.length - len(self.draft)
        split = len(seq.prompt_ids)  # sliced from the two lists, not from their joined copy
        if end <= split:
            own = seq.prompt_ids[begin:end]
        elif begin >= split:
            own = seq.output_ids[begin - split:end - split]
        else:
            own = seq.prompt_ids[begin:] + seq.output_ids[:end - split]
        return own + list(self.draft) if self.draft else own


@dataclass(slots=True)
class Step:
    """What one engine step runs: chunks in batch order, and the sequences preempted for it."""

    chunks: list[Chunk]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


def fit_spans(seq: Sequence, start: int, n: int) -> int:
    """The length of a chunk of ``seq`` from ``start`` of at most ``n`` tokens (as many as fit
    the budget) that cuts none of its two-way spans: a chunk that would end inside one ends
    before it, or, when it begins inside or at it, runs to its end (past the budget: the span's
    tokens must be in one pass, each reading the keys of all)."""
    for a, b in seq.spans:
        if a < start + n < b:
            return a - start if a > start else b - start
    return n


class Scheduler:
    """First-come-first-served continuous batching with chunked prefill and preemption by
    recomputation, over a ``KVBlockManager``."""

    def __init__(self, blocks: KVBlockManager, max_batched_tokens: int = 512, max_seqs: int = 64,
                 speculative_max_seqs: int | None = None) -> None:
        if max_batched_tokens < 1 or max_seqs < 1:
            raise ValueError(f"max_batched_tokens and max_seqs must be >= 1, got {max_batched_tokens}, {max_seqs}")
        self.blocks = blocks
        self.max_batched_tokens = max_batched_tokens
        self.max_seqs = max_seqs
        self.speculative_max_seqs = speculative_max_seqs  # drafts only while at most this many run (None: any)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    # ---- requests ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq``. Raises ValueError when its prompt plus ``max_tokens`` could not fit in
        the whole pool even alone (it would wait forever). Behind a window (every layer sliding)
        a sequence holds at most the window and one step's tokens at once."""
        need = len(seq.prompt_ids) + seq.max_tokens - 1  # the last token picked is never run
        blocks = self.blocks.blocks_for(need)
        if self.blocks.window:
            blocks = min(blocks, self.blocks.blocks_for(self.blocks.window + self.max_batched_tokens) + 1)
        if blocks > self.blocks.num_blocks:
            raise ValueError(
                f"request {seq.seq_id!r} needs up to {need} tokens of KV cache ({len(seq.prompt_ids)} prompt + "
                f"{seq.max_tokens} to generate), more than the whole pool holds "
                f"({self.blocks.capacity_tokens} tokens); lower max_tokens or give the engine a larger KV cache")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out (finished or aborted) and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.blocks.free(seq.seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling --------------------------------------------------------------------
    def schedule(self) -> Step:
        """Pick the next step's chunks (running sequences, then admissions)."""
        budget = self.max_batched_tokens
        chunks: list[Chunk] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = fit_spans(seq, seq.num_computed, min(seq.num_tokens - seq.num_computed, budget))
            while not self.blocks.grow(seq.seq_id, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it preempted itself: nothing after it is running any more
            chunks.append(Chunk.of(seq, n))
            budget -= n
            i += 1
        if not preempted:  # memory is short while anything had to give way: no drafts, admit nobody
            budget = self._draft(chunks, budget)
            while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
                seq = self.waiting[0]
                cached = self.blocks.match_prefix(seq.seq_id, seq.block_ids)
                n = fit_spans(seq, cached, min(seq.num_tokens - cached, budget))
                # Wait while another sequence computes the next block of this prefix (it is
                # shared a step later), or while the pool is short; hold no blocks meanwhile.
                if (self.blocks.next_block_in_flight(seq.seq_id, seq.block_ids, cached)
                        or not self.blocks.grow(seq.seq_id, cached + n)):
                    self.blocks.free(seq.seq_id)
                    break
                self.blocks.count_lookup(seq.num_tokens, cached)
                self.blocks.claim(seq.seq_id, seq.block_ids, cached)
                seq.num_cached = seq.num_computed = cached
                self.waiting.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
                chunks.append(Chunk.of(seq, n))
                budget -= n
        return Step(chunks, preempted)

    def _draft(self, chunks: list[Chunk], budget: int) -> int:
        """Give the decoding chunks of speculating sequences their drafts, in order, while the
        ``budget`` and the free blocks last (every sequence already has the blocks of its own
        token); returns the budget left."""
        if self.speculative_max_seqs is not None and len(self.running) > self.speculative_max_seqs:
            return budget
        for j, chunk in enumerate(chunks):
            seq = chunk.seq
            if seq.drafter is None or chunk.length != 1 or not chunk.samples or budget <= 0:
                continue
            room = seq.max_tokens - len(seq.output_ids) - 1  # tokens that may be picked after the next
            # the drafter sets the draft's length as it proposes (after the last one held): the
            # budget caps it there, not by the length before
            draft = seq.drafter.propose(seq.token_ids, min(room, budget))
            if draft and self.blocks.grow(seq.seq_id, seq.num_computed + 1 + len(draft)):
                chunks[j] = Chunk.of(seq, 1, tuple(draft))
                budget -= len(draft)
        return budget

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first to be recomputed."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def commit(self, step: Step) -> None:
        """Record that ``step`` ran: each chunk's keys and values are written (full blocks
        become findable by later sequences with the same prefix). Call before appending the
        tokens the step picked. A chunk's draft is not counted: ``accept_draft`` adds the part
        that held."""
        for chunk in step.chunks:
            seq = chunk.seq
            seq.num_computed = chunk.start + chunk.length - len(chunk.draft)
            if self.blocks.prefix_caching:
                self.blocks.commit(seq.seq_id, seq.block_ids, seq.num_computed)
            self.blocks.release_behind(seq.seq_id, seq.num_computed)

    def accept_draft(self, seq: Sequence, accepted: int) -> None:
        """Record that the first ``accepted`` ids of ``seq``'s draft were right (they are now
        its tokens, the token picked after them appended too): their keys and values count as
        computed, and blocks past the sequence's end (a rejected draft's) are handed back.
        Call after appending the tokens the step picked."""
        seq.num_computed += accepted
        assert seq.num_computed < seq.num_tokens, "an accepted draft ran past the sequence"
        self.blocks.commit(seq.seq_id, seq.block_ids, seq.num_computed)
        self.blocks.trim(seq.seq_id, seq.num_tokens)
        self.blocks.release_behind(seq.seq_id, seq.num_computed)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) sequences."""
        return len(self.running), len(self.waiting)
