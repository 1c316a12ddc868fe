"""Decode speed of a Qwen3-MoE model against a dense Qwen3 of the same active width.

Two random-weight GGUF files written here (llama.cpp's names and layout): a Qwen3-MoE of
``--layers`` layers, hidden ``--hidden``, ``--experts`` experts of width ``--expert-width``,
``--top-k`` of them per token; and a dense Qwen3 of the same shape whose MLP width is the
active width, top_k * expert_width. So both read the same attention weights and the same
number of MLP weights per token; the MoE adds the router, the routing and one product per
chosen expert rather than one per matrix. Matrices are stored as ``--type`` (F32, Q8_0, Q4_K
...) and kept so. Each round decodes ``--tokens`` tokens one at a time after a short prompt,
the two models taking turns; the figures are medians over ``--rounds``: ms per token, tokens/s
and the ratio MoE / dense of the time per token (1.0: a token costs the MoE what it costs the
dense model).

    python3 benchmarks/moe_decode.py                      # hidden 1024, 32 experts of 256, top 4, 8 layers, Q8_0
    python3 benchmarks/moe_decode.py --type F32 --threads 1 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB = 2048
HEAD_DIM = 128


def write_model(path: Path, moe: bool, args: argparse.Namespace, rng: np.random.Generator) -> None:
    """A random-weight Qwen3(-MoE) GGUF at ``path``, its matrices stored as ``args.type``."""
    import gguf

    d, heads = args.hidden, args.hidden // HEAD_DIM
    kv = max(1, heads // 2)
    active = args.top_k * args.expert_width
    qtype = gguf.GGMLQuantizationType[args.type]
    w = gguf.GGUFWriter(str(path), "qwen3moe" if moe else "qwen3")
    w.add_block_count(args.layers)
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_feed_forward_length(active)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    if moe:
        w.add_expert_count(args.experts)
        w.add_expert_used_count(args.top_k)
        w.add_expert_feed_forward_length(args.expert_width)

    def matrix(name: str, *shape: int, scale: float = 0.03) -> None:
        arr = (rng.standard_normal(shape, np.float32) * scale).astype(np.float32)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, gguf.quants.quantize(arr, qtype))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, np.float32))

    w.add_tensor("token_embd.weight", (rng.standard_normal((VOCAB, d), np.float32) * 0.5).astype(np.float32))
    norm("output_norm.weight", d)
    matrix("output.weight", VOCAB, d)
    for i in range(args.layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", d)
        norm(p + "ffn_norm.weight", d)
        norm(p + "attn_q_norm.weight", HEAD_DIM)
        norm(p + "attn_k_norm.weight", HEAD_DIM)
        matrix(p + "attn_q.weight", heads * HEAD_DIM, d)
        matrix(p + "attn_k.weight", kv * HEAD_DIM, d)
        matrix(p + "attn_v.weight", kv * HEAD_DIM, d)
        matrix(p + "attn_output.weight", d, heads * HEAD_DIM)
        if moe:
            w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((args.experts, d), np.float32))
            matrix(p + "ffn_gate_exps.weight", args.experts, args.expert_width, d)
            matrix(p + "ffn_up_exps.weight", args.experts, args.expert_width, d)
            matrix(p + "ffn_down_exps.weight", args.experts, d, args.expert_width)
        else:
            matrix(p + "ffn_gate.weight", active, d)
            matrix(p + "ffn_up.weight", active, d)
            matrix(p + "ffn_down.weight", d, active)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def decode_seconds(model, tokens: int, prompt: list[int]) -> float:
    """Median seconds per token of ``tokens`` one-token decoding steps after ``prompt``."""
    cache = model.new_cache(len(prompt) + tokens + 1)
    logits = model.forward(prompt, cache)
    times = []
    for _ in range(tokens):
        start = time.perf_counter()
        logits = model.forward([int(np.argmax(logits))], cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--type", default="Q8_0", help="stored type of the matrices: F32, F16, Q8_0, Q4_K ...")
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="kernel and BLAS threads (default: all)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from llaisys.cli.main import apply_threads
    from llaisys.models import load_model

    if args.threads:
        apply_threads(args.threads)  # the BLAS pools and the quantized kernels' own
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, size=8).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"moe": Path(tmp) / "moe.gguf", "dense": Path(tmp) / "dense.gguf"}
        for name, path in paths.items():
            write_model(path, name == "moe", args, rng)
        models = {name: load_model(path) for name, path in paths.items()}
        times: dict[str, list[float]] = {name: [] for name in models}
        for name, model in models.items():  # warm-up: plans recorded, weights paged in
            decode_seconds(model, 4, prompt)
        for _ in range(args.rounds):
            for name, model in models.items():
                times[name].append(decode_seconds(model, args.tokens, prompt))
        types = {name: m.weight_types() for name, m in models.items()}
    result = {name: {"ms_per_token": 1e3 * statistics.median(t), "tok_s": 1 / statistics.median(t)}
              for name, t in times.items()}
    result["ratio_moe_to_dense"] = result["moe"]["ms_per_token"] / result["dense"]["ms_per_token"]
    result["shape"] = {k: getattr(args, k) for k in ("hidden", "experts", "expert_width", "top_k", "layers", "type")}
    result["weight_types"] = types
    if args.json:
        print(json.dumps(result, indent=2))
        return
    s = result["shape"]
    print(f"hidden {s['hidden']}, {s['layers']} layers, {s['type']}: MoE {s['experts']} experts of width "
          f"{s['expert_width']}, top {s['top_k']}; dense MLP width {s['top_k'] * s['expert_width']}")
    for name in ("moe", "dense"):
        print(f"{name:>6}: {result[name]['ms_per_token']:7.2f} ms/token {result[name]['tok_s']:8.1f} tok/s")
    print(f" ratio MoE / dense time per token: {result['ratio_moe_to_dense']:.2f}")


if __name__ == "__main__":
    main()
