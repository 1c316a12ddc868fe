"""Options shared by the sub-commands (model, dtype, device, plugins, sampling) and their use."""
from __future__ import annotations

import argparse
import logging
import re
import secrets
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

from ..engine import PrefillProgress
from ..generation import GenerationConfig
from ..generation.defaults import FALLBACK_SAMPLING, SAMPLING_KEYS, sampling_defaults
from ..runtime.dtypes import DataType

logger = logging.getLogger(__name__)

BAD_UTF8_NOTICE = "[the input was not valid UTF-8; its undecodable bytes were replaced with U+FFFD]"


class UsageError(ValueError):
    """A bad command line (an option's value out of range, options that do not go together, an
    empty prompt), found after parsing: reported like argparse's own errors, exit status 2."""


def command_name(args: argparse.Namespace) -> str:
    """The sub-command ``args`` run, as typed: ``generate``, ``plugin check``."""
    name = getattr(args, "command", None) or ""
    action = getattr(args, "plugin_command", None)
    return f"{name} {action}" if action else name


def _number_type(convert: type, low: float, high: float, what: str, name: str) -> "Callable[[str], Any]":
    """An argparse type converting with ``convert`` (int or float) and accepting ``low <= value
    <= high``; ``what`` names the expected value in its error."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            kind = "a whole number" if convert is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    parse.__name__ = name  # argparse names the type in some messages
    return parse


def byte_size(text: str) -> int:
    """A size in bytes: a whole number, or one with a unit K, M, G, T (powers of 1024; KiB,
    MB, GiB and the like read the same), e.g. 512M, 8G, 1.5GiB."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.I)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M, 8G or 1073741824, got {text!r}")
    value = float(match.group(1)) * 1024 ** " KMGT".index(match.group(2).upper() or " ")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text!r}")
    return int(value)


INF = float("inf")
positive_int = _number_type(int, 1, INF, "a number >= 1", "positive_int")
non_negative_int = _number_type(int, 0, INF, "a number >= 0", "non_negative_int")
non_negative_float = _number_type(float, 0, float.fromhex("0x1.fffffffffffffp+1023"), "a number >= 0",
                                  "non_negative_float")  # finite
port_number = _number_type(int, 0, 65535, "a port number in [0, 65535] (0: any free one)", "port_number")


def add_verbose(parser: argparse.ArgumentParser, dest: str = "verbose") -> None:
    """-v/--verbose: INFO logging; twice: DEBUG with tracebacks. ``llaisys`` takes it before the
    command too (``dest`` "global_verbose"); the counts add up."""
    parser.add_argument("-v", "--verbose", action="count", default=0, dest=dest,
                        help="log progress to stderr (twice: debug output and tracebacks)")


def add_model_options(parser: argparse.ArgumentParser, many: bool = False) -> None:
    """--model, --dtype, --device, --plugin, --threads, --quant-math, --tensor-parallel, -v.
    With ``many``, --model may be repeated (a list, None when not given)."""
    if many:
        parser.add_argument("-m", "--model", action="append", default=None, metavar="[NAME=]PATH",
                            help="a Hugging Face model folder, a .gguf file, or a name `llaisys list` shows "
                                 "(default: the bundled SmolLM2-135M); repeat it to serve several models, each "
                                 "loaded on its first request, named NAME or after its file")
    else:
        parser.add_argument("-m", "--model", default=None, metavar="PATH",
                            help="a Hugging Face model folder, a .gguf file, or a name `llaisys list` shows: "
                                 "org/name[:QUANT] of the Hugging Face cache, name[:tag] of ollama's "
                                 "(default: the bundled SmolLM2-135M)")
    parser.add_argument("--mmproj", default=None, metavar="PATH",
                        help="the vision tower of a GGUF vision-language model, as llama.cpp writes it (default: "
                             "the one mmproj*.gguf beside the model file, if any)")
    parser.add_argument("--dtype", choices=("f32", "bf16", "f16"), default=None,
                        help="weight data type (default: the model's own; quantized GGUF runs in f32)")
    parser.add_argument("--device", default=None,
                        help="device to run on, e.g. cpu, cpu:0 or a plugin's device (default: cpu)")
    parser.add_argument("--plugin", action="append", default=[], metavar="PATH",
                        help="load this device plugin library before the model; may be repeated")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="threads for the BLAS, OpenMP and quantized-kernel pools (default: the CPUs not busy with "
                             "other work; with --tensor-parallel N, the CPUs / N per rank)")
    parser.add_argument("--quant-math", choices=("int16", "int8", "f32"), default=None,
                        help="arithmetic of GGUF block-format weights on the CPU: int16 (activations as 16-bit "
                             "integers on the integer units; the default where the CPU has AVX512-VNNI or AVX-VNNI), int8 "
                             "(8-bit activations, as llama.cpp's: faster prompts and batches, further from "
                             "float32), f32 (float kernels; the default elsewhere). LLAISYS_QUANT_MATH sets it too")
    parser.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                        help="split every layer over N processes (MPI ranks); started with mpiexec when not "
                             "already under it (needs `pip install 'llaisys[mpi]'`)")
    add_verbose(parser)


def add_sampling_options(parser: argparse.ArgumentParser, *, max_new_tokens: int = 256) -> None:
    """--greedy, --temperature, --top-k, --top-p, --min-p, --repetition-penalty, --presence-penalty,
    --frequency-penalty, --seed, --max-new-tokens, --stop, --speculative-tokens."""
    fallback = describe_sampling(GenerationConfig(**FALLBACK_SAMPLING), seed=False)
    g = parser.add_argument_group("sampling", f"defaults: the model's generation_config.json, else {fallback}")
    g.add_argument("--greedy", action="store_true",
                   help="always pick the most likely token (temperature 0, no other sampling defaults)")
    g.add_argument("--temperature", type=float, default=None, help="softmax temperature; 0 means greedy")
    g.add_argument("--top-k", type=int, default=None, help="keep the K most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=None, help="keep the smallest set with probability >= P (1: off)")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below P times the top token's probability (0: off)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="penalty for tokens of the prompt and the reply so far (1: off)")
    g.add_argument("--presence-penalty", type=float, default=None,
                   help="subtract P from the logit of every token the reply already has, in [-2, 2] (0: off)")
    g.add_argument("--frequency-penalty", type=float, default=None,
                   help="subtract F times its count in the reply from a token's logit, in [-2, 2] (0: off)")
    g.add_argument("--seed", type=int, default=None, help="random seed; the same seed repeats the same text")
    g.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens, metavar="N",
                   help=f"stop after N tokens (default: {max_new_tokens})")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when TEXT appears (not printed); may be repeated")
    g.add_argument("--speculative-tokens", type=non_negative_int, default=0, metavar="N",
                   help="draft N tokens by prompt lookup and check them in one pass; the same text, "
                        "faster when the reply copies from the prompt; CPU only (default: 0, off)")


def _flag_names(message: str) -> str:
    """``message`` with ``GenerationConfig.top_p`` written as the option that sets it, ``--top-p``."""
    return re.sub(r"GenerationConfig\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)


def check_sampling_args(args: argparse.Namespace) -> None:
    """Validate the sampling options before the (slow) model load; raises UsageError naming
    the option and the values it takes."""
    values = {k: getattr(args, k) for k in SAMPLING_KEYS if getattr(args, k) is not None}
    try:
        GenerationConfig(**values, seed=args.seed, max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                         speculative_tokens=args.speculative_tokens)
    except (TypeError, ValueError) as exc:
        raise UsageError(_flag_names(str(exc))) from None


REFERENCE_PLUGIN = "libcustom_cpu.so"  # what `make plugins` builds into build/plugins/


def missing_plugin(path: str) -> str | None:
    """Why the plugin library ``path`` cannot be loaded when it is not there (with how to build
    the reference plugin when ``path`` names it), or None when it exists."""
    if Path(path).exists():
        return None
    why = f"{path}: no such file"
    if Path(path).name == REFERENCE_PLUGIN:
        why += f"; the reference plugin is built by `make plugins` (into build/plugins/{REFERENCE_PLUGIN})"
    return why


def load_plugins(paths: list[str]) -> None:
    """Load the ``--plugin`` libraries; a library that fails is a ValueError naming it."""
    if not paths:
        return
    from ..plugins import PluginError, load_plugin

    for path in paths:
        missing = missing_plugin(path)
        if missing is not None:
            raise FileNotFoundError(f"--plugin {missing}")
        try:
            plugin = load_plugin(path)
        except PluginError as exc:
            raise ValueError(f"--plugin {path}: {exc}") from exc
        logger.info("plugin %s serves device type %s", path, plugin.name)


def warn_if_slow_dtype(model: Any) -> None:
    """Warn when the model computes in f16 on the CPU: every op widens it to f32 and back."""
    if model.dtype is DataType.F16 and model.device.is_cpu:
        logger.warning("f16 on the CPU is computed by widening to f32 in every op: it decodes about 10 times "
                       "slower than f32 and 3 times slower than bf16; use --dtype f32 (fastest) or --dtype bf16 "
                       "(half the memory)")


def load_from_args(args: argparse.Namespace, source: str | None = None) -> Any:
    """Load the ``--plugin`` libraries, then the model the options name (the loader logs the time)."""
    from ..models import load_model

    load_plugins(args.plugin)
    comm = tensor_parallel_comm(args)
    device = args.device
    if comm is not None and device is not None and not device.startswith("cpu"):
        comm, device = plugin_device_comm(comm, device)
    model = load_model(source if source is not None else args.model, dtype=args.dtype, device=device,
                       progress=sys.stderr.isatty() and comm is None, comm=comm,  # a redrawn line would litter a log
                       mmproj=getattr(args, "mmproj", None))
    if comm is not None:
        lead_or_follow(model)
    warn_if_slow_dtype(model)
    return model


TENSOR_PARALLEL_LEADER: Any = None  # on rank 0 of a tensor-parallel run: its model, the others following it


def tensor_parallel_comm(args: argparse.Namespace) -> Any:
    """The communicator of a ``--tensor-parallel N`` run (N > 1; this process is one of the N
    ranks mpiexec started), or None. Raises ValueError when the rank count is not N."""
    ranks = getattr(args, "tensor_parallel", 1)
    if ranks <= 1:
        return None
    from ..parallel.mpi import MPICommunicator

    comm = MPICommunicator()
    if comm.size != ranks:
        raise ValueError(f"--tensor-parallel {ranks}, but mpiexec started {comm.size} ranks; give both the same number")
    if comm.rank:  # one rank speaks for all: the others say nothing but errors
        logging.getLogger().setLevel(logging.ERROR)
    return comm


def plugin_device_comm(mpi: Any, device: str) -> tuple[Any, str]:
    """For a tensor-parallel run on a plugin device: the plugin's collectives over the MPI
    ranks (``XcclCommunicator``), and the device of this rank: ``device`` as given when it
    names an index, else index rank % the device count (one device a rank on a host of several)."""
    from ..parallel.xccl import XcclCommunicator
    from ..runtime.device import as_device
    from ..runtime.runtime import get_runtime

    if ":" not in device:
        count = get_runtime(as_device(f"{device}:0")).backend.device_count()
        device = f"{device}:{mpi.rank % max(1, count)}"
    return XcclCommunicator(device, mpi), device


def following_rank(args: argparse.Namespace) -> bool:
    """Whether this process is a ``--tensor-parallel`` rank other than 0 (one that only runs
    its part of the model for rank 0)."""
    comm = tensor_parallel_comm(args)
    return comm is not None and not comm.is_driver


def lead_or_follow(model: Any) -> None:
    """Rank 0 goes on with the command (and when it ends, lets the others go; when it fails,
    ends them all at once, since they may be inside a collective it left); another rank runs
    rank 0's passes until then, and exits."""
    import atexit

    from ..models.tensor_parallel import follow, release

    global TENSOR_PARALLEL_LEADER
    if model.comm.is_driver:
        atexit.register(release, model)
        TENSOR_PARALLEL_LEADER = model
        return
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM):  # the launcher signals every rank; rank 0 decides how to stop
        signal.signal(sig, signal.SIG_IGN)
    follow(model)
    raise SystemExit(0)


def config_from_args(args: argparse.Namespace, model: Any) -> GenerationConfig:
    """The GenerationConfig of the options: the command line over ``sampling_defaults`` (the
    model's generation_config.json, else ``FALLBACK_SAMPLING``).

    When sampling without --seed, a seed is drawn and stored in the config, so it can be shown
    and the text repeated. The command line was checked by ``check_sampling_args``, so an error
    here is in the model's generation_config.json.
    """
    defaults = sampling_defaults(getattr(model, "generation_defaults", None))
    if args.greedy:
        defaults = {"temperature": 0.0}  # plain argmax unless a knob is given explicitly
    overrides = {k: getattr(args, k) for k in SAMPLING_KEYS}
    if args.greedy:
        overrides["temperature"] = 0.0
    try:
        cfg = GenerationConfig.from_defaults(defaults, **overrides, seed=args.seed,
                                             max_new_tokens=args.max_new_tokens, stop=tuple(args.stop) or None,
                                             speculative_tokens=args.speculative_tokens)
    except (TypeError, ValueError) as exc:
        bad = str(exc).replace("GenerationConfig.", "")
        raise type(exc)(f"the model's generation_config.json has a bad value: {bad}; "
                        "set that option on the command line") from None
    if not cfg.greedy and cfg.seed is None:
        cfg = cfg.replace(seed=secrets.randbelow(2**31))
    logger.info("sampling: %s", cfg)
    return cfg


def describe_sampling(cfg: GenerationConfig, seed: bool = True) -> str:
    """How tokens are picked, in one line (for --stats and --help); ``seed``: with the seed."""
    if cfg.greedy:
        parts = ["greedy"]
    else:
        parts = [f"temperature {cfg.temperature:g}"]
        if cfg.top_k:
            parts.append(f"top-k {cfg.top_k}")
        if cfg.top_p < 1:
            parts.append(f"top-p {cfg.top_p:g}")
        if cfg.min_p:
            parts.append(f"min-p {cfg.min_p:g}")
    if cfg.repetition_penalty != 1:
        parts.append(f"repetition penalty {cfg.repetition_penalty:g}")
    if cfg.presence_penalty:
        parts.append(f"presence penalty {cfg.presence_penalty:g}")
    if cfg.frequency_penalty:
        parts.append(f"frequency penalty {cfg.frequency_penalty:g}")
    if seed and not cfg.greedy:
        parts.append(f"seed {cfg.seed}")
    return ", ".join(parts)


# ---- text from the user ----------------------------------------------------------------------
def keep_undecodable_stdin() -> None:
    """Let stdin pass bytes that are not UTF-8 through as surrogate escapes (Python's way of
    keeping them), so that reading never fails; ``repair_text`` then replaces them."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")


def repair_text(text: str) -> tuple[str, bool]:
    """``text`` with bytes that were not UTF-8 (surrogate escapes, as Python keeps them in
    arguments and stdin) replaced by U+FFFD, and whether there were any."""
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        pass
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte
        data = text.encode("utf-8", "replace")
    return data.decode("utf-8", "replace"), True


def user_text(text: str) -> str:
    """``text`` repaired by ``repair_text``; says so on stderr (one line) when it had to."""
    text, repaired = repair_text(text)
    if repaired:
        print(BAD_UTF8_NOTICE, file=sys.stderr)
    return text


# ---- progress ------------------------------------------------------------------------------
class PrefillLine:
    """Shows ``prefill 256/2048 tokens`` on ``stream`` while a long prompt runs, and clears it
    when the prompt is done. Use ``prefill_progress()`` to get one only on a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if done < total:
            self.stream.write(f"\rprefill {done}/{total} tokens")
            self.shown = True
        elif self.shown:
            self.stream.write("\r\033[K")  # erase the line: the reply starts where it was
            self.shown = False
        self.stream.flush()


def prefill_progress(stream: TextIO | None = None) -> PrefillProgress | None:
    """A PrefillLine on ``stream`` (default stderr) when it is a terminal, else None."""
    stream = stream or sys.stderr
    return PrefillLine(stream) if stream.isatty() else None


def read_image(path: str) -> Any:
    """The image in the file ``path`` as an RGB PIL image, decoded with the default limits
    (``vision.images``); UsageError naming the path when it cannot be read or is no image."""
    from ..vision.images import ImageError, ImageLimits, decode_image

    limits = ImageLimits()
    try:
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)
    except OSError as exc:
        raise UsageError(f"--image {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        return decode_image(data, limits)
    except ImageError as exc:
        raise UsageError(f"--image {path}: {exc}") from None
