"""Reading Hugging Face model folders: ``config.json`` and single or sharded safetensors, the
tensors named by the table of the config's architecture (``models.architectures``)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
from pathlib import Path, PurePath
from typing import Callable

import numpy as np

from safetensors import SafetensorError, safe_open

from ...runtime.block_formats import BY_NAME
from .. import architectures
from ..config import ModelConfig, read_config_json
from ..errors import ModelLoadError, read_json_object
from ..multimodal.families import family_of
from ..weights import WeightSource, check_weights, map_names, sanitize

SUPPORTED_TYPES = ("F32", "F16", "BF16")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def safetensors_files(folder: Path) -> dict[Path, list[str] | None]:
    """The weight files of ``folder``: each with the tensor names the index assigns it (None
    for a single unindexed file)."""
    index = folder / INDEX_NAME
    if index.exists():
        weight_map = read_json_object(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: expected a JSON object with a 'weight_map' of tensor name -> file, "
                                 f"got weight_map={weight_map!r:.100}")
        files: dict[Path, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(_shard_path(folder, index, name, file), []).append(name)  # type: ignore[union-attr]
        for path in files:
            if not path.is_file():
                raise ModelLoadError(f"{index}: lists {path.name!r}, which is not in {folder}")
        return files
    single = folder / SINGLE_NAME
    if single.is_file():
        return {single: None}
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    if len(found) == 1:
        return {folder / found[0]: None}
    raise ModelLoadError(
        f"{folder}: no {SINGLE_NAME} or {INDEX_NAME}"
        + (f" (found {', '.join(found)} without an index)" if found else "")
    )


def _shard_path(folder: Path, index: Path, name: str, file: object) -> Path:
    """The path of the shard ``file`` that the index gives for tensor ``name``: a relative path
    that stays inside ``folder`` (checked by its parts, so hub folders of symlinks still load)."""
    if not isinstance(file, str) or not file:
        raise ModelLoadError(f"{index}: tensor {name!r} is placed in {file!r}; expected a file name (a string)")
    relative = PurePath(file)
    if relative.is_absolute() or relative.anchor or ".." in relative.parts or "\0" in file:
        raise ModelLoadError(f"{index}: tensor {name!r} is placed in {file!r}; expected a file inside {folder}")
    return folder / relative


def _open(path: Path, stack: contextlib.ExitStack):
    try:
        return stack.enter_context(safe_open(os.fspath(path), framework="numpy"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from exc


def _stored_offsets(path: Path) -> "tuple[np.ndarray, dict[str, int]] | None":
    """The file as a read-only memory map (uint8) and, per tensor, the offset of its data in it:
    where a matrix may stay as a view of the file rather than a copy. None where the bytes are
    not this machine's order (a big-endian host) or the header cannot be read again."""
    if sys.byteorder != "little":
        return None
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        data = np.memmap(path, np.uint8, mode="r")
    except (OSError, ValueError):
        return None
    base = 8 + size
    offsets = {}
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        begin, end = entry.get("data_offsets", (0, -1))
        item = BY_NAME[entry["dtype"]].block_bytes if entry.get("dtype") in SUPPORTED_TYPES else None
        if item and end - begin == item * math.prod(entry.get("shape", ())) and base + end <= data.size \
                and (base + begin) % item == 0:
            offsets[name] = base + begin
    return data, offsets


def _readers(handle, path: Path, name: str):
    """Functions reading the whole tensor, rows [start, stop) of it, and rows [start, stop) of
    matrix e of a stack (E, N, K) (from the memory map)."""
    def read():
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, TypeError) as exc:
            raise ModelLoadError(f"{path}: cannot read tensor {name!r} ({exc})") from exc

    def read_rows(start: int, stop: int):
        try:
            return handle.get_slice(name)[start:stop]
        except (SafetensorError, OSError, ValueError, TypeError) as exc:
            raise ModelLoadError(f"{path}: cannot read tensor {name!r} ({exc})") from exc

    def read_matrix_rows(e: int, start: int, stop: int):
        try:
            return handle.get_slice(name)[e:e + 1, start:stop][0]
        except (SafetensorError, OSError, ValueError, TypeError) as exc:
            raise ModelLoadError(f"{path}: cannot read tensor {name!r} ({exc})") from exc
    return read, read_rows, read_matrix_rows


def read_folder(folder: "str | os.PathLike[str]", stack: contextlib.ExitStack,
                vision: "dict[str, WeightSource] | None" = None) -> tuple[ModelConfig, dict[str, WeightSource]]:
    """The config and the checked weights (ours -> source) of a Hugging Face model folder.

    A vision-language folder (``multimodal.families``) gives its text model's; the weights of
    its vision tower go into ``vision`` (by their names in the file) when it is given, and are
    left unread otherwise. Files stay memory-mapped, held open by ``stack``, until the caller
    closes it.
    """
    folder = Path(folder)
    raw = read_config_json(folder / "config.json")
    family = family_of(raw) if isinstance(raw, dict) else None
    if family is not None:
        raw = family.text_config(raw, str(folder / "config.json"))
    config = architectures.config_from_hf(raw, str(folder / "config.json"))
    arch = architectures.get(config.architecture)
    sources: dict[str, WeightSource] = {}
    where: dict[str, Path] = {}
    for path, listed in safetensors_files(folder).items():
        handle = _open(path, stack)
        stored = _stored_offsets(path)
        names = list(handle.keys())
        if listed is not None and set(listed) - set(names):
            missing = sorted(set(listed) - set(names))[0]
            raise ModelLoadError(f"{path}: missing tensor {missing!r}, which {INDEX_NAME} places in this file")
        for stored_name in names:
            name = stored_name
            if family is not None:
                if family.is_vision(stored_name):
                    if vision is not None:
                        read, _, _ = _readers(handle, path, stored_name)
                        sl = handle.get_slice(stored_name)
                        vision[stored_name] = WeightSource(str(path), stored_name, tuple(int(d) for d in sl.get_shape()),
                                                           sl.get_dtype(), read, None)
                    continue
                name = family.text_name(stored_name) or stored_name
            if name in sources:
                raise ModelLoadError(f"{path}: tensor {name!r} is also in {where[name]}")
            sl = handle.get_slice(stored_name)
            kind = sl.get_dtype()
            if kind not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has type {kind}; expected one of {', '.join(SUPPORTED_TYPES)}"
                )
            shape = tuple(int(d) for d in sl.get_shape())
            read, read_rows, matrix_rows = _readers(handle, path, stored_name)
            mapped = (stored[0], stored[1][stored_name]) if stored is not None and stored_name in stored[1] else None
            sources[name] = WeightSource(str(path), name, shape, kind, read, read_rows if len(shape) > 1 else None,
                                         mapped=mapped, read_matrix_rows=matrix_rows if len(shape) == 3 else None)
            where[name] = path
    label = str(folder)
    table = arch.hf_names
    weights = arch.sanitize_weights(sanitize(map_names(sources, table, label, config.architecture), config), config,
                                    label)
    check_weights(weights, config, table, label, arch.layer_shapes)
    for ours, src in weights.items():
        fix = arch.hf_value_fix(ours, config)
        if fix is not None:
            weights[ours] = fixed_values(src, fix)
    return config, weights


def fixed_values(src: WeightSource, fix: Callable[[np.ndarray], np.ndarray]) -> WeightSource:
    """``src`` with ``fix`` applied to its values as they are read (float rows, whichever way)."""
    read, read_rows, matrix_rows = src.read, src.read_rows, src.read_matrix_rows
    return dataclasses.replace(
        src, read=lambda: fix(read()), mapped=None,
        read_rows=None if read_rows is None else (lambda a, b: fix(read_rows(a, b))),
        read_matrix_rows=None if matrix_rows is None else (lambda x, a, b: fix(matrix_rows(x, a, b))))
