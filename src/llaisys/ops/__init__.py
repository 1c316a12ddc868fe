"""The public ops. Each takes its output tensor first (as the C ops API does), checks its
arguments once, then dispatches through the kernel registry. ``llaisys.ops.functional``
holds the same ops returning new tensors."""
from .core import add, argmax, embedding, linear, rearrange, rms_norm, rope, self_attention, swiglu
from . import functional

__all__ = ["add", "argmax", "embedding", "linear", "rearrange", "rms_norm", "rope", "self_attention", "swiglu", "functional"]
