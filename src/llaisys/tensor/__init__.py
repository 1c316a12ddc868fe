"""Tensor layer: storage and strided views."""
from .storage import FrozenTensorError, Storage
from .tensor import Tensor
