"""Time to first token of a long prompt after a restart: cold (a new engine computes every
token) against restored from the prefix cache's disk tier (a new engine over the directory an
earlier engine wrote, ``LLMEngine(prefix_cache_dir=...)``).

    python benchmarks/prefix_cache_restart.py                  # bundled SmolLM2-135M, 2000 tokens, 2 threads
    python benchmarks/prefix_cache_restart.py --tokens 4000 --repeat 7 --model path/to/model.gguf

One engine runs the prompt with a directory and is closed (its writer done). Then each run
makes a fresh engine, cold ones without tiers and restored ones over that directory (its index
read on start), the two alternating, and runs the prompt for one token; the figures are medians
of the request's time to first token (arrival to first token: the lookup, the restore and the
prefill of what is left). Engine creation (the directory's index) is timed apart. Every run's
token is checked equal to the cold one. The files were just written, so they are read from the
page cache; a cold disk adds its read time (the directory's bytes are printed).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

TEXT = ("The committee met on a grey morning to review the quarterly figures, the state of the "
        "northern warehouse, the hiring plan for the spring and a proposal to replace the old "
        "billing system. Each item was discussed at length, and the minutes record who spoke, "
        "what they asked for and what was decided. ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000, help="prompt tokens (default 2000)")
    p.add_argument("--repeat", type=int, default=5, help="runs of each way (default 5)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M)")
    args = p.parse_args()

    from llaisys.cli.main import apply_threads
    from llaisys.engine import LLMEngine
    from llaisys.generation import GenerationConfig
    from llaisys.models import load_model

    apply_threads(args.threads)
    model = load_model(args.model)
    ids = model.tokenizer.encode(TEXT * (args.tokens // 40 + 1))[:args.tokens]
    config = GenerationConfig(max_new_tokens=1)
    pool = args.tokens + 64
    options = dict(kv_cache_tokens=pool, block_size=args.block_size)
    with tempfile.TemporaryDirectory(prefix="llaisys-prefix-") as folder:
        writer = LLMEngine(model, prefix_cache_dir=folder, **options)
        want = writer.generate([ids], config)[0].token_ids
        writer.close()
        disk = writer.tiers.disk
        print(f"{model.source}: {len(ids)} prompt tokens, {args.threads} threads, block size {args.block_size}; "
              f"directory: {len(disk.files.index)} files, {disk.nbytes / 2**20:.1f} MiB")
        times: dict[str, list[float]] = {"cold": [], "restored": []}
        opened: list[float] = []
        restored_tokens = 0
        for _ in range(args.repeat):
            for way in ("cold", "restored"):
                start = time.perf_counter()
                engine = LLMEngine(model, **options) if way == "cold" else LLMEngine(model, prefix_cache_dir=folder,
                                                                                     **options)
                if way == "restored":
                    opened.append(time.perf_counter() - start)
                result = engine.generate([ids], config)[0]
                assert result.token_ids == want, (way, result.token_ids, want)
                times[way].append(result.timings.ttft_s)
                if way == "restored":
                    restored_tokens = engine.stats().prefix_restored_disk
                    engine.close()
    cold, warm = statistics.median(times["cold"]), statistics.median(times["restored"])
    print(f"time to first token, median of {args.repeat}:")
    print(f"  cold      {cold * 1e3:8.1f} ms   (runs: {', '.join(f'{t * 1e3:.0f}' for t in times['cold'])})")
    print(f"  restored  {warm * 1e3:8.1f} ms   (runs: {', '.join(f'{t * 1e3:.0f}' for t in times['restored'])}); "
          f"{restored_tokens} tokens from disk, {len(ids) - restored_tokens} computed")
    print(f"  speed-up  {cold / warm:8.1f}x; opening the directory (index of headers): "
          f"{statistics.median(opened) * 1e3:.1f} ms median")


if __name__ == "__main__":
    main()
