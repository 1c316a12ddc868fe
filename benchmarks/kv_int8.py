"""The KV cache in 8 bits (``LLMEngine(kv_cache_dtype="int8")``) against the model's float32
cache: bytes per token, how far the next-token distributions move, and decoding speed at a long
context.

- bytes per token: keys and values of every layer, f32 and int8 (the int8 layout's float32
  scale per head of each token included), and what f16 would take;
- distance, teacher-forced on a passage of plain English (quant_accuracy.py's): every position's
  logits with the cache in f32 and in int8 (the same ids, one pass of 128-token chunks each), then
  the share of positions whose most likely next token is the f32 cache's, and the mean
  KL(f32 || int8) in nats;
- decoding tokens/s of one sequence after a prompt of ``--context`` tokens: the prompt prefilled
  once, then ``--runs`` greedy generations of ``--gen-tokens`` tokens on the same engine (its
  prefix cache holds the prompt, so each run decodes at the long context), the median of their
  decode rates (steps after the first token).

    python3 benchmarks/kv_int8.py                          # the bundled SmolLM2-135M
    python3 benchmarks/kv_int8.py --model gemma3           # Gemma 3 270M Q4_K_M (test extra)
    python3 benchmarks/kv_int8.py --context 4096 --runs 5 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_accuracy import TEXT, log_softmax, model_path  # noqa: E402  (the passage, the model files)

CHUNK = 128  # tokens a teacher-forced pass runs at once


def bytes_per_token(model: Any) -> dict[str, int]:
    """Bytes of keys and values one token takes in f32, f16 (computed) and int8."""
    from llaisys.models.paged_cache import PagedKVCache
    from llaisys.runtime.dtypes import DataType

    c = model.config
    return {name: PagedKVCache.bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype)
            for name, dtype in (("f32", DataType.F32), ("f16", DataType.F16), ("int8", DataType.I8))}


def all_logits(model: Any, ids: list[int], kv_dtype: str) -> np.ndarray:
    """Logits (S, V) of every position of ``ids``, the cache in ``kv_dtype``, in chunks of CHUNK."""
    from llaisys.models.paged_cache import TokenBatch

    bs = 16
    blocks = -(-len(ids) // bs)
    cache = model.new_paged_cache(blocks, bs, kv_dtype)
    table = list(range(blocks))
    rows = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start:start + CHUNK]
        batch = TokenBatch.build([(chunk, start, table, True)], bs, cache.max_blocks)
        batch.logit_rows = np.arange(len(chunk), dtype=np.int64)  # every row's logits
        rows.append(model.forward_batch(batch, cache))
    return np.concatenate(rows)  # (S, V)


def distance(model: Any, ids: list[int]) -> dict[str, float]:
    """Top-1 agreement and mean / max KL(f32 || int8) of the next-token distributions."""
    ref = log_softmax(all_logits(model, ids, "auto"))
    got = log_softmax(all_logits(model, ids, "int8"))
    kl = (np.exp(ref) * (ref - got)).sum(axis=1)  # (S,)
    return {"positions": len(ids), "top1_agreement": float((ref.argmax(1) == got.argmax(1)).mean()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}


def decode_rate(model: Any, ids: list[int], gen_tokens: int, runs: int, kv_dtype: str) -> dict[str, Any]:
    """Median decode tokens/s of ``runs`` greedy generations after ``ids`` (the prompt prefilled
    by a first, unmeasured run and then found in the prefix cache)."""
    from llaisys.engine import LLMEngine
    from llaisys.generation import GenerationConfig

    tokens = (len(ids) + gen_tokens + 64) // 16 * 16 + 16
    engine = LLMEngine(model, kv_cache_tokens=tokens, max_seqs=1, kv_cache_dtype=kv_dtype)
    config = GenerationConfig(max_new_tokens=gen_tokens, ignore_eos=True)
    rates = []
    for run in range(runs + 1):
        engine.add_request(None, ids, config)
        decoded, seconds, started = 0, 0.0, False
        while engine.has_unfinished():
            t = time.perf_counter()
            outputs = engine.step()
            spent = time.perf_counter() - t
            picked = sum(len(o.token_ids) for o in outputs)
            if started:
                decoded, seconds = decoded + picked, seconds + spent
            started = started or picked > 0
        if run:
            rates.append(decoded / seconds)
    return {"decode_tok_s": statistics.median(rates), "runs": [round(r, 2) for r in rates]}


def long_prompt(tokenizer: Any, n: int) -> list[int]:
    """``n`` token ids: the passage over and over (a long context of real text)."""
    base = tokenizer.encode(TEXT)
    ids = list(base)
    while len(ids) < n:
        ids.extend(base[1:])
    return ids[:n]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file, or 'gemma3' (default: the bundled SmolLM2)")
    parser.add_argument("--tokens", type=int, default=512, help="positions scored, at most (default 512)")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens before decoding (default 4096)")
    parser.add_argument("--gen-tokens", type=int, default=32, help="tokens decoded per run (default 32)")
    parser.add_argument("--runs", type=int, default=5, help="measured decoding runs (default 5)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    from llaisys.models import load_model

    path = model_path(args.model)
    model = load_model(path)
    ids = model.tokenizer.encode(TEXT)[:args.tokens]
    result: dict[str, Any] = {"model": path.name, "bytes_per_token": bytes_per_token(model),
                              "distance": distance(model, ids), "context": args.context, "decode": {}}
    prompt = long_prompt(model.tokenizer, args.context)
    for kv in ("auto", "int8"):
        result["decode"]["f32" if kv == "auto" else kv] = decode_rate(model, prompt, args.gen_tokens, args.runs, kv)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    b, dist, dec = result["bytes_per_token"], result["distance"], result["decode"]
    print(f"{path.name}: KV bytes per token f32 {b['f32']}, f16 {b['f16']}, int8 {b['int8']} "
          f"({b['int8'] / b['f32']:.1%} of f32, {b['int8'] / b['f16']:.1%} of f16)")
    print(f"teacher-forced over {dist['positions']} positions: top-1 agreement {dist['top1_agreement']:.2%}, "
          f"mean KL(f32 || int8) {dist['mean_kl']:.2e}, max {dist['max_kl']:.2e}")
    f32, int8 = dec["f32"]["decode_tok_s"], dec["int8"]["decode_tok_s"]
    print(f"decode after {args.context} tokens (median of {args.runs}): f32 {f32:.1f} tok/s, int8 {int8:.1f} tok/s "
          f"({int8 / f32:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
