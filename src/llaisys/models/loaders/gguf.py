"""Reading GGUF files (llama.cpp's format): the container is parsed by ``gguf_file``.

Metadata becomes a ModelConfig and tokenizer fields. Matrices in the block formats the
native kernels compute on (``KEPT_QUANTIZED``) can be read as their raw blocks, straight from
the memory map when no fix applies; the others are dequantized with the ``gguf`` package's
``gguf.quants.dequantize``. What differs between architectures comes from the
file's ``general.architecture`` in ``models.architectures``: the config fields it sets, its
tensor names, and a fix for the rows of some tensors (Llama's q/k rows are stored in the order
of an interleaved rope), applied to float rows and raw rows alike (blocks run along a row, so
whole rows move).
"""
from __future__ import annotations

import collections
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy as np

from .. import architectures
from ..config import ModelConfig, is_token_id
from ..errors import ModelLoadError
from ..weights import WeightSource, check_weights, map_names, sanitize
from .gguf_file import BLOCK_SIZES, GGMLType, GGUFFile, GGUFTensor, parse

Q = GGMLType
SUPPORTED_TYPES = tuple(GGMLType(t) for t in BLOCK_SIZES)
# Matrices of these types can stay as stored (llaisys has a DataType and kernels for them).
KEPT_QUANTIZED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
FLOAT_KINDS = ("F32", "F16", "BF16")  # a matrix of these may be used as stored (WeightSource.mapped)

# "{arch}.<key>" metadata -> ModelConfig field.
GGUF_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
REQUIRED_KEYS = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count")


def open_gguf(path: str) -> GGUFFile:
    """The parsed GGUF file ``path``; a file it cannot parse is a ModelLoadError naming it."""
    try:
        return parse(path)
    except ModelLoadError:
        raise
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file") from None
    except RecursionError:  # arrays nested in arrays, deeper than Python's stack
        raise ModelLoadError(f"{path}: not a readable GGUF file: metadata arrays nested too deeply") from None
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError, OverflowError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file, truncated or corrupt ({type(exc).__name__}: {exc})") from exc


def metadata(gguf: GGUFFile, source: str | None = None) -> dict[str, Any]:
    """Every metadata key with its value (strings decoded, arrays as lists), as ``open_gguf``
    checked them (``source`` is kept for callers that name the file)."""
    return dict(gguf.meta)


def _config(meta: dict[str, Any], tensors: dict[str, Any], path: str) -> ModelConfig:
    """The config from the ``{arch}.*`` keys every architecture shares, then the fields the
    file's architecture sets."""
    architecture = architectures.get(meta.get("general.architecture"), path)
    arch = architecture.name
    missing = [f"{arch}.{k}" for k in REQUIRED_KEYS if f"{arch}.{k}" not in meta]
    if missing:
        raise ModelLoadError(f"{path}: missing metadata key(s) {', '.join(missing)}")
    values: dict[str, Any] = {"architecture": arch}
    names = {name: f"{arch}.{key}" for key, name in GGUF_CONFIG_KEYS.items() if f"{arch}.{key}" in meta}
    for key, name in GGUF_CONFIG_KEYS.items():
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, list):
            raise ModelLoadError(f"{path}: {arch}.{key} holds per-layer values {value[:4]}...; expected one number")
        if value is not None:
            values[name] = value
    rope, rope_names = _rope_settings(meta, tensors, arch, path)  # names: the keys, for messages
    values.update(rope)
    names.update(rope_names)
    if "vocab_size" not in values:
        values["vocab_size"] = _vocab_size(meta, tensors)
    values["tie_word_embeddings"] = architecture.gguf_names.to_file("lm_head") not in tensors
    values["bos_token_id"] = _token_id(meta, "tokenizer.ggml.bos_token_id", path)
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    values["eos_token_id"] = [i for k in eos_keys if (i := _token_id(meta, k, path)) is not None]
    values.update(architecture.gguf_config(meta, tensors.keys(), path))
    values["key_names"] = {**names, **values.get("key_names", {})}
    config = ModelConfig.from_dict(values, architecture.args).validate(path)
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and rope_dim != config.head_dim:
        raise ModelLoadError(
            f"{path}: {arch}.rope.dimension_count={rope_dim} rotates part of each head; expected the whole head_dim={config.head_dim}"
        )
    return config


ROPE_FREQS = "rope_freqs.weight"  # Llama 3.x: (R/2,) divisors of the rotary frequencies


def _rope_settings(meta: dict[str, Any], tensors: dict[str, Any], arch: str,
                   path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Config fields of the file's rope scaling, as llama.cpp reads it: ``{arch}.rope.scaling.type``
    "none" (whatever the factor), "linear" or "yarn" (with ``.factor`` and, for YaRN,
    ``.original_context_length``; YaRN's own tuning keys are refused by name); a factor without
    a type (or the old ``rope.scale_linear``) is linear scaling; the ``rope_freqs.weight`` tensor
    gives per-pair divisors of the frequencies. Applied (and checked) by ``models.rope``. With
    the keys they came from, for messages (``ModelConfig.key_names``)."""
    values: dict[str, Any] = {}
    factor_key = f"{arch}.rope.scaling.factor"
    if factor_key not in meta:
        factor_key = f"{arch}.rope.scale_linear"
    names = {"rope_scaling.rope_type": f"{arch}.rope.scaling.type", "rope_scaling.factor": factor_key,
             "rope_freq_factors": ROPE_FREQS}
    scaling = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(factor_key)
    if scaling is None and factor is not None and factor != 1.0:
        scaling = "linear"
    if scaling not in ("none", None, "linear", "yarn"):
        raise ModelLoadError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported; expected 'none', "
                             f"'linear' or 'yarn'")
    if scaling in ("linear", "yarn"):
        if factor is None:
            raise ModelLoadError(f"{path}: {arch}.rope.scaling.type={scaling!r} needs {arch}.rope.scaling.factor")
        values["rope_scaling"] = {"rope_type": scaling, "factor": factor}
    if scaling == "yarn":
        tuned = sorted(k for k in meta
                       if k.startswith(f"{arch}.rope.scaling.yarn_") or k == f"{arch}.rope.scaling.attn_factor")
        if tuned:
            raise ModelLoadError(f"{path}: {', '.join(tuned)} tune llama.cpp's YaRN in ways llaisys does not apply; "
                                 f"expected only {arch}.rope.scaling.factor and .original_context_length")
        original_key = f"{arch}.rope.scaling.original_context_length"
        if original_key not in meta:
            original_key = f"{arch}.context_length"
        values["rope_scaling"]["original_max_position_embeddings"] = meta.get(original_key)
        names["rope_scaling.original_max_position_embeddings"] = original_key
    t = tensors.get(ROPE_FREQS)
    if t is not None:
        if t.tensor_type not in (Q.F32, Q.F16) or len(t.shape) != 1:
            raise ModelLoadError(f"{path}: tensor {ROPE_FREQS!r} is {t.type_name} of shape {tuple(t.shape)}; "
                                 "expected a vector of F32 or F16 frequency divisors")
        values["rope_freq_factors"] = np.asarray(t.data, np.float32).reshape(-1).tolist()
    return values, names


def _vocab_size(meta: dict[str, Any], tensors: dict[str, Any]) -> int:
    """The vocabulary size of a file without ``{arch}.vocab_size``: its token list's length, or
    the embedding's row count; 0 (refused by the config check) when it has neither."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens:
        return len(tokens)
    return int(tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in tensors else 0


def _token_id(meta: dict[str, Any], key: str, path: str) -> int | None:
    """The token id ``meta[key]``; None when absent; a value of another type is a ModelLoadError."""
    value = meta.get(key)
    if value is not None and not is_token_id(value):
        raise ModelLoadError(f"{path}: {key} must be a token id (an integer >= 0), got {value!r}")
    return value


def _decode(t: GGUFTensor, part: np.ndarray, want: tuple[int, ...], path: str, shape: tuple[int, ...]) -> np.ndarray:
    """Stored rows ``part`` of tensor ``t`` as floats of shape ``want`` (quantized rows dequantized)."""
    if t.tensor_type in (Q.F32, Q.F16):
        arr = part
    elif t.tensor_type == Q.BF16:
        arr = part.view(np.uint8).view(ml_dtypes.bfloat16)
    else:
        arr = _dequantize(part, t.tensor_type)
    if arr.size != int(np.prod(want)):
        raise ModelLoadError(f"{path}: tensor {t.name!r} decoded to {arr.size} values; expected shape {shape}")
    return arr.reshape(want)


def _row_reader(t: GGUFTensor, shape: tuple[int, ...], path: str, fix: Callable[[np.ndarray], np.ndarray] | None):
    """A function giving rows [start, stop) of tensor ``t`` as floats (quantized rows dequantized)."""
    rows = t.data.reshape(shape[0], -1) if len(shape) > 1 else t.data.reshape(1, -1)  # (rows, stored row)

    def read_rows(start: int, stop: int) -> np.ndarray:
        arr = _decode(t, rows[start:stop], (stop - start, *shape[1:]) if len(shape) > 1 else shape, path, shape)
        return fix(arr) if fix is not None else arr
    return read_rows


def _matrix_row_reader(t: GGUFTensor, shape: tuple[int, int, int], path: str):
    """A function giving rows [start, stop) of matrix e of the stack ``t`` (E, N, K) as floats
    (stop - start, K), decoding only those rows."""
    e, n, k = shape
    rows = t.data.reshape(e * n, -1)  # (E*N, stored row)

    def read_matrix_rows(x: int, start: int, stop: int) -> np.ndarray:
        return _decode(t, rows[x * n + start:x * n + stop], (stop - start, k), path, shape)
    return read_matrix_rows


def _dequantize(raw: np.ndarray, raw_type: int) -> np.ndarray:
    """Stored blocks ``raw`` of ggml type ``raw_type`` as float32 (the gguf package imported
    only when a file needs it)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType(int(raw_type)))


def _raw_row_reader(t: GGUFTensor, shape: tuple[int, ...], fix: Callable[[np.ndarray], np.ndarray] | None):
    """A function giving rows [start, stop) of block-quantized matrix ``t`` as stored bytes,
    uint8 (stop - start, row_bytes); a stack of matrices (E, N, K) is read as its E*N rows."""
    rows = t.data.reshape(int(np.prod(shape[:-1])), -1).view(np.uint8)  # (rows, row_bytes)

    def read_raw_rows(start: int, stop: int) -> np.ndarray:
        part = rows[start:stop]
        return fix(part) if fix is not None else part
    return read_raw_rows


@dataclass
class GGUFContents:
    """What a GGUF file holds, checked: config, weights by our name, metadata, tensor types."""

    config: ModelConfig
    weights: dict[str, WeightSource]
    meta: dict[str, Any]
    tensor_types: dict[str, int] = field(default_factory=dict)  # type name -> count
    file: GGUFFile | None = None  # keeps the memory map alive while weights are read


def read_gguf(path: "str | os.PathLike[str]") -> GGUFContents:
    """Parse a GGUF file: config from metadata and strict, checked weight sources."""
    path = os.fspath(path)
    gguf = open_gguf(path)
    meta = gguf.meta
    tensors = {t.name: t for t in gguf.tensors}
    config = _config(meta, tensors, path)
    tensors.pop(ROPE_FREQS, None)  # read into the config (rope_freq_factors)
    arch = architectures.get(config.architecture)
    table = arch.gguf_names
    types = collections.Counter(t.type_name for t in gguf.tensors)
    sources: dict[str, WeightSource] = {}
    for name, t in tensors.items():
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has type {t.type_name}; supported: "
                f"{', '.join(q.name for q in SUPPORTED_TYPES)}"
            )
        shape = t.shape[::-1]  # ggml lists dims innermost first
        ours = table.to_ours(name)  # None: map_names reports it below
        fix, multiple = (arch.gguf_row_fix(ours, config) if ours is not None else None) or (None, 1)
        read_rows = _row_reader(t, shape, path, fix)
        rows = shape[0] if len(shape) > 1 else 1
        raw = _raw_row_reader(t, shape, fix) if len(shape) in (2, 3) and t.tensor_type in KEPT_QUANTIZED else None
        as_stored = raw is not None or (len(shape) == 2 and t.type_name in FLOAT_KINDS)  # bytes used as they lie
        mapped = (gguf.data, t.data_offset) if as_stored and fix is None and gguf.byte_order == "<" else None
        matrix_rows = _matrix_row_reader(t, shape, path) if len(shape) == 3 and fix is None else None
        sources[name] = WeightSource(path, name, shape, t.type_name, functools.partial(read_rows, 0, rows),
                                     read_rows if len(shape) > 1 else None, multiple, raw, mapped, matrix_rows)
    weights = arch.sanitize_weights(sanitize(map_names(sources, table, path, config.architecture), config), config,
                                    path)
    check_weights(weights, config, table, path, arch.layer_shapes)
    return GGUFContents(config, weights, meta, dict(types), gguf)


def tensor_values(t: GGUFTensor, path: str) -> np.ndarray:
    """The values of tensor ``t`` of the GGUF file ``path`` as floats, in NumPy order (ggml's dims
    reversed), quantized blocks dequantized; ModelLoadError for a type llaisys does not read."""
    if t.tensor_type not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{path}: tensor {t.name!r} has type {t.type_name}; supported: "
                             f"{', '.join(q.name for q in SUPPORTED_TYPES)}")
    shape = t.shape[::-1]
    return _row_reader(t, shape, path, None)(0, shape[0] if len(shape) > 1 else 1)
