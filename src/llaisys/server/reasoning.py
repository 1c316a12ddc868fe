"""Reasoning: a model's ``<think>...</think>`` returned apart, as ``reasoning_content``, and the
reader that splits a streamed reply into reasoning, content and tool calls.

A model reasons when its chat template speaks of ``<think>`` (Qwen3, DeepSeek-R1, QwQ). Its
reply begins with ``<think>`` (Qwen3), or the prompt ends with it (DeepSeek-R1's template, and
``ReasoningParser(started=True)``); the reasoning runs to ``</think>``, the content after it. A
reply cut before ``</think>`` is all reasoning when it began so, and a reply without
``<think>`` is all content (Qwen3 with ``enable_thinking: false`` writes an empty think block
into the prompt).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .tool_calls import Deltas

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_reasons(source: Any) -> bool:
    """Whether a chat template's model writes ``<think>`` blocks."""
    return THINK_OPEN in str(source or "")


def think_end(source: Any) -> str:
    """The text that ends a think block in a chat template's replies: ``</think>`` and the most
    newlines the template writes after one (Qwen3's ``'\\n</think>\\n\\n'``), one newline
    when it shows none (the reader drops them either way)."""
    most = 1
    for tail in str(source or "").split(THINK_CLOSE)[1:]:
        newlines = 0
        while True:  # a real newline, or the escape "\\n" inside a Jinja string
            if tail.startswith("\n"):
                tail = tail[1:]
            elif tail.startswith("\\n"):
                tail = tail[2:]
            else:
                break
            newlines += 1
        most = max(most, newlines)
    return THINK_CLOSE + "\n" * most


def _held(text: str, marker: str) -> int:
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Splits streamed text into (reasoning, content); ``started``: the prompt opened the
    think block already."""

    def __init__(self, started: bool = False) -> None:
        self.state = "reasoning" if started else "start"  # "start", "reasoning", "content"
        self._pending = ""
        self._after_close = False  # newlines right after </think> are dropped

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) ``text`` releases; text that may begin a tag is held back."""
        reasoning = content = ""
        self._pending += text
        while True:
            pending = self._pending
            if self.state == "start":
                head = pending.lstrip()
                if head.startswith(THINK_OPEN):
                    self._pending, self.state = head[len(THINK_OPEN):], "reasoning"
                    continue
                if head and not THINK_OPEN.startswith(head):
                    self.state = "content"
                    continue
                return reasoning, content
            if self.state == "reasoning":
                at = pending.find(THINK_CLOSE)
                if at >= 0:
                    reasoning += pending[:at]
                    self._pending, self.state = pending[at + len(THINK_CLOSE):], "content"
                    self._after_close = True
                    continue
                keep = _held(pending, THINK_CLOSE)
                reasoning += pending[:len(pending) - keep]
                self._pending = pending[len(pending) - keep:]
                return reasoning, content
            if self._after_close:
                pending = pending.lstrip("\n")
                self._after_close = not pending
            content += pending
            self._pending = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is left at the end: held text of a think block is reasoning, else content."""
        pending, self._pending = self._pending, ""
        return (pending, "") if self.state == "reasoning" else ("", pending)


@dataclass(slots=True)
class ReplyDeltas:
    """What one piece of a reply released: reasoning, content and tool call deltas."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ReplyReader:
    """One choice's reply read as it streams: reasoning split off first (``reasoning``), then
    tool calls out of the content (``tools``, a parser of ``tool_calls``); either may be None.
    ``max_calls``: calls kept (``parallel_tool_calls: false`` keeps the first), None: all."""

    def __init__(self, reasoning: ReasoningParser | None, tools: Any, max_calls: int | None = None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls
        self.reasoning_text = ""
        self.content_text = ""

    @property
    def calls(self) -> list:
        calls = self.tools.calls if self.tools is not None else []
        return calls if self.max_calls is None else calls[:self.max_calls]

    def feed(self, text: str) -> ReplyDeltas:
        """The deltas of the next piece of text."""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
        else:
            thought = ""
        return self._content(thought, text, final=False)

    def finish(self) -> ReplyDeltas:
        """The deltas left at the end of the reply."""
        thought, text = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._content(thought, text, final=True)

    def read(self, text: str, last: bool) -> ReplyDeltas:
        """The deltas of the next piece of text, and of the end too when it is the ``last``."""
        out = self.feed(text)
        if last:
            end = self.finish()
            out = ReplyDeltas(out.reasoning + end.reasoning, out.content + end.content, out.calls + end.calls)
        return out

    def _content(self, thought: str, text: str, final: bool) -> ReplyDeltas:
        out = ReplyDeltas(reasoning=thought)
        if self.tools is not None:
            d: Deltas = self.tools.feed(text)
            if final:
                end = self.tools.finish()
                d = Deltas(d.content + end.content, d.calls + end.calls)
            out.content = d.content
            out.calls = [c for c in d.calls if self.max_calls is None or c["index"] < self.max_calls]
        else:
            out.content = text
        self.reasoning_text += out.reasoning
        self.content_text += out.content
        return out

    def whole(self, text: str) -> tuple[str | None, str | None, list]:
        """(reasoning, content, tool calls) of a whole reply (this reader unused so far).
        Reasoning is None when the model wrote none (or does not reason); content is None
        when only blanks are left beside tool calls."""
        self.feed(text)
        self.finish()
        reasoning = self.reasoning_text if self.reasoning is not None and self.reasoning_text else None
        content: str | None = self.content_text
        if self.calls and not content.strip():
            content = None
        return reasoning, content, self.calls
