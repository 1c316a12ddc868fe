"""What a decoding step costs outside the kernels: a model with SmolLM2-135M's 30 layers and
almost no arithmetic (hidden size 64, MLP 128, 4 heads of 16, 2 KV heads, a 512-token
vocabulary, F16 weights), so a step's time is the Python and the call overhead around its
kernels. Printed: the median time of one decoding step (``CausalLM.forward`` of one token),
with the recorded plan replayed as it is (stretches of native kernels in one call into C) and
with every kernel called from Python one by one, as a plan without native forms replays.

Then the same for a serving step: one decoding token for each of ``--batch`` sequences
(``CausalLM.forward_batch`` over a paged cache, as ``LLMEngine.step`` runs it), replayed as one
native stretch, with the paged ops (kv_cache_write, paged_attention) and the logit rows'
gather called from Python between stretches as before they had native forms, and kernel by
kernel. The variants take turns, so a slow spell of a shared machine hits each of them.

The model is written to a temporary folder as safetensors with NumPy (random weights), so
the benchmark needs neither torch nor a model download.

    python3 benchmarks/step_overhead.py [--steps 200] [--repeats 9] [--threads 2] [--batch 16]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Iterator

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


def batch_step_ms(model, steps: int, repeats: int, seqs: int) -> float:
    """Median over ``repeats`` of the mean time of ``steps`` serving steps of ``seqs``
    sequences, one token each (``forward_batch`` on batches built beforehand), in ms."""
    from llaisys.models.paged_cache import TokenBatch

    bs, prompt = 16, 16
    per_seq = -(-(prompt + steps) // bs)  # blocks of one sequence
    cache = model.new_paged_cache(num_blocks=seqs * per_seq, block_size=bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    model.forward_batch(TokenBatch.build([(list(range(prompt)), 0, t, True) for t in tables], bs, cache.max_blocks),
                        cache)
    batches = [TokenBatch.build([([1 + i % 7], prompt + j, t, True) for i, t in enumerate(tables)], bs,
                                cache.max_blocks) for j in range(steps)]
    for batch in batches[:10]:
        model.forward_batch(batch, cache)
    times = []
    for _ in range(repeats):  # each repeat writes the same slots again: the same work each time
        start = time.perf_counter()
        for batch in batches:
            model.forward_batch(batch, cache)
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def without_native_forms(kernels: list) -> Iterator[None]:
    """The ``native_call`` of each kernel removed for the block (plans recorded in it call
    those kernels from Python), then put back."""
    saved = [(k, k.__dict__.pop("native_call")) for k in kernels if "native_call" in k.__dict__]
    try:
        yield
    finally:
        for k, make in saved:
            k.native_call = make


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="quantized-kernel pool threads (default: its own)")
    p.add_argument("--batch", type=int, default=16, help="sequences of the serving step (0: skip it)")
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
        batched: dict[str, list[float]] = {}
        try:
            for _ in range(3):  # take turns, so a slow spell of a shared machine hits both
                for name, native_forms in (("native stretches", True), ("kernel by kernel", False)):
                    # each timing records its plans over a new cache, with native forms or without
                    native_calls.available = available if native_forms else (lambda: False)
                    results.setdefault(name, []).append(step_ms(model, args.steps, args.repeats))
            if args.batch:
                from llaisys.kernels.cpu import misc, paged_native

                paged = [paged_native.kv_cache_write, paged_native.paged_attention, misc.embedding]
                for _ in range(3):
                    for name, native_forms, python_kernels in (("one native stretch", True, []),
                                                               ("paged ops from Python", True, paged),
                                                               ("kernel by kernel", False, [])):
                        native_calls.available = available if native_forms else (lambda: False)
                        with without_native_forms(python_kernels):
                            ms = batch_step_ms(model, args.steps, args.repeats, args.batch)
                        batched.setdefault(name, []).append(ms)
        finally:
            native_calls.available = available
    print(f"decoding step of a {LAYERS}-layer model of width {HIDDEN} (kernels of next to no work):")
    for name, ms in results.items():
        print(f"  {name:18s} {statistics.median(ms):.3f} ms per token")
    if batched:
        print(f"serving step of {args.batch} sequences, one token each (forward_batch over a paged cache):")
        for name, ms in batched.items():
            print(f"  {name:22s} {statistics.median(ms):.3f} ms per step ({', '.join(f'{m:.3f}' for m in ms)})")


if __name__ == "__main__":
    main()
