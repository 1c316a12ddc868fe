"""The shared blocks of the decoders, written with ``llaisys.ops`` only, over the buffers of a
``Workspace``: the q/k/v projection (with the per-head norms of a layer that holds them, and
the rotary embedding), attention over one sequence's cache or a paged pool (with the layer's
sliding window), the gated MLP (SiLU or tanh-GELU) or a routed mixture of experts, and the
pre-norm layer the Llama family runs (and the pre-and-post-norm one). They read the shared
config fields only: an architecture module (``models.architectures``) names the layer it runs,
built from these, and passes them what is its own (Gemma 3's activation, Qwen3-MoE's top-k).

Shapes: S tokens in the pass, T = cache length after it, D hidden, H/KH query/kv heads,
Dh head dim, Dq = H*Dh, Dkv = KH*Dh, I MLP width, E experts, V vocabulary.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .. import ops
from ..parallel.comm import Communicator, record_all_reduce
from ..runtime.device import Device
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from .config import ModelConfig
from .params import LayerParams

if TYPE_CHECKING:
    from .passes import BatchIndex


class Workspace:
    """Buffers for one pass of S tokens, reused by every layer and every pass of that size.

    ``config`` is the config of the part this process computes (a tensor-parallel rank's heads
    and MLP width: ``Shard.local_config``); ``comm`` the group whose partial sums the
    row-parallel projections add (None: one process holds every weight)."""

    def __init__(self, config: ModelConfig, s: int, dtype: DataType, device: Device,
                 comm: Communicator | None = None):
        self.comm = comm if comm is not None and comm.size > 1 else None
        self.dtype, self.device = dtype, device
        self._extra: dict[str, Tensor] = {}  # buffers only some layers use (``extra``)
        d, dh, inter = config.hidden_size, config.head_dim, config.intermediate_size
        h, kh = config.num_attention_heads, config.num_key_value_heads
        dq, dkv = h * dh, kh * dh
        new = lambda *shape: Tensor.empty(shape, dtype, device)  # noqa: E731
        self.ids = Tensor.empty((s,), DataType.I64, device)  # (S,)
        self.pos = Tensor.empty((s,), DataType.I64, device)  # (S,)
        # (3, S) each token's rope positions (time, height, width) under multimodal rope, else None
        self.rope_pos = Tensor.empty((3, s), DataType.I64, device) if config.arch_args.rope_sections() else None
        self.x = new(s, d)  # (S, D) the residual stream
        self.h = new(s, d)  # (S, D) normalised input of a block
        self.qkv = new(s, dq + 2 * dkv)  # (S, Dq + 2*Dkv)
        self.qk_in = self.qkv.slice(1, 0, dq + dkv).view(s, h + kh, dh)  # (S, H+KH, Dh) strided view
        self.v_in = self.qkv.slice(1, dq + dkv, dq + 2 * dkv).view(s, kh, dh)  # (S, KH, Dh)
        self.qk = new(s, h + kh, dh)  # (S, H+KH, Dh) q and k heads after rope (one rope call for both)
        self.q = self.qk.slice(1, 0, h)  # (S, H, Dh)
        self.k = self.qk.slice(1, h, h + kh)  # (S, KH, Dh)
        self.attn = new(s, h, dh)  # (S, H, Dh)
        self.attn_flat = self.attn.view(s, dq)  # (S, Dq)
        self.proj = new(s, d)  # (S, D) output of a block before the residual add
        self.proj_normed = new(s, d)  # (S, D) a block's output normalised (post-norm layers)
        self.gate_up = new(s, 2 * inter)  # (S, 2I)
        self.gate = self.gate_up.slice(1, 0, inter)  # (S, I) strided view
        self.up = self.gate_up.slice(1, inter, 2 * inter)  # (S, I)
        self.act = new(s, inter)  # (S, I)
        self.h_last = self.h.slice(0, s - 1, s)  # (1, D) the last row, finally normalised
        self.logits = new(1, config.vocab_size)  # (1, V)

    def extra(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """The buffer ``name`` of ``shape`` in the workspace's dtype, made when a block first
        records a call on it and kept, as the others are, for every pass of this size: the
        normed q/k heads (S, H+KH, Dh) of layers with head norms, the router logits (S, E)."""
        buf = self._extra.get(name)
        if buf is None:
            buf = self._extra[name] = Tensor.empty(shape, self.dtype, self.device)
        assert buf.shape == tuple(shape), (name, buf.shape, shape)
        return buf


def sum_over_ranks(ws: Workspace, partial: Tensor, plan: ops.Plan) -> None:
    """Under tensor parallelism, add every rank's ``partial`` (a row-parallel projection's
    share of the sum over its input columns) in place; nothing with one process."""
    if ws.comm is not None:
        record_all_reduce(plan, ws.comm, partial)


def fused_linear(out: Tensor, x: Tensor, weight: Tensor | None, parts: tuple[Tensor, ...], bias: Tensor | None,
                 plan: ops.Plan) -> None:
    """out (S, N) = x @ W^T + bias for a fused matrix W (N, D) given whole (``weight``) or as
    consecutive row ranges (``parts``, stored in different formats), each into its columns."""
    if weight is not None:
        ops.linear(out, x, weight, bias, plan=plan)
        return
    at = 0
    for part in parts:
        n = part.shape[0]
        ops.linear(out.slice(1, at, at + n), x, part, None if bias is None else bias.slice(0, at, at + n), plan=plan)
        at += n


def project_qkv(ws: Workspace, lp: LayerParams, config: ModelConfig, plan: ops.Plan) -> None:
    """ws.qk = rope(q and k heads of ws.h's projection), each head first normalised by its
    norm where the layer has them; ws.v_in = the value heads."""
    fused_linear(ws.qkv, ws.h, lp.qkv, lp.qkv_parts, lp.qkv_bias, plan)  # (S, Dq + 2*Dkv)
    qk = ws.qk_in  # (S, H+KH, Dh) strided view of the projection
    if lp.q_norm is not None:
        h, eps = ws.q.shape[1], config.rms_norm_eps  # this rank's query heads
        normed = ws.extra("qk_normed", ws.qk.shape)  # (S, H+KH, Dh) the rope's input
        ops.rms_norm(normed.slice(1, 0, h), qk.slice(1, 0, h), lp.q_norm, eps, plan=plan)  # (S, H, Dh)
        ops.rms_norm(normed.slice(1, h, qk.shape[1]), qk.slice(1, h, qk.shape[1]), lp.k_norm, eps,
                     plan=plan)  # (S, KH, Dh)
        qk = normed
    if lp.rope_sections:  # multimodal rope: each block of dims rotates by its own position stream
        s = ws.qk.shape[0]
        for stream, (at, width, freqs) in enumerate(lp.rope_sections):
            ops.rope(ws.qk.slice(2, at, at + width), qk.slice(2, at, at + width),
                     ws.rope_pos.slice(0, stream, stream + 1).view(s), lp.rope_theta, freqs, plan=plan)
        return
    ops.rope(ws.qk, qk, ws.pos, lp.rope_theta, lp.rope_freqs, lp.rope_factor, plan=plan)  # (S, H+KH, Dh)


def _window(lp: LayerParams) -> dict:
    return {"window": lp.window} if lp.window else {}


def attention(ws: Workspace, lp: LayerParams, kv: tuple[Tensor, Tensor, Tensor, Tensor], config: ModelConfig,
              plan: ops.Plan) -> int:
    """ws.proj = o_proj(causal attention of ws.h, the normalised input); appends this pass's
    K/V to the cache through ``kv`` = (K rows written, V rows written, K rows read, V rows read).
    Returns the plan index of its first call that touches the cache (the K write; then the V
    write, then attention: the three a replay at another position rebinds)."""
    k_new, v_new, k_seen, v_seen = kv  # (S, KH, Dh) x2, (T, KH, Dh) x2
    project_qkv(ws, lp, config, plan)
    at = len(plan)
    ops.rearrange(k_new, ws.k, plan=plan)  # (S, KH, Dh) into the cache
    ops.rearrange(v_new, ws.v_in, plan=plan)  # (S, KH, Dh)
    ops.self_attention(ws.attn, ws.q, k_seen, v_seen, config.attention_scale, plan=plan,
                       **_window(lp))  # (S, H, Dh)
    ops.linear(ws.proj, ws.attn_flat, lp.o, lp.o_bias, plan=plan)  # (S, D)
    sum_over_ranks(ws, ws.proj, plan)
    return at


def paged_attention(ws: Workspace, lp: LayerParams, pool: tuple[Tensor, ...], idx: "BatchIndex",
                    config: ModelConfig, plan: ops.Plan) -> None:
    """ws.proj = o_proj(attention of ws.h, rows of many sequences) over the paged cache
    ``pool`` = (K blocks, V blocks) (NB, BS, KH, Dh) of this layer, and in the 8-bit layout
    (K scales, V scales) (NB, BS, KH) after them; writes this pass's K/V to their slots first
    (quantized there in 8 bits), then each sequence attends to its own keys through its block table."""
    k_pool, v_pool = pool[:2]
    scales = {"k_scale": pool[2], "v_scale": pool[3]} if len(pool) > 2 else {}  # an 8-bit pool
    project_qkv(ws, lp, config, plan)
    ops.kv_cache_write(k_pool, v_pool, ws.k, ws.v_in, idx.slots, plan=plan, **scales)
    ends = {"key_ends": idx.key_ends} if idx.key_ends is not None else {}  # two-way spans (Gemma 3's images)
    ops.paged_attention(ws.attn, ws.q, k_pool, v_pool, idx.block_tables, idx.query_starts, idx.context_lens,
                        config.attention_scale, plan=plan, **_window(lp), **ends, **scales)  # (N, H, Dh)
    ops.linear(ws.proj, ws.attn_flat, lp.o, lp.o_bias, plan=plan)  # (N, D)
    sum_over_ranks(ws, ws.proj, plan)


ACTIVATIONS = ("silu", "gelu_tanh")  # of ``mlp``


def mlp(ws: Workspace, lp: LayerParams, act: str, plan: ops.Plan) -> None:
    """ws.proj = down(act(gate) * up) of ws.h, the normalised input; ``act`` is "silu" (SwiGLU)
    or "gelu_tanh", the tanh-approximated GELU (GeGLU)."""
    fused_linear(ws.gate_up, ws.h, lp.gate_up, lp.gate_up_parts, None, plan)  # (S, 2I)
    if act == "gelu_tanh":
        ops.geglu(ws.act, ws.gate, ws.up, plan=plan)  # (S, I)
    else:
        ops.swiglu(ws.act, ws.gate, ws.up, plan=plan)  # (S, I)
    ops.linear(ws.proj, ws.act, lp.down, plan=plan)  # (S, D)
    sum_over_ranks(ws, ws.proj, plan)


def routed_mlp(ws: Workspace, lp: LayerParams, top_k: int, norm_topk_prob: bool, plan: ops.Plan) -> None:
    """ws.proj = the routed mixture of SwiGLU experts of ws.h (``ops.moe_mlp``): the router's
    logits, then each token's ``top_k`` experts weighted by their probabilities (divided by
    their sum with ``norm_topk_prob``). Under tensor parallelism every rank routes with the
    whole router and holds I/N of each expert's width, so its output is a partial sum, added
    over the ranks like ``mlp``'s."""
    logits = ws.extra("router_logits", (ws.h.shape[0], lp.router.shape[0]))  # (S, E)
    ops.linear(logits, ws.h, lp.router, plan=plan)  # (S, E)
    ops.moe_mlp(ws.proj, ws.h, logits, lp.gate_exps, lp.up_exps, lp.down_exps, top_k, norm_topk_prob,
                plan=plan)  # (S, D)
    sum_over_ranks(ws, ws.proj, plan)


def decoder_layer(ws: Workspace, lp: LayerParams, next_norm: Tensor, attend: Callable[[], None],
                  config: ModelConfig, plan: ops.Plan, ffn: Callable[[], None] | None = None) -> None:
    """One pre-norm decoder layer applied to ws.x in place. Takes ws.h = rms_norm(ws.x) by
    the layer's attention norm; ``attend()`` puts the attention block's output in ws.proj
    (``attention`` over one sequence's cache, or ``paged_attention`` over many), ``ffn()`` the
    MLP block's (default: the SwiGLU ``mlp``); leaves ws.h normalised by ``next_norm`` (the next
    layer's attention norm, or the final norm), each residual add fused with the norm after it."""
    eps = config.rms_norm_eps
    attend()
    ops.add_rms_norm(ws.h, ws.x, ws.x, ws.proj, lp.ffn_norm, eps, plan=plan)  # (S, D) x += proj; h = norm(x)
    if ffn is None:
        mlp(ws, lp, "silu", plan)
    else:
        ffn()
    ops.add_rms_norm(ws.h, ws.x, ws.x, ws.proj, next_norm, eps, plan=plan)  # (S, D)


def sandwich_layer(ws: Workspace, lp: LayerParams, next_norm: Tensor, attend: Callable[[], None],
                   config: ModelConfig, plan: ops.Plan, ffn: Callable[[], None] | None = None) -> None:
    """``decoder_layer`` (``ffn`` as there) with each block's output normalised before its
    residual add (Gemma's post-attention and post-MLP norms): x += norm(attn); h = norm(x);
    x += norm(ffn); h = next_norm(x)."""
    eps = config.rms_norm_eps
    attend()
    ops.rms_norm(ws.proj_normed, ws.proj, lp.post_attn_norm, eps, plan=plan)  # (S, D)
    ops.add_rms_norm(ws.h, ws.x, ws.x, ws.proj_normed, lp.ffn_norm, eps, plan=plan)  # (S, D)
    if ffn is None:
        mlp(ws, lp, "silu", plan)
    else:
        ffn()
    ops.rms_norm(ws.proj_normed, ws.proj, lp.post_ffn_norm, eps, plan=plan)  # (S, D)
    ops.add_rms_norm(ws.h, ws.x, ws.x, ws.proj_normed, next_norm, eps, plan=plan)  # (S, D)
