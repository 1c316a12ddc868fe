"""ThinkingBudget: a request's reasoning budget, the tokens it forces to close a think block."""
from __future__ import annotations

from typing import Any

from ..generation import GenerationConfig
from ..generation.results import SampledToken


def close_ids(end: tuple[int, ...], tokenizer: Any) -> tuple[int, ...]:
    """The ids of ``end`` that close a think block: ``end`` without the blank tokens it ends
    with (the newline after ``</think>``), which a model may write otherwise."""
    n = len(end)
    while n > 1 and tokenizer is not None and not tokenizer.decode([end[n - 1]], skip_special_tokens=False).strip():
        n -= 1
    return end[:n]


class ThinkingBudget:
    """Follows one reply token by token (``GenerationConfig.reasoning_budget``): waits for the
    ``reasoning_open`` ids (none: the prompt opened the block), counts the thinking tokens, and
    once ``budget`` of them ran without the ``close`` ids (the model ended its thinking) replaces
    the next picks by the ``reasoning_end`` ids, one per step. Plain Python, no tensors."""

    __slots__ = ("budget", "open", "end", "close", "state", "seen", "thought")

    def __init__(self, config: GenerationConfig, close: tuple[int, ...] | None = None) -> None:
        assert config.reasoning_budget is not None and config.reasoning_end
        self.budget = config.reasoning_budget
        self.open = config.reasoning_open
        self.end = config.reasoning_end
        self.close = close or self.end  # what the model itself writes to end its thinking
        self.state = "opening" if self.open else "thinking"  # then "forcing", and "done"
        self.seen = 0  # tokens of the open ids seen, or of the end ids forced
        self.thought: list[int] = []  # the thinking tokens generated so far

    def pick(self, picked: SampledToken) -> SampledToken:
        """The token to append instead of ``picked`` (``picked`` itself unless the budget ran
        out); a forced token keeps the step's top logprobs and reports logprob 0 (it was sure)."""
        if self.state == "opening":
            if picked.token_id != self.open[self.seen]:
                self.state = "done"  # the reply does not think
            else:
                self.seen += 1
                if self.seen == len(self.open):
                    self.state, self.seen = "thinking", 0
            return picked
        if self.state == "thinking":
            if len(self.thought) < self.budget:
                self.thought.append(picked.token_id)
                if picked.token_id == self.close[-1] and tuple(self.thought[-len(self.close):]) == self.close:
                    self.state = "done"  # closed in time
                return picked
            self.state = "forcing"
        if self.state == "forcing":
            token = self.end[self.seen]
            self.seen += 1
            if self.seen == len(self.end):
                self.state = "done"
            logprob = None if picked.logprob is None else 0.0
            return SampledToken(token, logprob, picked.top_logprobs)
        return picked
