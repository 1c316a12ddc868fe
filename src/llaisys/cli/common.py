"""Options shared by the sub-commands (model, dtype, device, sampling) and their use."""
from __future__ import annotations

import argparse
import logging
import secrets
import sys
import time
from typing import Any

from ..generation import GenerationConfig

logger = logging.getLogger(__name__)

# Sampling used when neither the command line nor the model's generation_config.json says
# otherwise. Small models loop under greedy decoding and ramble at temperature 0.7; a low
# temperature with nucleus sampling reads best on SmolLM2-135M. A repetition penalty is left
# off: it also penalizes every prompt token, chat template included, which hurts small models.
CLI_SAMPLING = {"temperature": 0.3, "top_p": 0.9}
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """-v/--verbose: INFO logging; twice: DEBUG with tracebacks."""
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log progress to stderr (twice: debug output and tracebacks)")


def add_model_options(parser: argparse.ArgumentParser, *, model_flag: bool = True) -> None:
    """--model, --dtype, --device, --threads."""
    if model_flag:
        parser.add_argument("-m", "--model", default=None, metavar="PATH",
                            help="a Hugging Face model folder or a .gguf file (default: the bundled SmolLM2-135M)")
    parser.add_argument("--dtype", choices=("f32", "bf16", "f16"), default=None,
                        help="weight data type (default: the model's own; quantized GGUF runs in f32)")
    parser.add_argument("--device", default=None, help="device to run on, e.g. cpu or cpu:0 (default: cpu)")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="threads for the BLAS and OpenMP pools (default: the libraries' choice)")
    add_verbose(parser)


def add_sampling_options(parser: argparse.ArgumentParser, *, max_new_tokens: int = 256) -> None:
    """--greedy, --temperature, --top-k, --top-p, --min-p, --repetition-penalty, --seed, --max-new-tokens, --stop."""
    g = parser.add_argument_group("sampling", "defaults: the model's generation_config.json, else "
                                  "temperature 0.3, top-p 0.9")
    g.add_argument("--greedy", action="store_true",
                   help="always pick the most likely token (temperature 0, no other sampling defaults)")
    g.add_argument("--temperature", type=float, default=None, help="softmax temperature; 0 means greedy")
    g.add_argument("--top-k", type=int, default=None, help="keep the K most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=None, help="keep the smallest set with probability >= P (1: off)")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below P times the top token's probability (0: off)")
    g.add_argument("--repetition-penalty", type=float, default=None, help="penalty for tokens seen so far (1: off)")
    g.add_argument("--seed", type=int, default=None, help="random seed; the same seed repeats the same text")
    g.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens, metavar="N",
                   help=f"stop after N tokens (default: {max_new_tokens})")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when TEXT appears (not printed); may be repeated")


def check_sampling_args(args: argparse.Namespace) -> None:
    """Validate the sampling options before the (slow) model load; raises ValueError/TypeError."""
    values = {k: getattr(args, k) for k in SAMPLING_KEYS if getattr(args, k) is not None}
    GenerationConfig(**values, seed=args.seed, max_new_tokens=args.max_new_tokens, stop=tuple(args.stop))


def load_from_args(args: argparse.Namespace, source: str | None = None) -> Any:
    """Load the model the options name; logs the load time."""
    from ..models import load_model

    t0 = time.perf_counter()
    model = load_model(source if source is not None else args.model, dtype=args.dtype, device=args.device,
                       progress=sys.stderr.isatty())  # a redrawn line would litter a log file
    logger.info("loaded %s in %.2f s", model.source, time.perf_counter() - t0)
    return model


def config_from_args(args: argparse.Namespace, model: Any) -> GenerationConfig:
    """The GenerationConfig of the options: command line over the model's defaults over CLI_SAMPLING.

    When sampling without --seed, a seed is drawn and stored in the config, so it can be shown
    and the text repeated.
    """
    defaults = dict(getattr(model, "generation_defaults", None) or {})
    if args.greedy:
        defaults = {"temperature": 0.0}  # plain argmax unless a knob is given explicitly
    elif not any(k in defaults for k in (*SAMPLING_KEYS, "do_sample")):
        defaults = {**defaults, **CLI_SAMPLING}
    overrides = {k: getattr(args, k) for k in SAMPLING_KEYS}
    if args.greedy:
        overrides["temperature"] = 0.0
    cfg = GenerationConfig.from_defaults(defaults, **overrides, seed=args.seed, max_new_tokens=args.max_new_tokens,
                                         stop=tuple(args.stop) or None)
    if not cfg.greedy and cfg.seed is None:
        cfg = cfg.replace(seed=secrets.randbelow(2**31))
    logger.info("sampling: %s", cfg)
    return cfg


def describe_sampling(cfg: GenerationConfig) -> str:
    """One line saying how tokens were picked (for --stats)."""
    if cfg.greedy:
        return "greedy"
    parts = [f"temperature {cfg.temperature:g}"]
    if cfg.top_k:
        parts.append(f"top-k {cfg.top_k}")
    if cfg.top_p < 1:
        parts.append(f"top-p {cfg.top_p:g}")
    if cfg.min_p:
        parts.append(f"min-p {cfg.min_p:g}")
    if cfg.repetition_penalty != 1:
        parts.append(f"repetition penalty {cfg.repetition_penalty:g}")
    parts.append(f"seed {cfg.seed}")
    return ", ".join(parts)
