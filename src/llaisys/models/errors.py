"""The error raised for model files that cannot be loaded."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """A model file or folder that is malformed or unsupported.

    The message names the file, the tensor or key at fault when there is one, and what was
    expected instead.
    """
