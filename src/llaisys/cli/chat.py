"""``llaisys chat``: an interactive chat with history, streaming replies.

Reads one user message per line, from a terminal or a pipe. Lines starting with ``/`` are
commands (see HELP). The KV cache of the conversation so far is kept between turns, so each
turn runs only its new tokens.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

from ..engine import LLMEngine, stream_chat
from ..generation import GenerationConfig
from ..generation.defaults import CHAT_MAX_TOKENS
from .common import (add_model_options, add_sampling_options, check_sampling_args, config_from_args,
                     keep_undecodable_stdin, load_from_args, prefill_progress, read_image, user_text)
from .generate import print_stats

HELP = """commands:
  /help          this text
  /reset         forget the conversation (the system message stays)
  /system TEXT   set the system message and start over (/system alone removes it)
  /image PATH    attach an image to your next message (a vision-language model)
  /quit          leave (also /exit, Ctrl-D or Ctrl-C)"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``chat`` sub-command."""
    p = subparsers.add_parser("chat", help="chat with a model interactively",
                              description="Chat with the model; one message per line. " + HELP.replace("\n", " "),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message to start with")
    p.add_argument("--stats", action="store_true", help="print timings to stderr after each reply")
    add_model_options(p)
    add_sampling_options(p, max_new_tokens=CHAT_MAX_TOKENS)
    p.set_defaults(func=run)


class Conversation:
    """Chat history plus the engine whose prefix cache holds its tokens."""

    def __init__(self, model: Any, config: GenerationConfig, system: str | None = None) -> None:
        self.model = model
        self.config = config
        self.system = system
        self.messages: list[dict[str, Any]] = []
        self.images: list[Any] = []  # attached to the next user message
        self.engine = LLMEngine(model)  # each turn runs only the blocks earlier turns did not fill
        self.progress = prefill_progress()

    def reset(self) -> None:
        """Forget the turns (and attached images), keep the system message. The prefix cache stays:
        the next prompt shares its start."""
        self.messages.clear()
        self.images.clear()

    def set_system(self, system: str | None) -> None:
        """Replace the system message (None removes it) and start over."""
        self.system = system
        self.messages.clear()

    def attach(self, path: str) -> str:
        """Attach the image at ``path`` to the next message; what to tell the user. UsageError
        for a file that is no image, ValueError for a model without vision."""
        if getattr(self.model, "vision", None) is None:
            raise ValueError(f"{self.model.source} has no vision encoder; it takes text only")
        image = read_image(path)
        self.images.append(image)
        return f"[attached {path} ({image.size[0]}x{image.size[1]}); it goes with your next message]"

    def _all_messages(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def reply(self, text: str, stats: bool = False) -> None:
        """Stream the reply to ``text`` to stdout and add both to the history.

        On Ctrl-C the partial reply is dropped with its question; on an error (the conversation
        outgrew the context) the question is dropped and the error goes to the caller.
        """
        content: Any = text
        if self.images:
            content = [{"type": "image", "image": image} for image in self.images] + [{"type": "text", "text": text}]
        self.messages.append({"role": "user", "content": content})
        try:
            events = stream_chat(self.engine, self._all_messages(), self.config, prefill_progress=self.progress)
            try:
                for event in events:
                    if event.text_delta:
                        sys.stdout.write(event.text_delta)
                        sys.stdout.flush()
            finally:
                events.close()  # an interrupted reply leaves the engine
                sys.stdout.write("\n")
                sys.stdout.flush()
        except BaseException:
            self.messages.pop()
            raise
        self.images = []
        self.messages.append({"role": "assistant", "content": events.text})
        if stats:
            print_stats(events)


def _lines(interactive: bool) -> Iterator[str]:
    """User lines until end of input; bytes that are not UTF-8 are replaced (with a notice)."""
    keep_undecodable_stdin()
    for line in _raw_lines(interactive):
        yield user_text(line)


def _raw_lines(interactive: bool) -> Iterator[str]:
    if not interactive:
        for line in sys.stdin:
            yield line.rstrip("\r\n")
        return
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    while True:
        try:
            yield input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return


def run(args: argparse.Namespace) -> int:
    """Load the model and chat until /quit or end of input."""
    check_sampling_args(args)
    model = load_from_args(args)
    if not model.tokenizer.chat_template:
        raise ValueError(f"{model.source} has no chat template; use `llaisys generate --no-chat` instead")
    conv = Conversation(model, config_from_args(args, model), user_text(args.system) if args.system else None)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {model.source}; /help for commands", file=sys.stderr)
    try:
        for line in _lines(interactive):
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                cmd, _, rest = text.partition(" ")
                if cmd in ("/quit", "/exit"):
                    break
                if cmd == "/help":
                    print(HELP, file=sys.stderr)
                elif cmd == "/reset":
                    conv.reset()
                    print("[conversation reset]", file=sys.stderr)
                elif cmd == "/image":
                    try:
                        print(conv.attach(rest.strip()), file=sys.stderr)
                    except ValueError as exc:
                        print(f"error: {exc}", file=sys.stderr)
                elif cmd == "/system":
                    conv.set_system(rest.strip() or None)
                    print("[system message set]" if rest.strip() else "[system message removed]", file=sys.stderr)
                else:
                    print(f"unknown command {cmd}; /help lists the commands", file=sys.stderr)
                continue
            try:
                conv.reply(text, stats=args.stats)
            except KeyboardInterrupt:
                print("[interrupted]", file=sys.stderr)
                if not interactive:
                    raise
            except ValueError as exc:
                print(f"error: {exc}; /reset to start over", file=sys.stderr)
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0
