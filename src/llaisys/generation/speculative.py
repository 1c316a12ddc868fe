"""Speculative decoding's draft source: prompt lookup (n-gram matching in the ids so far).

The loop runs the last token and a draft of k tokens in one forward pass, then samples each
position as plain decoding would and keeps the draft while it matches (see ``loop``; the
serving engine does the same per request, ``engine.engine``). The output equals plain
decoding's because a pass of k tokens computes each row's logits bit for bit as k one-token
passes do; that holds for the CPU kernels (tested), so both speculate only on the CPU
(``verifies_exactly``). Plain Python, no tensors.
"""
from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 3  # longest suffix looked up; shorter ones are tried when it is not found
MIN_NGRAM = 1
FIRST_LENGTH = 2  # a request's first draft: longer ones once drafts hold
DRAFTER_MIN_NGRAM = 2  # the loop's drafter: a lone recurring id predicts too little of text that does not copy


def draft_tokens(ids: Sequence[int], k: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to ``k`` ids that followed the most recent earlier occurrence of the last n ids of
    ``ids`` (n from ``max_ngram`` down to ``min_ngram``, the longest match winning); [] when
    no suffix recurs. The occurrence may overlap the suffix (a run repeats itself)."""
    if k <= 0:
        return []
    size = len(ids)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix, last = list(ids[size - n:]), ids[size - 1]
        for start in range(size - n - 1, -1, -1):  # most recent first, the suffix itself excluded
            if ids[start + n - 1] == last and list(ids[start:start + n]) == suffix:
                return list(ids[start + n:start + n + k])
    return []


def verifies_exactly(model: object) -> bool:
    """Whether ``model``'s multi-token passes give each row's logits bit for bit as one-token
    passes do, which speculation needs to leave the output unchanged: established for the CPU
    kernels (and a model that names no device); elsewhere not shown."""
    device = getattr(model, "device", None)
    return device is None or bool(device.is_cpu)


class Drafter:
    """Drafts of up to ``k`` ids for one request. The length adapts to how the last draft
    fared, read from the ids that followed it: all of it accepted, the next draft is twice as
    long (at most ``k``); a miss, one longer than what was accepted (at least 1). So a request
    that copies long runs is verified many ids a pass, and one whose drafts fail pays for short
    ones; the first is 2 long. Each length is a verifying pass of its own width, recorded once (the runner keeps
    several). A lookup that finds fewer ids than the length is padded with its last one (a
    guess like any other: verified, and kept only if right); no draft when fewer tokens remain
    to pick after the next than its length. Only suffixes of ``min_ngram`` or more ids are
    looked up.

    The ids of one request only grow, so the drafter keeps an index of where each n-gram last
    started (ids already seen are not scanned again): a lookup costs O(max_ngram), not a scan
    of the whole sequence, and gives what ``draft_tokens`` gives. Ids that do not extend the
    ones indexed (another request's, or a shorter list) rebuild the index."""

    __slots__ = ("k", "min_ngram", "length", "_ids", "_last_start", "_last_draft", "_drafted_at")

    def __init__(self, k: int, min_ngram: int = DRAFTER_MIN_NGRAM) -> None:
        self.k = k
        self.min_ngram = min_ngram
        self.length = min(k, FIRST_LENGTH)  # the next draft's length
        self._ids: list[int] = []  # the ids indexed so far
        self._last_start: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start among them
        self._last_draft: list[int] = []  # the last draft proposed, and len(ids) then
        self._drafted_at = 0

    def propose(self, ids: Sequence[int], room: int) -> list[int]:
        """Up to k ids continuing ``ids`` (see ``draft_tokens``), or [] when no suffix recurs or
        ``room`` (the tokens that may still be picked after the next one) is under the draft's
        length."""
        if self.k <= 0:
            return []
        self._adapt(ids)
        if room < self.length:
            return []
        self._catch_up(ids)
        draft = self._lookup()
        draft = draft + draft[-1:] * (self.length - len(draft))
        self._last_draft, self._drafted_at = list(draft), len(ids)  # a copy: callers consume theirs
        return draft

    def _adapt(self, ids: Sequence[int]) -> None:
        """The next length, from how much of the last draft the ids now confirm: it followed
        the ids as they were then, so its verified ids, then the token picked after them, come
        next."""
        draft, at = self._last_draft, self._drafted_at
        if not draft or len(ids) <= at:
            return
        got = ids[at:at + len(draft)]
        accepted = 0
        while accepted < len(got) and got[accepted] == draft[accepted]:
            accepted += 1
        self.length = min(self.k, 2 * len(draft)) if accepted == len(draft) else max(1, accepted + 1)
        self._last_draft = []

    def _catch_up(self, ids: Sequence[int]) -> None:
        """Index every n-gram of ``ids`` that ends before its last id (the suffix looked up
        must not find itself; an occurrence may overlap it)."""
        known = self._ids
        if len(ids) < len(known) or list(ids[:len(known)]) != known:
            known.clear()
            self._last_start.clear()
        for end in range(max(len(known) - 1, 0), len(ids) - 1):  # n-grams ending at `end`
            for n in range(self.min_ngram, MAX_NGRAM + 1):
                if end - n + 1 >= 0:
                    self._last_start[tuple(ids[end - n + 1:end + 1])] = end - n + 1
        known.extend(ids[len(known):])

    def _lookup(self) -> list[int]:
        ids = self._ids
        size = len(ids)
        for n in range(min(MAX_NGRAM, size - 1), self.min_ngram - 1, -1):
            start = self._last_start.get(tuple(ids[size - n:]))
            if start is not None:
                return ids[start + n:start + n + self.length]
        return []
