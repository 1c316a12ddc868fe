"""llaisys: a small LLM inference system with a pluggable hardware runtime."""
from .runtime import (DataType, Device, DeviceType, MemcpyKind, current_device, get_runtime,
                      set_device, synchronize)
from .tensor import FrozenTensorError, Tensor
from . import ops
from .plugins import load_plugin, load_plugins_from_env  # light: the loader is imported on first use

empty = Tensor.empty
zeros = Tensor.zeros
from_numpy = Tensor.from_numpy

__version__ = "0.1.0"
