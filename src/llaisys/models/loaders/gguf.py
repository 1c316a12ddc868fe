"""Reading GGUF files (llama.cpp's format) with the ``gguf`` package.

Metadata becomes a ModelConfig and tokenizer fields. Matrices in the block formats the
native kernels compute on (``KEPT_QUANTIZED``) can be read as their raw blocks; the others are
dequantized with ``gguf.quants.dequantize``. What differs between architectures comes from the
file's ``general.architecture`` in ``models.architectures``: the config fields it sets, its
tensor names, and a fix for the rows of some tensors (Llama's q/k rows are stored in the order
of an interleaved rope), applied to float rows and raw rows alike (blocks run along a row, so
whole rows move).
"""
from __future__ import annotations

import collections
import functools
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from .. import architectures
from ..config import ModelConfig, is_token_id
from ..errors import ModelLoadError
from ..weights import WeightSource, check_weights, map_names, sanitize

log = logging.getLogger(__name__)

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Matrices of these types can stay as stored (llaisys has a DataType and kernels for them).
KEPT_QUANTIZED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)

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


GGML_MAX_DIMS = 4
_ARRAY, _STRING = int(GGUFValueType.ARRAY), int(GGUFValueType.STRING)
_SCALARS = {int(k): np.dtype(v) for k, v in GGUFReader.gguf_scalar_to_np.items()}


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of the memory map (the ``np.memmap`` subclass makes
    each of the reader's many small slices slow), checking each tensor's extent first so a
    truncated file is reported with the tensor that runs past its end."""

    def __init__(self, path: str):
        self._path = path
        super().__init__(path, "r")

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
        # Arrays (the vocabulary, its types and merges: ~150k entries) are parsed here in tight
        # loops, into the same parts layout as the reader's own, which spends ~8 us per element.
        data = self._plain
        if raw_type != _ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = int(data[orig_offs:orig_offs + 4].view(np.uint32)[0])
        scalar = _SCALARS.get(item_type)
        if item_type != _STRING and scalar is None:
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs + 12
        parts: list[np.ndarray] = [data[orig_offs:orig_offs + 4].view(np.uint32), data[orig_offs + 4:offs].view(np.uint64)]
        count = int(parts[1][0])
        end = len(data)
        if scalar is not None:
            stop = offs + count * scalar.itemsize
            if stop > end:
                raise ValueError(f"array at byte {orig_offs} runs past the end of the file ({end} bytes)")
            values = data[offs:stop].view(scalar)
            parts += [values[i:i + 1] for i in range(count)]
            return stop - orig_offs, parts, list(range(2, 2 + count)), [GGUFValueType.ARRAY, GGUFValueType(item_type)]
        for _ in range(count):
            length = data[offs:offs + 8].view(np.uint64)
            stop = offs + 8 + int(length[0])
            if stop > end:
                raise ValueError(f"string at byte {offs} runs past the end of the file ({end} bytes)")
            parts.append(length)
            parts.append(data[offs + 8:stop])
            offs = stop
        return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), [GGUFValueType.ARRAY, GGUFValueType.STRING]

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        check_layout(self._path, [_tensor_info(self._path, f) for f in fields], start_offs, int(self.alignment),
                     len(self._plain))
        super()._build_tensors(start_offs, fields)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a GGUF header, as stored."""

    name: str
    raw_type: int  # GGMLQuantizationType id
    dims: tuple[int, ...]  # ggml order: innermost (row length) first
    offset: int  # bytes from the start of the data section


def _tensor_info(path: str, f: Any) -> TensorInfo:
    """The entry of the reader's tensor field ``f`` (parts: name length, name, dimension count,
    dimensions, type, offset)."""
    n_dims, dims = int(f.parts[2][0]), tuple(int(d) for d in f.parts[3])
    if not 1 <= n_dims <= GGML_MAX_DIMS or len(dims) != n_dims:
        raise ModelLoadError(f"{path}: tensor {f.name!r} has {n_dims} dimensions; expected 1 to {GGML_MAX_DIMS}")
    return TensorInfo(f.name, int(f.parts[4][0]), dims, int(f.parts[5][0]))


def check_layout(path: str, tensors: list[TensorInfo], data_start: int, alignment: int, file_size: int) -> None:
    """Check the header's tensors against the file before any of them is mapped: known types,
    no empty dimensions, whole quantization blocks per row, unique names, and byte ranges
    that start at a multiple of ``alignment``, end inside the file and overlap no other tensor.

    Raises ModelLoadError naming the file and the tensor.
    """
    spans = []
    names: set[str] = set()
    for t in tensors:
        if t.name in names:
            raise ModelLoadError(f"{path}: tensor {t.name!r} appears twice in the header")
        names.add(t.name)
        start = data_start + t.offset
        end = start + _tensor_bytes(path, t)
        if t.offset % alignment:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} starts at data offset {t.offset}, "
                f"not a multiple of the alignment {alignment}"
            )
        if end > file_size:
            raise ModelLoadError(
                f"{path}: file is truncated: tensor {t.name!r} needs bytes up to {end} but the file has {file_size}"
            )
        spans.append((start, end, t.name))
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if end > start:
            raise ModelLoadError(
                f"{path}: tensor {name!r} ends at byte {end}, past the start of tensor {other!r} at byte {start}; "
                f"expected tensors that do not overlap"
            )


def _tensor_bytes(path: str, t: TensorInfo) -> int:
    """Bytes tensor ``t`` takes in the data section (its type and dimensions checked)."""
    try:
        qtype = GGMLQuantizationType(t.raw_type)
    except ValueError:
        raise ModelLoadError(
            f"{path}: tensor {t.name!r} has unknown type id {t.raw_type}; "
            f"supported: {', '.join(q.name for q in SUPPORTED_TYPES)}"
        ) from None
    if 0 in t.dims:
        raise ModelLoadError(f"{path}: tensor {t.name!r} has a zero dimension in its shape {t.dims[::-1]}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if t.dims[0] % block:
        raise ModelLoadError(
            f"{path}: tensor {t.name!r} has rows of {t.dims[0]} values; {qtype.name} needs a multiple of {block}"
        )
    return math.prod(t.dims) // block * type_size


def open_gguf(path: str) -> GGUFReader:
    """A GGUFReader for ``path``; a file it cannot parse is a ModelLoadError naming it."""
    try:
        try:
            return _Reader(path)
        except (TypeError, AttributeError) as exc:
            # _Reader overrides internals of the gguf package; if a release changes them, the
            # package's own (slower) reader still works.
            log.warning("fast GGUF metadata reader unusable with this gguf version (%s); using gguf's reader", exc)
            return _checked(GGUFReader(path, "r"), path)
    except ModelLoadError:
        raise
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file") from None
    except RecursionError:  # arrays nested in arrays, deeper than Python's stack
        raise ModelLoadError(f"{path}: not a readable GGUF file: metadata arrays nested too deeply") from None
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError, OverflowError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file, truncated or corrupt ({type(exc).__name__}: {exc})") from exc


def _checked(reader: GGUFReader, path: str) -> GGUFReader:
    """``reader`` once its tensors pass ``check_layout`` (for the gguf package's own reader,
    which builds its tensor list before any check can run)."""
    infos = [TensorInfo(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), t.data_offset - reader.data_offset)
             for t in reader.tensors]
    check_layout(path, infos, reader.data_offset, int(reader.alignment), len(reader.data))
    return reader


def metadata(reader: GGUFReader, source: str | None = None) -> dict[str, Any]:
    """Every metadata key with its value (strings decoded, arrays as lists).

    A value that cannot be decoded (text that is not UTF-8) is a ModelLoadError naming
    ``source`` (by default the reader's file) and the key.
    """
    source = source or getattr(reader, "_path", None) or str(getattr(reader.data, "filename", "GGUF file"))
    out: dict[str, Any] = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            out[name] = f.contents()
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{source}: metadata key {name!r} holds text that is not valid UTF-8 ({exc})") from None
        except (IndexError, ValueError, TypeError) as exc:
            raise ModelLoadError(
                f"{source}: metadata key {name!r} cannot be decoded ({type(exc).__name__}: {exc})"
            ) from exc
    return out


def _config(meta: dict[str, Any], tensors: dict[str, Any], path: str) -> ModelConfig:
    """The config from the ``{arch}.*`` keys every architecture shares, then the fields the
    file's architecture sets."""
    architecture = architectures.get(meta.get("general.architecture"), path)
    arch = architecture.name
    missing = [f"{arch}.{k}" for k in REQUIRED_KEYS if f"{arch}.{k}" not in meta]
    if missing:
        raise ModelLoadError(f"{path}: missing metadata key(s) {', '.join(missing)}")
    values: dict[str, Any] = {"architecture": arch}
    for key, name in GGUF_CONFIG_KEYS.items():
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, list):
            raise ModelLoadError(f"{path}: {arch}.{key} holds per-layer values {value[:4]}...; expected one number")
        if value is not None:
            values[name] = value
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ModelLoadError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported; expected 'none'")
    if "vocab_size" not in values:
        values["vocab_size"] = _vocab_size(meta, tensors)
    values["tie_word_embeddings"] = architecture.gguf_names.to_file("lm_head") not in tensors
    values["bos_token_id"] = _token_id(meta, "tokenizer.ggml.bos_token_id", path)
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    values["eos_token_id"] = [i for k in eos_keys if (i := _token_id(meta, k, path)) is not None]
    values.update(architecture.gguf_config(meta, tensors.keys(), path))
    config = ModelConfig.from_dict(values).validate(path)
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and rope_dim != config.head_dim:
        raise ModelLoadError(
            f"{path}: {arch}.rope.dimension_count={rope_dim} rotates part of each head; expected the whole head_dim={config.head_dim}"
        )
    return config


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


def _row_reader(t: Any, shape: tuple[int, ...], path: str, fix: Callable[[np.ndarray], np.ndarray] | None):
    """A function giving rows [start, stop) of tensor ``t`` as floats (quantized rows dequantized)."""
    rows = t.data.reshape(shape[0], -1) if len(shape) > 1 else t.data.reshape(1, -1)  # (rows, stored row)

    def read_rows(start: int, stop: int) -> np.ndarray:
        part = rows[start:stop]
        if t.tensor_type in (Q.F32, Q.F16):
            arr = part
        elif t.tensor_type == Q.BF16:
            arr = part.view(np.uint8).view(ml_dtypes.bfloat16)
        else:
            arr = dequantize(part, t.tensor_type)
        want = (stop - start, *shape[1:]) if len(shape) > 1 else shape
        if arr.size != int(np.prod(want)):
            raise ModelLoadError(f"{path}: tensor {t.name!r} decoded to {arr.size} values; expected shape {shape}")
        arr = arr.reshape(want)
        return fix(arr) if fix is not None else arr
    return read_rows


def _raw_row_reader(t: Any, shape: tuple[int, ...], fix: Callable[[np.ndarray], np.ndarray] | None):
    """A function giving rows [start, stop) of block-quantized matrix ``t`` as stored bytes,
    uint8 (stop - start, row_bytes)."""
    rows = t.data.reshape(shape[0], -1).view(np.uint8)  # (rows, row_bytes)

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
    reader: GGUFReader | None = None  # keeps the memory map alive while weights are read


def read_gguf(path: "str | os.PathLike[str]") -> GGUFContents:
    """Parse a GGUF file: config from metadata and strict, checked weight sources."""
    path = os.fspath(path)
    reader = open_gguf(path)
    meta = metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    config = _config(meta, tensors, path)
    arch = architectures.get(config.architecture)
    table = arch.gguf_names
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    sources: dict[str, WeightSource] = {}
    for name, t in tensors.items():
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has type {t.tensor_type.name}; supported: "
                f"{', '.join(q.name for q in SUPPORTED_TYPES)}"
            )
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists dims innermost first
        ours = table.to_ours(name)  # None: map_names reports it below
        fix, multiple = (arch.gguf_row_fix(ours, config) if ours is not None else None) or (None, 1)
        read_rows = _row_reader(t, shape, path, fix)
        rows = shape[0] if len(shape) > 1 else 1
        raw = _raw_row_reader(t, shape, fix) if len(shape) == 2 and t.tensor_type in KEPT_QUANTIZED else None
        sources[name] = WeightSource(path, name, shape, t.tensor_type.name, functools.partial(read_rows, 0, rows),
                                     read_rows if len(shape) > 1 else None, multiple, raw)
    weights = sanitize(map_names(sources, table, path, config.architecture), config)
    check_weights(weights, config, table, path)
    return GGUFContents(config, weights, meta, dict(types), reader)
