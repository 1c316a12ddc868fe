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

MIN_NGRAM = 1
DRAFTER_MIN_NGRAM = 2  # the loop's drafter: a lone recurring id predicts too little of text that does not copy
CANDIDATES = 16  # the most recent occurrences of the last ids compared; older ones are not looked at
MAX_MATCH = 16  # ids compared backwards from each occurrence: matches longer than this tie
FIRST_LENGTH = 2  # a request's first draft: longer ones once drafts hold


def match_length(ids: Sequence[int], start: int, n: int) -> int:
    """How many ids (up to MAX_MATCH) end at ``start + n - 1`` as they end ``ids``: the
    occurrence of the last n ids at ``start`` extended backwards while it still matches."""
    size, length = len(ids), n
    while length < MAX_MATCH and start - (length - n) - 1 >= 0 and ids[start - (length - n) - 1] == ids[size - 1 - length]:
        length += 1
    return length


def best_occurrence(ids: Sequence[int], starts: Sequence[int], n: int) -> tuple[int, int] | None:
    """Among ``starts`` (earlier occurrences of the last n ids, oldest first), the one whose
    match (``match_length``) is longest, the most recent of equals: (its start, the match
    length); None when there is none. Only the last CANDIDATES are compared."""
    best = None
    for start in reversed(starts[-CANDIDATES:]):
        length = match_length(ids, start, n)
        if best is None or length > best[1]:
            best = (start, length)
            if length == MAX_MATCH:
                break
    return best


def draft_tokens(ids: Sequence[int], k: int, *, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to ``k`` ids that followed the earlier occurrence of the last ``min_ngram`` ids of
    ``ids`` whose match is longest (``best_occurrence``: extended backwards, most recent of
    equals, among the last CANDIDATES occurrences); [] when they do not recur. The occurrence
    may overlap the suffix (a run repeats itself). A scan of the whole list: the reference
    for ``Drafter``'s index."""
    size, n = len(ids), min_ngram
    if k <= 0 or size <= n:
        return []
    suffix = list(ids[size - n:])
    starts = [s for s in range(size - n) if list(ids[s:s + n]) == suffix]  # the suffix itself excluded
    best = best_occurrence(ids, starts, n)
    return [] if best is None else list(ids[best[0] + n:best[0] + n + k])


def verifies_exactly(model: object) -> bool:
    """Whether ``model``'s multi-token passes give each row's logits bit for bit as one-token
    passes do, which speculation needs to leave the output unchanged: established for the CPU
    kernels (and a model that names no device); elsewhere not shown."""
    device = getattr(model, "device", None)
    return device is None or bool(device.is_cpu)


class Drafter:
    """Drafts of up to ``k`` ids for one request, looked up as ``draft_tokens`` does.

    The length adapts to how the last draft fared, read from the ids that followed it: all of
    it accepted, the next draft is twice as long (at most ``k``); a miss, one longer than what
    was accepted (at least 1). And a draft is no longer than its match is sure: one id fewer
    than the ids the occurrence matched (a bare ``min_ngram`` match drafts one id), any length
    once it matched all MAX_MATCH ids compared (a long run copied from the prompt). So a request that copies long runs is verified
    many ids a pass, and one whose drafts fail pays for short ones; the first is 2 long. Each
    length is a verifying pass of its own width, recorded once (the runner keeps several). A
    lookup that finds fewer ids than the length is padded with its last one (a guess like any
    other: verified, and kept only if right); no draft when fewer tokens remain to pick after
    the next than the length.

    The ids of one request only grow, so the drafter keeps an index of where each
    ``min_ngram``-gram occurs (ids already seen are not scanned again): a lookup compares at
    most CANDIDATES occurrences, not the whole sequence, and finds what ``draft_tokens`` finds.
    Ids that do not extend the ones indexed (another request's, or a shorter list) rebuild
    the index."""

    __slots__ = ("k", "min_ngram", "length", "_ids", "_starts", "_last_draft", "_drafted_at")

    def __init__(self, k: int, min_ngram: int = DRAFTER_MIN_NGRAM) -> None:
        self.k = k
        self.min_ngram = min_ngram
        self.length = min(k, FIRST_LENGTH)  # the next draft's length (before its match caps it)
        self._ids: list[int] = []  # the ids indexed so far
        self._starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its starts among them, in order
        self._last_draft: list[int] = []  # the last draft proposed, and len(ids) then
        self._drafted_at = 0

    def propose(self, ids: Sequence[int], room: int) -> list[int]:
        """Up to k ids continuing ``ids``, or [] when the last ids do not recur or ``room``
        (the tokens that may still be picked after the next one) is under the draft's length."""
        if self.k <= 0:
            return []
        self._adapt(ids)
        if room < self.length:
            return []
        self._catch_up(ids)
        found = self._find()
        if found is None:
            draft: list[int] = []
        else:
            start, matched = found
            length = self.length if matched >= MAX_MATCH else min(self.length, matched - 1)
            n = self.min_ngram
            draft = self._ids[start + n:start + n + length]
            draft = draft + draft[-1:] * (length - len(draft))
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
        known, n = self._ids, self.min_ngram
        if len(ids) < len(known) or list(ids[:len(known)]) != known:
            known.clear()
            self._starts.clear()
        for start in range(max(len(known) - n, 0), len(ids) - n):  # n-grams ending before the last id
            self._starts.setdefault(tuple(ids[start:start + n]), []).append(start)
        known.extend(ids[len(known):])

    def _find(self) -> tuple[int, int] | None:
        """(start, match length) of the best earlier occurrence of the last ids, or None."""
        ids, n = self._ids, self.min_ngram
        if len(ids) <= n:
            return None
        return best_occurrence(ids, self._starts.get(tuple(ids[len(ids) - n:]), ()), n)
