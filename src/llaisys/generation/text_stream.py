"""From picked token ids to released text: incremental detokenization, stop strings held back
across token boundaries, end-of-sequence ids and the token limit, in one place for the
single-sequence loop and the serving engine alike."""
from __future__ import annotations

from collections.abc import Collection, Sequence

from .detokenizer import IncrementalDetokenizer
from .results import FinishReason
from .stopping import StopStringMatcher


class _NoText:
    """The detokenizer of a model without a tokenizer: token ids stream with no text."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class TextStream:
    """Feed it each picked token (``push``); it returns the text that token releases and says
    when the sequence ends: at an id in ``eos`` ("stop"), at a stop string ("stop", the string
    not shown), or at the ``limit``-th token ("length"). ``tokenizer`` None streams ids only."""

    __slots__ = ("detok", "stops", "eos", "limit", "count", "finish_reason", "text")

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str], eos: Collection[int],
                 limit: int, skip_special_tokens: bool = True) -> None:
        self.detok = (IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
                      if tokenizer is not None else _NoText())
        self.stops = StopStringMatcher(stop)
        self.eos = eos
        self.limit = limit
        self.count = 0
        self.finish_reason: FinishReason | None = None
        self.text = ""

    def push(self, token: int) -> str:
        """Take the next picked token; return the text it releases (maybe ""). Sets
        ``finish_reason`` on the last one."""
        if self.finish_reason is not None:
            raise RuntimeError("the sequence has already finished")
        self.count += 1
        stops = self.stops
        finish: FinishReason | None = None
        if token in self.eos:
            delta = stops.push(self.detok.flush())
            finish = "stop"
        else:
            delta = stops.push(self.detok.push(token))
            if stops.stopped:
                finish = "stop"
            elif self.count >= self.limit:
                delta += stops.push(self.detok.flush())
                finish = "stop" if stops.stopped else "length"
        if finish is not None and not stops.stopped:
            delta += stops.flush()
        self.finish_reason = finish
        self.text += delta
        return delta
