"""The error raised for model files that cannot be loaded, and the JSON reader that raises it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ModelLoadError(ValueError):
    """A model file or folder that is malformed or unsupported.

    The message names the file, the tensor or key at fault when there is one, and what was
    expected instead.
    """


def read_json(path: Path, hint: str = "") -> Any:
    """The JSON value in ``path``.

    A missing file, a folder in its place, unreadable bytes, text that is not UTF-8 and JSON
    that is invalid or nested too deeply for the parser are a ModelLoadError naming ``path``
    (``hint`` is appended to the message for a missing file).
    """
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file{hint}")
    if not path.is_file():
        raise ModelLoadError(f"{path}: expected a file, found a folder or other non-file")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc})") from exc
    except RecursionError:
        raise ModelLoadError(f"{path}: not valid JSON (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, bad UTF-8, integers too long to parse
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc


def read_json_object(path: Path, required: bool = False, hint: str = "") -> dict:
    """The JSON object in ``path``; ``{}`` when nothing is at ``path`` and it is not ``required``."""
    if not required and not path.exists():
        return {}
    value = read_json(path, hint)
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
