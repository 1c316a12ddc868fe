"""Tensor layer: storage and strided views."""
from .storage import Storage
from .tensor import Tensor
