"""llaisys on an NVIDIA GPU next to transformers on the same GPU, in BF16.

For each model (the bundled SmolLM2-135M, its GGUF weights dequantized to BF16 on the device,
and a random-weight model shaped like Qwen2.5-1.5B):

- decode tokens/s at batch 1 (greedy, end-of-sequence ignored), and that speed as a fraction
  of the memory-bandwidth limit: a decoding step reads every weight once, so the limit is
  bandwidth / weight bytes, with the bandwidth measured here by a large device-to-device copy;
  the same without CUDA graphs (``LLAISYS_NVIDIA_GRAPHS=0``: every kernel launched from Python);
- aggregate output tokens/s with 64 and 256 concurrent sequences (llaisys: the serving engine;
  transformers: one padded ``generate`` batch).

    python3 benchmarks/gpu.py                                   # both models, batches 1, 64, 256
    python3 benchmarks/gpu.py --models smollm2 --batches 1,64 --gen-tokens 64 --json
    LLAISYS_NVIDIA_SIMULATE=1 python3 benchmarks/gpu.py --quick # the script itself, on the CPU

Needs `pip install 'llaisys[cuda]'` and transformers; nothing runs without a GPU except the
``--quick`` smoke run of the simulated backend (numbers meaningless).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
QUICK_QWEN = dict(QWEN25_15B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def device_bandwidth(torch, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * nbytes / min(times)


def random_qwen_folder(settings: dict, folder: Path) -> Path:
    """A random-weight Qwen2 model saved in BF16 (no tokenizer: token ids only)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**settings)).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def llaisys_decode(model, prompt: list[int], gen: int, sync) -> float:
    """Batch-1 decode tokens/s of llaisys (time after the first token)."""
    from llaisys.engine import generate
    from llaisys.generation import GenerationConfig

    config = GenerationConfig(max_new_tokens=gen, temperature=0.0, ignore_eos=True)
    generate(model, prompt, GenerationConfig(max_new_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    result = generate(model, prompt, config)
    sync()
    return (result.timings.generated_tokens - 1) / max(result.timings.decode_s, 1e-9)


def llaisys_aggregate(model, prompt: list[int], n: int, gen: int, sync) -> float:
    """Output tokens/s of the serving engine with ``n`` sequences submitted together."""
    from llaisys.cli.bench import distinct_prompts
    from llaisys.engine import LLMEngine
    from llaisys.generation import GenerationConfig

    prompts = distinct_prompts(prompt, n, model.config.vocab_size)
    engine = LLMEngine(model, max_seqs=n, kv_cache_tokens=n * (len(prompt) + gen + 16),
                       max_batched_tokens=max(512, n))
    config = GenerationConfig(max_new_tokens=gen, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], GenerationConfig(max_new_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = engine.generate(prompts, config)
    sync()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def hf_rates(folder_or_model, prompt: list[int], batches: list[int], gen: int, device: str) -> dict[int, float]:
    """transformers on the same device in BF16: batch-1 decode tokens/s, and output tokens/s of
    one padded ``generate`` batch per size."""
    import torch

    model = folder_or_model.to(device, torch.bfloat16).eval()
    rates = {}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for n in batches:
        ids = torch.tensor([prompt] * n, device=device)
        kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
            sync()
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)  # prefill alone
            sync()
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, **kwargs)
            sync()
            total = time.perf_counter() - start
        rates[n] = (gen - 1) / max(total - prefill, 1e-9) if n == 1 else n * gen / total
    return rates


def run_model(name: str, args, torch, sync) -> dict:
    import transformers

    from llaisys.models import load_model

    gen = args.gen_tokens
    if name == "smollm2":
        model = load_model(device="nvidia", dtype="bf16")
        from llaisys.cli.bench import prompt_ids

        prompt = prompt_ids(model.tokenizer, args.prompt_tokens)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(Path(model.source).parent), gguf_file=Path(model.source).name, dtype=torch.bfloat16)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="llaisys-gpu-bench-"))
        folder = random_qwen_folder(QUICK_QWEN if args.quick else QWEN25_15B, tmp)
        model = load_model(folder, device="nvidia", dtype="bf16")
        prompt = [(i * 7919) % model.config.vocab_size for i in range(args.prompt_tokens)]
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    weight_bytes = model.num_parameters() * 2  # BF16 on the device, quantized weights included
    row = {"model": name, "parameters": model.num_parameters(), "weight_bytes": weight_bytes}
    row["llaisys_decode_tok_s"] = llaisys_decode(model, prompt, gen, sync)
    saved = os.environ.get("LLAISYS_NVIDIA_GRAPHS")
    os.environ["LLAISYS_NVIDIA_GRAPHS"] = "0"  # read when a cache is first run: each generate makes one
    try:
        row["llaisys_decode_no_graphs_tok_s"] = llaisys_decode(model, prompt, gen, sync)
    finally:
        if saved is None:
            del os.environ["LLAISYS_NVIDIA_GRAPHS"]
        else:
            os.environ["LLAISYS_NVIDIA_GRAPHS"] = saved
    for n in args.batches:
        if n > 1:
            row[f"llaisys_{n}_seq_tok_s"] = llaisys_aggregate(model, prompt, n, gen, sync)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for n, rate in hf_rates(hf, prompt, args.batches, gen, device).items():
        row["transformers_decode_tok_s" if n == 1 else f"transformers_{n}_seq_tok_s"] = rate
    if args.bandwidth:
        limit = args.bandwidth / weight_bytes  # decode steps/s if only the weights were read
        row["decode_fraction_of_bandwidth_limit"] = row["llaisys_decode_tok_s"] / limit
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,qwen2.5-1.5b", help="smollm2, qwen2.5-1.5b (comma-separated)")
    parser.add_argument("--batches", default="1,64,256", help="concurrent sequences (1 = batch-1 decode)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check the script, not the GPU")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.batches, args.prompt_tokens, args.gen_tokens = [1, 2], 8, 3
    import torch

    simulated = os.environ.get("LLAISYS_NVIDIA_SIMULATE", "0") not in ("", "0")
    if not torch.cuda.is_available() and not simulated:
        sys.exit("benchmarks/gpu.py needs an NVIDIA GPU (torch sees none); "
                 "LLAISYS_NVIDIA_SIMULATE=1 ... --quick checks the script on the CPU")
    from llaisys import Tensor

    Tensor.zeros((1,), device="nvidia")  # start the backend before transformers imports triton
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    info = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda-simulated (CPU)",
            "torch": torch.__version__}
    args.bandwidth = device_bandwidth(torch) if torch.cuda.is_available() else None
    info["copy_bandwidth_GBs"] = None if args.bandwidth is None else args.bandwidth / 1e9
    rows = [run_model(name, args, torch, sync) for name in args.models.split(",")]
    if args.json:
        print(json.dumps({**info, "results": rows}, indent=2))
        return
    print(" ".join(f"{k}: {v}" for k, v in info.items()))
    for row in rows:
        print(f"\n{row['model']} ({row['parameters'] / 1e6:.0f}M parameters, BF16)")
        for key, value in row.items():
            if key.endswith("tok_s"):
                print(f"  {key:34s} {value:10.1f}")
            elif key == "decode_fraction_of_bandwidth_limit":
                print(f"  {key:34s} {value:10.2f}")


if __name__ == "__main__":
    main()
