"""The error raised for model files that cannot be loaded, and the JSON reader that raises it."""
from __future__ import annotations

import json
from pathlib import Path


class ModelLoadError(ValueError):
    """A model file or folder that is malformed or unsupported.

    The message names the file, the tensor or key at fault when there is one, and what was
    expected instead.
    """


def read_json_object(path: Path, required: bool = False) -> dict:
    """The JSON object in ``path``; ``{}`` when the file is absent and not ``required``."""
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path}: no such file")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
