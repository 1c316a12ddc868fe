"""What a decoding step costs outside the kernels: a model with SmolLM2-135M's 30 layers and
almost no arithmetic (hidden size 64, MLP 128, 4 heads of 16, 2 KV heads, a 512-token
vocabulary, F16 weights), so a step's time is the Python and the call overhead around its
kernels. Printed: the median time of one decoding step (``CausalLM.forward`` of one token),
with the recorded plan replayed as it is (stretches of native kernels in one call into C) and
with every kernel called from Python one by one, as a plan without native forms replays.

The model is written to a temporary folder as safetensors with NumPy (random weights), so
the benchmark needs neither torch nor a model download.

    python3 benchmarks/step_overhead.py [--steps 200] [--repeats 9] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

LAYERS, HIDDEN, MLP, HEADS, KV_HEADS, VOCAB = 30, 64, 128, 4, 2, 512


def write_tiny_llama(folder: Path) -> None:
    """A random Llama of the shape above: config.json and model.safetensors (F16)."""
    from safetensors.numpy import save_file

    head_dim = HIDDEN // HEADS
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": MLP, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "float16"}
    rng = np.random.default_rng(0)
    w = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float16)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": np.ones(HIDDEN, np.float16)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(HEADS * head_dim, HIDDEN),
                    p + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
                    p + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
                    p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head_dim),
                    p + "mlp.gate_proj.weight": w(MLP, HIDDEN), p + "mlp.up_proj.weight": w(MLP, HIDDEN),
                    p + "mlp.down_proj.weight": w(HIDDEN, MLP),
                    p + "input_layernorm.weight": np.ones(HIDDEN, np.float16),
                    p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float16)}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))


def step_ms(model, steps: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``steps`` one-token steps, in ms."""
    cache = model.new_cache(steps + 64)
    model.forward(list(range(16)), cache)
    for _ in range(10):
        model.forward([1], cache)
    times = []
    for _ in range(repeats):
        cache.truncate(16)
        start = time.perf_counter()
        for _ in range(steps):
            model.forward([1], cache)
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="quantized-kernel pool threads (default: its own)")
    args = p.parse_args()

    import logging

    logging.getLogger("llaisys").setLevel(logging.ERROR)  # "no tokenizer": this model takes ids
    from llaisys.kernels.cpu import native_calls
    from llaisys.kernels.quant import native
    from llaisys.models import load_model

    if args.threads:
        native.set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_llama(Path(tmp))
        model = load_model(tmp, dtype="f32")
        available = native_calls.available
        results: dict[str, list[float]] = {}
        try:
            for _ in range(3):  # take turns, so a slow spell of a shared machine hits both
                for name, native_forms in (("native stretches", True), ("kernel by kernel", False)):
                    # each timing records its plans over a new cache, with native forms or without
                    native_calls.available = available if native_forms else (lambda: False)
                    results.setdefault(name, []).append(step_ms(model, args.steps, args.repeats))
        finally:
            native_calls.available = available
    print(f"decoding step of a {LAYERS}-layer model of width {HIDDEN} (kernels of next to no work):")
    for name, ms in results.items():
        print(f"  {name:18s} {statistics.median(ms):.3f} ms per token")


if __name__ == "__main__":
    main()
