"""Stop strings: find the first one in streamed text and hold back text that may begin one."""
from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Filters a text stream through a set of stop strings.

    ``push`` returns the text that is safe to show: everything before a stop string once one
    appears (the stop string itself is never shown), and otherwise everything except a tail
    that could still grow into a stop string.
    """

    __slots__ = ("stops", "_pending", "_longest", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self._longest = max((len(s) for s in self.stops), default=0)
        self.stopped = False

    def push(self, text: str) -> str:
        """Add ``text``; return what can be emitted now. Sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        pending = self._pending + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return pending[:min(hits)]
        hold = self._held_tail(pending)
        self._pending = pending[len(pending) - hold:] if hold else ""
        return pending[:len(pending) - hold]

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """Release the held tail (the text ended without completing a stop string)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
