"""The public ops. Each takes its output tensor first (as the C ops API does), checks its
arguments once, then dispatches through the kernel registry. ``llaisys.ops.functional``
holds the same ops returning new tensors; ``Plan`` records checked calls to replay."""
from .core import (add, add_rms_norm, argmax, embedding, geglu, gelu, layer_norm, linear, rearrange, rms_norm, rope,
                   scale, self_attention, swiglu)
from .moe import moe_mlp
from .paged import kv_cache_write, paged_attention
from . import functional
from .plan import Plan

__all__ = ["add", "add_rms_norm", "argmax", "embedding", "geglu", "gelu", "kv_cache_write", "layer_norm", "linear", "moe_mlp", "paged_attention", "rearrange", "rms_norm", "rope", "scale", "self_attention", "swiglu", "functional", "Plan"]
