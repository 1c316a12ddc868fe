"""What the op rows run on the plugin's device and on the CPU: one decoder layer's chain of ops,
and small random-weight Qwen2 models (written as safetensors folders) for the model and
dispatch rows."""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping

import numpy as np

CHAIN = {"tokens": 5, "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "intermediate": 48, "vocab": 64}


def decoder_layer_chain(device: str, seed: int = 0) -> dict[str, np.ndarray]:
    """One Qwen2-style decoder layer plus the head, in F32 on ``device``, from fixed random weights.

    Returns host arrays: ``hidden`` (S, D) after the layer, ``transposed`` (D, S) made by
    rearrange of a permuted view, ``logits`` (S, V) and ``argmax`` (S,). Shapes: ``CHAIN``.
    """
    from ... import ops
    from ...tensor import Tensor

    f = ops.functional
    rng = np.random.default_rng(seed)
    s, d, heads, kv_heads, dh, inter, vocab = CHAIN.values()
    w = lambda *shape, scale=0.2: Tensor.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32), device)  # noqa: E731
    embed = w(vocab, d, scale=1.0)  # (V, D)
    norm1, norm2, norm_out = (Tensor.from_numpy((1 + 0.1 * rng.standard_normal(d)).astype(np.float32), device) for _ in range(3))
    wq, bq = w(heads * dh, d), w(heads * dh)
    wk, bk = w(kv_heads * dh, d), w(kv_heads * dh)
    wv, bv = w(kv_heads * dh, d), w(kv_heads * dh)
    wo = w(d, heads * dh)
    w_gate, w_up, w_down = w(inter, d), w(inter, d), w(d, inter)
    ids = Tensor.from_numpy(rng.integers(0, vocab, s).astype(np.int64), device)  # (S,)
    pos = Tensor.from_numpy(np.arange(3, 3 + s, dtype=np.int64), device)  # (S,)

    x = f.embedding(ids, embed)  # (S, D)
    h = f.rms_norm(x, norm1, 1e-6)  # (S, D)
    q = f.rope(f.linear(h, wq, bq).view(s, heads, dh), pos, 10000.0)  # (S, H, Dh)
    k = f.rope(f.linear(h, wk, bk).view(s, kv_heads, dh), pos, 10000.0)  # (S, KH, Dh)
    v = f.linear(h, wv, bv).view(s, kv_heads, dh)  # (S, KH, Dh)
    attn = f.self_attention(q, k, v, 1.0 / np.sqrt(dh)).view(s, heads * dh)  # (S, H*Dh)
    x = f.add(x, f.linear(attn, wo))  # (S, D)
    h = f.rms_norm(x, norm2, 1e-6)  # (S, D)
    x = f.add(x, f.linear(f.swiglu(f.linear(h, w_gate), f.linear(h, w_up)), w_down))  # (S, D)
    transposed = f.rearrange(x.permute(1, 0))  # (D, S)
    logits = f.linear(f.rms_norm(x, norm_out, 1e-6), embed)  # (S, V), tied head
    idx, _ = f.argmax(logits)  # (S,)
    return {"hidden": x.numpy(), "transposed": transposed.numpy(), "logits": logits.numpy(), "argmax": idx.numpy()}


def decoder_layer_bytes() -> list[int]:
    """Bytes of each device tensor ``decoder_layer_chain`` makes (an upper bound: all at once)."""
    s, d, heads, kv_heads, dh, inter, vocab = CHAIN.values()
    q, kv = heads * dh, kv_heads * dh
    weights = [vocab * d, d, d, d, q * d, q, kv * d, kv, kv * d, kv, d * q, inter * d, inter * d, d * inter]
    activations = [s * d] * 8 + [s * q] * 3 + [s * kv] * 3 + [s * inter] * 3 + [s * vocab, s]
    return [4 * n for n in weights + activations] + [8 * s] * 3  # the I64 ids, positions, argmax


# Random Qwen2 models for the model row, largest first; the row takes the first the device holds.
MODEL_SHAPES: tuple[dict[str, int], ...] = (
    {"vocab": 96, "hidden": 32, "intermediate": 48, "layers": 2, "heads": 4, "kv_heads": 2},
    {"vocab": 32, "hidden": 16, "intermediate": 24, "layers": 1, "heads": 2, "kv_heads": 1},
)
PROMPT = (3, 17, 42, 5, 77, 8)  # token ids, taken modulo the vocabulary
NEW_TOKENS = 8


def write_random_qwen2(folder: "str | os.PathLike[str]", seed: int = 0, shape: Mapping[str, int] | None = None) -> None:
    """A small Qwen2 model with random F32 weights, as a Hugging Face folder (config.json and
    model.safetensors, no tokenizer). ``shape``: one of ``MODEL_SHAPES`` (default the first:
    V=96, D=32, 2 layers, 4 query and 2 key/value heads)."""
    from safetensors.numpy import save_file

    shape = MODEL_SHAPES[0] if shape is None else shape
    rng = np.random.default_rng(seed)
    v, d, inter, layers, heads, kv_heads = (shape[k] for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads"))
    dh = d // heads
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": v, "hidden_size": d,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "max_position_embeddings": 64, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32"}
    w = lambda *dims, scale=0.15: (rng.standard_normal(dims) * scale).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(v, d, scale=1.0), "model.norm.weight": norm()}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": w(heads * dh, d), p + "self_attn.q_proj.bias": w(heads * dh),
            p + "self_attn.k_proj.weight": w(kv_heads * dh, d), p + "self_attn.k_proj.bias": w(kv_heads * dh),
            p + "self_attn.v_proj.weight": w(kv_heads * dh, d), p + "self_attn.v_proj.bias": w(kv_heads * dh),
            p + "self_attn.o_proj.weight": w(d, heads * dh),
            p + "mlp.gate_proj.weight": w(inter, d), p + "mlp.up_proj.weight": w(inter, d),
            p + "mlp.down_proj.weight": w(d, inter),
        })
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"))


def model_bytes(shape: Mapping[str, int]) -> list[int]:
    """Bytes of each device tensor ``random_model_run`` needs for a model of ``shape``:
    weights, KV cache, the work buffers of the prompt and decode passes, the prompt's logits."""
    v, d, inter, layers, h, kh = (shape[k] for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads"))
    dh = d // h
    dq, dkv = h * dh, kh * dh
    layer = [d, (dq + 2 * dkv) * d, dq + 2 * dkv, d * dq, d, 2 * inter * d, d * inter]
    cache = [layers * (len(PROMPT) + NEW_TOKENS) * dkv] * 2

    def work(s: int) -> list[int]:
        return [s * d] * 3 + [s * (dq + 2 * dkv), s * (dq + dkv), s * dq, s * 2 * inter, s * inter, d, v]

    f32 = [v * d, d, *layer * layers, *cache, *work(len(PROMPT)), *work(1), len(PROMPT) * v]
    return [4 * n for n in f32] + [8 * len(PROMPT)] * 2 + [8] * 2  # I64 ids and positions


def load_random_qwen2(device: str, seed: int, shape: Mapping[str, int]) -> Any:
    """``write_random_qwen2``'s model of ``shape``, loaded on ``device`` from a temporary folder."""
    import tempfile

    from ...models import load_model

    with tempfile.TemporaryDirectory() as folder:
        write_random_qwen2(folder, seed, shape)
        models_log = logging.getLogger("llaisys.models")
        level = models_log.level
        models_log.setLevel(logging.ERROR)  # the folder has no tokenizer, on purpose
        try:
            return load_model(folder, device=device)
        finally:
            models_log.setLevel(level)


def random_model_run(device: str, seed: int = 0, shape: Mapping[str, int] | None = None) -> tuple[np.ndarray, list[int]]:
    """Load ``write_random_qwen2``'s model of ``shape`` on ``device``; return the logits (S, V)
    of the 6-token ``PROMPT`` and 8 greedy tokens decoded after it with the KV cache."""
    shape = MODEL_SHAPES[0] if shape is None else shape
    model = load_random_qwen2(device, seed, shape)
    prompt = [t % shape["vocab"] for t in PROMPT]
    cache = model.new_cache(len(prompt) + NEW_TOKENS)
    logits = model.forward(prompt, cache, all_logits=True)  # (S, V)
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < NEW_TOKENS:
        tokens.append(int(np.argmax(model.forward([tokens[-1]], cache))))
    return logits, tokens


DISPATCH_RUNS = 20  # replays of the decode step timed by the dispatch row (the median is reported)


def dispatch_run(device: str, seed: int = 0, shape: Mapping[str, int] | None = None) -> tuple[Any, Any]:
    """(``ops.ReplayProfile``, ``ops.ReplayStats``) of the decode step (S = 1) of
    ``write_random_qwen2``'s model on ``device``, after the ``PROMPT``: the step's time per
    token and the part of it outside the kernels (dispatch: Python, crossings into C, the
    fallback's copies, calls made from Python), median of ``DISPATCH_RUNS`` replays."""
    shape = MODEL_SHAPES[0] if shape is None else shape
    model = load_random_qwen2(device, seed, shape)
    prompt = [t % shape["vocab"] for t in PROMPT]
    cache = model.new_cache(len(prompt) + 2)
    model.forward(prompt, cache)
    model.forward([prompt[0]], cache)  # records the decode step
    plan = model.runner.decoding_pass(cache).plan
    return plan.profile(DISPATCH_RUNS), plan.stats()
