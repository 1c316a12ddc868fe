"""``llaisys bench``: load time, time to first token, prefill and decode speed, peak memory,
and how close decoding comes to the machine's memory bandwidth.

The workload: a prompt of exactly ``--prompt-tokens`` tokens (a fixed English passage,
repeated as needed), then ``--gen-tokens`` greedy tokens with end-of-sequence ignored, in a
fresh KV cache each time. Figures are medians over ``--repeats`` runs after ``--warmup`` runs.
Decoding one token reads every weight once (``weight_bytes_per_step``); on the CPU, the
bytes per token times decode tokens/s over the rate the bench's threads read memory at
(measured once, after the runs) is the share of the bandwidth a decode step reaches.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections import Counter
from typing import Any

from ..engine import LLMEngine, stream
from ..engine.stream import BLOCK_ROUND
from ..models.paged_cache import KV_CACHE_DTYPES
from ..generation import GenerationConfig, Timings
from .common import add_model_options, load_from_args, non_negative_int, positive_int, read_image

DESCRIPTION = """Measure load time, time to first token, prefill and decode speed and peak memory.

The workload: a prompt of exactly --prompt-tokens tokens (a fixed English passage, repeated as
needed), then --gen-tokens greedy tokens with end-of-sequence ignored, in a fresh KV cache each
time. Figures are medians over --repeats runs after --warmup runs. Then the weight bytes a
decoded token reads and, on the CPU, the share of the machine's read bandwidth (measured by the
bench's threads summing 1 GiB, best of 3) that decoding reaches."""

BANDWIDTH_BYTES = 1 << 30  # the read probe's buffer: far beyond any last-level cache

PASSAGE = (
    "The sea was calm that morning, and the fishing boats left the harbour one by one. "
    "Old Marta watched them from the hill above the village, counting the sails as she had "
    "done for forty years. Her grandson asked why she still counted them. She said that the "
    "sea keeps its own accounts, and someone on the shore should keep theirs too. "
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` sub-command."""
    p = subparsers.add_parser("bench", help="measure load time, prefill and decode speed, memory",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=positive_int, default=512, metavar="N", help="prompt length (default 512)")
    p.add_argument("--gen-tokens", type=positive_int, default=128, metavar="N", help="tokens to generate (default 128)")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="N", help="measured runs (default 3)")
    p.add_argument("--warmup", type=non_negative_int, default=1, metavar="N", help="unmeasured runs first (default 1)")
    p.add_argument("--concurrency", type=positive_int, default=1, metavar="N",
                   help="run N sequences of the workload at once and report aggregate figures "
                        "(default 1: one sequence)")
    p.add_argument("--image", default=None, metavar="PATH",
                   help="also time a vision-language model's image path on this image: preprocessing, then "
                        "the encoder and projector (medians over --repeats, the tower's cache bypassed)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, metavar="TYPE",
                   help="the KV cache's type: auto (the model's, default) or int8 (alias q8_0: 8-bit keys and "
                        "values with a scale per head of each token)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    add_model_options(p)
    p.set_defaults(func=run)


def prompt_ids(tokenizer: Any, n: int) -> list[int]:
    """Exactly ``n`` token ids (n,) of PASSAGE repeated, with the tokenizer's BOS when it adds one.
    Without a vocabulary (a model that takes ids only), ids spread over the vocabulary."""
    if getattr(tokenizer, "missing", None) is not None:
        return [(i * 7919) % tokenizer.vocab_size for i in range(n)]
    base = tokenizer.encode(PASSAGE, add_special_tokens=False)
    head = tokenizer.encode("", add_special_tokens=True)
    ids = list(head)
    while len(ids) < n:
        ids.extend(base)
    return ids[:n]


def run_once(model: Any, ids: list[int], gen_tokens: int, kv_cache_dtype: str = "auto") -> Timings:
    """One greedy generation of ``gen_tokens`` tokens after ``ids``, end-of-sequence ignored,
    on an engine of its own (as ``stream`` makes one: one block for the request; its KV cache
    in ``kv_cache_dtype``)."""
    tokens = -(-(len(ids) + gen_tokens) // BLOCK_ROUND) * BLOCK_ROUND
    engine = LLMEngine(model, kv_cache_tokens=tokens, block_size=tokens, max_seqs=1, prefix_caching=False,
                       kv_cache_dtype=kv_cache_dtype)
    events = stream(engine, ids, GenerationConfig(max_new_tokens=gen_tokens, ignore_eos=True))
    result = events.result()
    if len(result.token_ids) != gen_tokens:
        raise ValueError(f"generated {len(result.token_ids)} tokens, not {gen_tokens}: the context is too short")
    return result.timings


def distinct_prompts(ids: list[int], n: int, vocab_size: int) -> list[list[int]]:
    """``n`` prompts of len(ids) tokens that differ from their second token on (so no prefix is
    shared and each is prefilled in full); the first is ``ids`` itself."""
    out = [list(ids)]
    for i in range(1, n):
        shifted = ids[:1] + [(t + 31 * i) % vocab_size for t in ids[1:]]
        out.append(shifted)
    return out


def run_concurrent(model: Any, prompts: list[list[int]], gen_tokens: int,
                   kv_cache_dtype: str = "auto") -> dict[str, float]:
    """All ``prompts`` at once through a fresh LLMEngine (its KV cache in ``kv_cache_dtype``),
    ``gen_tokens`` greedy tokens each (end-of-sequence ignored). Prefill rate: prompt tokens over
    the time until every sequence had its first token; decode rate: tokens picked by steps after
    that, over their time."""
    engine = LLMEngine(model, max_seqs=max(len(prompts), 1), kv_cache_dtype=kv_cache_dtype)
    config = GenerationConfig(max_new_tokens=gen_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(None, p, config)
    started: set[str] = set()
    ttfts: list[float] = []
    decode_tokens, decode_s, all_started = 0, 0.0, None
    while engine.has_unfinished():
        t = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if all_started is not None:
            decode_tokens += sum(len(o.token_ids) for o in outputs)
            decode_s += now - t
        for o in outputs:
            if o.request_id not in started:
                started.add(o.request_id)
                ttfts.append(now - t0)
        if all_started is None and len(started) == len(prompts):
            all_started = now
    prompt_tokens = sum(len(p) for p in prompts)
    return {"ttft_s": statistics.median(ttfts), "prefill_tok_s": prompt_tokens / ((all_started or now) - t0),
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0}


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (ru_maxrss)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB elsewhere


def summarize(runs: list[Timings]) -> dict[str, float]:
    """Medians of the runs' figures."""
    return {
        "ttft_ms": statistics.median(t.ttft_s for t in runs) * 1000,
        "prefill_tok_s": statistics.median(t.prefill_tokens_per_s for t in runs),
        "decode_tok_s": statistics.median(t.decode_tokens_per_s for t in runs),
    }


def weight_type(model: Any) -> str:
    """The data type the layers' matrices are held in (``Q4_1``; ``Q4_K/Q6_K`` when they differ,
    the most common first), which can differ from ``model.dtype``, the activations' type."""
    counts = Counter(t.dtype.name for t in layer_matrices(model))
    return "/".join(name for name, _ in counts.most_common()) or model.dtype.name


def layer_matrices(model: Any) -> list[Any]:
    """Every layer's weight matrices, fused ones whole or in their parts."""
    return [t for lp in model.params.layers for t in (lp.qkv, *lp.qkv_parts, lp.o, lp.gate_up, *lp.gate_up_parts,
                                                      lp.down, lp.gate_exps, lp.up_exps, lp.down_exps)
            if t is not None]


def block_arithmetic(model: Any) -> str | None:
    """The arithmetic the model's GGUF block-format matrices run in on the CPU ("int16", "int8",
    "f32"), or None when it holds none or runs elsewhere."""
    from ..kernels.quant import native

    blocks = any(t.dtype.is_quantized for t in layer_matrices(model))
    return native.quant_math() if blocks and model.device.is_cpu and native.available() else None


def weight_bytes_per_step(model: Any) -> int:
    """Bytes of weights one decode step of one sequence reads, as the model holds them (quantized
    matrices at their encoded size): every layer's matrices, biases and norms, a sparse layer's
    router and k / E of each expert matrix (its top-k experts of E), the final norm, the output
    head whole, and one row of the embedding table (besides the whole table when the head is tied)."""
    p, (count, chosen) = model.params, model.config.arch_args.routed_experts()
    total = p.norm.nbytes + p.lm_head.nbytes + p.embed.nbytes // p.embed.shape[0]
    for lp in p.layers:
        dense = (lp.attn_norm, lp.qkv, lp.qkv_bias, lp.o, lp.o_bias, lp.ffn_norm, lp.gate_up, lp.down, lp.q_norm,
                 lp.k_norm, lp.post_attn_norm, lp.post_ffn_norm, lp.router, *lp.qkv_parts, *lp.gate_up_parts)
        total += sum(t.nbytes for t in dense if t is not None)
        experts = (lp.gate_exps, lp.up_exps, lp.down_exps)
        total += sum(t.nbytes * chosen // count for t in experts if t is not None)
    return total


def read_bandwidth(model: Any) -> float | None:
    """Bytes per second the native pool's threads (the bench's count) read from memory, or None
    off the CPU (the weights live in the device's memory) or without the native library."""
    from ..kernels.quant import native

    if not model.device.is_cpu or not native.available():
        return None
    return native.read_bandwidth(BANDWIDTH_BYTES)


def bandwidth_figures(model: Any, decode_tok_s: float, concurrency: int) -> dict[str, Any]:
    """Weight bytes per decode step and per decoded token (a step decodes a token of each of
    ``concurrency`` sequences), the read bandwidth (GB/s) and the share of it decoding reaches:
    bytes per token x decode tokens/s / bandwidth."""
    step = weight_bytes_per_step(model)
    per_token = step / concurrency
    bandwidth = read_bandwidth(model)
    return {"weight_bytes_per_step": step, "weight_bytes_per_token": per_token,
            "read_bandwidth_gb_s": bandwidth / 1e9 if bandwidth else None,
            "decode_bandwidth_fraction": per_token * decode_tok_s / bandwidth if bandwidth else None}


def image_figures(model: Any, image: Any, warmup: int, repeats: int) -> dict[str, Any]:
    """Milliseconds to preprocess ``image`` and to encode and project it (medians over
    ``repeats`` after ``warmup``), its tiles and the rows it becomes; ValueError for a model
    without vision."""
    tower = getattr(model, "vision", None)
    if tower is None:
        raise ValueError(f"--image: {model.source} has no vision encoder")
    prep, encode = [], []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        processed = tower.processor(image)
        t1 = time.perf_counter()
        rows = tower.rows_of(processed)
        t2 = time.perf_counter()
        if i >= warmup:
            prep.append((t1 - t0) * 1000)
            encode.append((t2 - t1) * 1000)
    return {"image_size": list(image.size), "image_tiles": int(processed.pixels.shape[0]),
            "image_rows": int(rows.shape[0]), "image_preprocess_ms": statistics.median(prep),
            "image_encode_ms": statistics.median(encode)}


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload the options describe; return the figures."""
    image = read_image(args.image) if getattr(args, "image", None) else None
    t0 = time.perf_counter()
    model = load_from_args(args)
    load_s = time.perf_counter() - t0
    images = image_figures(model, image, args.warmup, args.repeats) if image is not None else {}
    limit = model.config.max_position_embeddings
    if args.prompt_tokens + args.gen_tokens > limit:
        raise ValueError(f"--prompt-tokens + --gen-tokens = {args.prompt_tokens + args.gen_tokens} exceeds the "
                         f"model's context of {limit}")
    ids = prompt_ids(model.tokenizer, args.prompt_tokens)
    concurrency = getattr(args, "concurrency", 1)
    kv = getattr(args, "kv_cache_dtype", "auto")
    if concurrency > 1:
        prompts = distinct_prompts(ids, concurrency, model.config.vocab_size)
        for _ in range(args.warmup):
            run_concurrent(model, prompts, args.gen_tokens, kv)
        results = [run_concurrent(model, prompts, args.gen_tokens, kv) for _ in range(args.repeats)]
        figures = {key: statistics.median(r[key] for r in results) for key in ("prefill_tok_s", "decode_tok_s")}
        figures["ttft_ms"] = statistics.median(r["ttft_s"] for r in results) * 1000
    else:
        for _ in range(args.warmup):
            run_once(model, ids, args.gen_tokens, kv)
        figures = summarize([run_once(model, ids, args.gen_tokens, kv) for _ in range(args.repeats)])
    return {
        "engine": "llaisys", "model": str(model.source), "weights": weight_type(model),
        "dtype": str(getattr(model.dtype, "name", model.dtype)),  # the activations' type
        "quant_math": block_arithmetic(model),
        "threads": args.threads, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "concurrency": concurrency, "repeats": args.repeats, "load_s": load_s, "kv_cache_dtype": kv,
        "kv_bytes_per_token": model.kv_bytes_per_token(kv), **figures,
        "peak_rss_mb": peak_rss_mb(),  # before the bandwidth probe's buffer
        **bandwidth_figures(model, figures["decode_tok_s"], concurrency), **images,
    }


def format_bandwidth(figures: dict[str, Any]) -> list[str]:
    """The weight bytes per token and bandwidth lines."""
    step, n = figures["weight_bytes_per_step"], figures.get("concurrency", 1)
    lines = [f"weights/token  {figures['weight_bytes_per_token'] / 1e6:.1f} MB"
             + (f" ({step / 1e6:.1f} MB a step of {n} sequences)" if n > 1 else "")]
    if figures["read_bandwidth_gb_s"] is None:
        return lines + ["memory read    not measured (off the CPU, or no native library)"]
    return lines + [
        f"memory read    {figures['read_bandwidth_gb_s']:.1f} GB/s (best of 3 over 1 GiB)",
        f"decode reads   {figures['decode_bandwidth_fraction']:.1%} of it",
    ]


def format_table(figures: dict[str, Any]) -> str:
    """The figures as aligned lines."""
    return "\n".join([
        f"model          {figures['model']} ({figures['weights']} weights, {figures['dtype']} activations"
        + (f"; {figures['quant_math']} arithmetic" if figures.get("quant_math") else "") + ")",
        f"workload       {figures['prompt_tokens']} prompt tokens, {figures['gen_tokens']} generated, "
        f"median of {figures['repeats']}"
        + (f", {figures['concurrency']} sequences at once (aggregate rates)" if figures.get("concurrency", 1) > 1
           else ""),
        f"threads        {figures['threads'] or 'as the environment says'}",
        *([f"KV cache       {figures['kv_cache_dtype']}, {figures['kv_bytes_per_token']} bytes a token"]
          if "kv_cache_dtype" in figures else []),
        f"load time      {figures['load_s']:.2f} s",
        f"time to first  {figures['ttft_ms']:.1f} ms",
        f"prefill        {figures['prefill_tok_s']:.1f} tok/s",
        f"decode         {figures['decode_tok_s']:.1f} tok/s",
        f"peak memory    {figures['peak_rss_mb']:.0f} MiB",
        *format_bandwidth(figures),
        *([f"image          {figures['image_size'][0]}x{figures['image_size'][1]}: {figures['image_tiles']} tiles, "
           f"{figures['image_rows']} rows; preprocess {figures['image_preprocess_ms']:.1f} ms, "
           f"encode {figures['image_encode_ms']:.1f} ms"] if "image_encode_ms" in figures else []),
    ])


def run(args: argparse.Namespace) -> int:
    """Benchmark and print the figures."""
    figures = benchmark(args)
    print(json.dumps(figures, indent=2) if args.json else format_table(figures))
    return 0
