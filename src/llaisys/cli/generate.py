"""``llaisys generate PROMPT``: stream a continuation (or, for a chat model, a reply) to stdout."""
from __future__ import annotations

import argparse
import sys

from ..engine import GenerationStream, stream, stream_chat
from .common import (UsageError, add_model_options, add_sampling_options, check_sampling_args, config_from_args,
                     describe_sampling, keep_undecodable_stdin, load_from_args, prefill_progress, read_image,
                     user_text)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` sub-command."""
    p = subparsers.add_parser("generate", help="generate text from a prompt",
                              description="Stream the model's text for PROMPT to stdout. A model with a chat "
                                          "template gets PROMPT as a user message (turn off with --no-chat).")
    p.add_argument("prompt", help="the prompt; '-' reads it from stdin")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap PROMPT as a user message in the chat template (default: when the model has one)")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message (with --chat)")
    p.add_argument("--stats", action="store_true", help="print timings to stderr at the end")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for a vision-language model (PNG, JPEG, WebP, GIF, BMP; repeat for several): "
                        "with --chat it comes before PROMPT in the user message; without, PROMPT's image "
                        "placeholders mark where each goes (none: the images come first)")
    add_model_options(p)
    add_sampling_options(p)
    p.set_defaults(func=run)


def print_stream(events: GenerationStream) -> None:
    """Write each text delta to stdout as it comes."""
    out = sys.stdout
    for event in events:
        if event.text_delta:
            out.write(event.text_delta)
            out.flush()


def print_stats(events: GenerationStream) -> None:
    """Timings of a finished stream, one line on stderr."""
    t = events.timings
    cached = f" ({t.cached_tokens} cached)" if t.cached_tokens else ""
    print(f"[{t.prompt_tokens} prompt tokens{cached}, {t.generated_tokens} generated ({events.finish_reason}); "
          f"prefill {t.prefill_tokens_per_s:.1f} tok/s, decode {t.decode_tokens_per_s:.1f} tok/s, "
          f"time to first token {t.ttft_s * 1000:.0f} ms; {describe_sampling(events.config)}]", file=sys.stderr)


def read_prompt(arg: str) -> str:
    """The prompt argument, or all of stdin for ``-`` (bytes that are not UTF-8 kept as escapes)."""
    if arg != "-":
        return arg
    keep_undecodable_stdin()
    return sys.stdin.read()


def check_prompt(prompt: str, arg: str) -> None:
    """UsageError when ``prompt`` (read from the argument ``arg``) has nothing but white space."""
    if not prompt.strip():
        where = " read from stdin ('-')" if arg == "-" else ""
        raise UsageError(f"the prompt{where} is {'only white space' if prompt else 'empty'}; "
                         "give the text to answer or continue")


def run(args: argparse.Namespace) -> int:
    """Check the options, load the model, generate, stream to stdout."""
    if args.system and args.chat is False:
        raise UsageError("--system needs the chat template; drop --no-chat")
    check_sampling_args(args)
    prompt = user_text(read_prompt(args.prompt))
    check_prompt(prompt, args.prompt)
    system = user_text(args.system) if args.system else None
    images = [read_image(path) for path in args.image]
    model = load_from_args(args)
    if images and getattr(model, "vision", None) is None:
        raise UsageError(f"--image: {model.source} has no vision encoder; it takes text only")
    cfg = config_from_args(args, model)
    use_chat = args.chat if args.chat is not None else bool(model.tokenizer.chat_template)
    progress = prefill_progress()
    if use_chat:
        messages = ([{"role": "system", "content": system}] if system else [])
        content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": prompt}]
        events = stream_chat(model, messages + [{"role": "user", "content": content if images else prompt}], cfg,
                             prefill_progress=progress)
    else:
        if system:
            raise ValueError(f"--system needs a chat template, and {model.source} has none")
        events = stream(model, prompt, cfg, prefill_progress=progress, images=images)
    print_stream(events)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        print_stats(events)
    return 0
