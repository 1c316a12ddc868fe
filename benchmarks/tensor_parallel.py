"""Tensor parallelism: decode tokens/s and memory per rank for 1 and 2 ranks, and how much of a
token goes to the all-reduces.

A random-weight model with Qwen2-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV heads, MLP
896 x 4864, vocabulary 151936; bf16 weights widened to f32 in the kernels, about 1 GB) is
written once to ``--dir``; it is large enough that decoding is bound by the bytes of weights
each token reads. Each rank gets ``--threads`` threads (1: on a 2-core machine, 2 ranks use
both cores). Per rank: decode tokens/s (median of ``--repeats`` runs of ``--tokens`` greedy
tokens after a prompt), peak RSS, and the time spent inside the communicator's collectives
per token next to the rest (compute). The table ends with what the figures predict for N
hosts: compute / N + all-reduce time, the all-reduces staying as they are on one host (a
network is slower; on such a machine's memory, 2 x 24 + 2 small all-reduces a token).

    python3 benchmarks/tensor_parallel.py                 # 1 and 2 ranks
    python3 benchmarks/tensor_parallel.py --ranks 1,2 --tokens 32 --json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

QWEN2_05B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
                 intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 torch_dtype="bfloat16")


def write_model(folder: Path) -> Path:
    """A random bf16 Qwen2-0.5B-shaped model folder (config.json + model.safetensors)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    c = QWEN2_05B
    d, inter, dh = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    nq, nkv = c["num_attention_heads"] * dh, c["num_key_value_heads"] * dh
    rng = np.random.default_rng(0)
    bf16 = lambda *shape, scale=0.02: (rng.standard_normal(shape, np.float32) * scale).astype(ml_dtypes.bfloat16)  # noqa: E731
    tensors = {"model.embed_tokens.weight": bf16(c["vocab_size"], d), "model.norm.weight": bf16(d, scale=1.0)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": bf16(d, scale=1.0), p + "post_attention_layernorm.weight": bf16(d, scale=1.0),
            p + "self_attn.q_proj.weight": bf16(nq, d), p + "self_attn.q_proj.bias": bf16(nq),
            p + "self_attn.k_proj.weight": bf16(nkv, d), p + "self_attn.k_proj.bias": bf16(nkv),
            p + "self_attn.v_proj.weight": bf16(nkv, d), p + "self_attn.v_proj.bias": bf16(nkv),
            p + "self_attn.o_proj.weight": bf16(d, nq),
            p + "mlp.gate_proj.weight": bf16(inter, d), p + "mlp.up_proj.weight": bf16(inter, d),
            p + "mlp.down_proj.weight": bf16(d, inter),
        })
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(QWEN2_05B))
    return folder


class TimedComm:
    """A communicator that adds up the seconds spent in its collectives."""

    def __init__(self, comm):
        self.comm, self.seconds = comm, 0.0

    def __getattr__(self, name):
        attr = getattr(self.comm, name)
        if name not in ("all_reduce", "all_gather"):
            return attr

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def all_reduce_latency(comm, hidden: int, calls: int = 300) -> float:
    """Median seconds of one all-reduce of a decode step's (1, hidden) f32 rows, the ranks
    starting together (so waiting for a slower rank is left out)."""
    from llaisys.tensor import Tensor

    if comm.size == 1:
        return 0.0
    buf, times = Tensor.zeros((1, hidden)), []
    for _ in range(calls):
        comm.barrier()
        t = time.perf_counter()
        comm.all_reduce(buf)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rank_main(args: argparse.Namespace) -> None:
    """One rank's part (run under mpiexec, or alone for 1 rank): rank 0 prints a JSON line."""
    import numpy as np

    from llaisys.cli.main import apply_threads
    from llaisys.models import load_model
    from llaisys.models.tensor_parallel import follow, release
    from llaisys.parallel.comm import SingleProcess
    from llaisys.parallel.mpi import MPICommunicator, world_size

    apply_threads(args.threads)
    base = MPICommunicator() if world_size() > 1 else SingleProcess()
    comm = TimedComm(base)
    start = time.perf_counter()
    model = load_model(args.model_dir, comm=comm if base.size > 1 else None)
    load_s = time.perf_counter() - start
    if base.rank:
        follow(model)
    else:
        prompt = np.arange(1, 33)
        rates, comm_shares = [], []
        for _ in range(args.repeats):
            cache = model.new_cache(64 + args.tokens)
            token = int(model.forward(prompt, cache).argmax())
            comm.seconds = 0.0
            t = time.perf_counter()
            for _ in range(args.tokens):
                token = int(model.forward([token], cache).argmax())
            elapsed = time.perf_counter() - t
            rates.append(args.tokens / elapsed)
            comm_shares.append(comm.seconds / args.tokens)
        release(model)
    latency = all_reduce_latency(base, model.config.hidden_size)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB
    rss_all = base.comm.gather(rss, root=0) if base.size > 1 else [rss]
    weights_mib = model.weight_bytes() / 2**20
    if base.rank == 0:
        tok_s = statistics.median(rates)
        print(json.dumps({"ranks": base.size, "decode_tok_s": tok_s, "ms_per_token": 1e3 / tok_s,
                          "collective_ms_per_token": 1e3 * statistics.median(comm_shares),
                          "all_reduce_us": 1e6 * latency,
                          "all_reduces_per_token": 2 * model.config.num_hidden_layers + 1,
                          "peak_rss_mib_per_rank": rss_all, "weight_mib_per_rank": weights_mib,
                          "load_s": load_s}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2", help="rank counts to run, comma-separated (default 1,2)")
    ap.add_argument("--tokens", type=int, default=24, help="decode tokens per run (default 24)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per rank count; the median is reported")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank (default 1)")
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "llaisys-tp-bench-qwen2-0.5b"),
                    help="where the random model is written once")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)

    from llaisys.parallel.launch import find_mpiexec

    folder = write_model(Path(args.dir))
    results = []
    for n in [int(x) for x in args.ranks.split(",")]:
        cmd = [sys.executable, __file__, "--rank-main", "--model-dir", str(folder), "--tokens", str(args.tokens),
               "--repeats", str(args.repeats), "--threads", str(args.threads)]
        if n > 1:
            cmd = [find_mpiexec(), "-n", str(n), *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    base = results[0]
    print(f"{'ranks':>5} {'tok/s':>7} {'x 1 rank':>8} {'ms/token':>9} {'in collectives':>15} {'all-reduces':>12} "
          f"{'RSS MiB per rank':>18} {'weights MiB':>12}")
    for r in results:
        pure = r["all_reduce_us"] * r["all_reduces_per_token"] / 1e3
        print(f"{r['ranks']:>5} {r['decode_tok_s']:>7.2f} {r['decode_tok_s'] / base['decode_tok_s']:>8.2f} "
              f"{r['ms_per_token']:>9.1f} {r['collective_ms_per_token']:>12.2f} ms {pure:>9.2f} ms "
              f"{'/'.join(f'{m:.0f}' for m in r['peak_rss_mib_per_rank']):>18} {r['weight_mib_per_rank']:>12.0f}")
    print("in collectives: time inside all-reduce/all-gather per token, waiting for the slowest rank included; "
          "all-reduces: their own cost, (2 L + 1) x the median latency of one with the ranks in step; "
          "RSS counts the pages of the mapped model file a rank touched while loading, weights what it keeps (rank 0's)")
    last = results[-1]
    pure = last["all_reduce_us"] * last["all_reduces_per_token"] / 1e3
    one = base["ms_per_token"]
    print(f"\nprediction for N hosts, one rank each: {one:.1f} ms / N + all-reduces ({pure:.2f} ms a token over this "
          "host's memory; a network adds its latency to each of them):")
    for n in (2, 4, 8):
        ms = one / n + pure
        print(f"  N = {n}: {ms:.1f} ms/token, {1e3 / ms:.1f} tok/s ({one / ms:.2f} x one host)")


if __name__ == "__main__":
    main()
