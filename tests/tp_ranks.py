"""Run under ``mpiexec -n N``: load a model split over the N ranks and, on rank 0, record what
tests/test_tensor_parallel.py compares with one process: a prompt's logits at every position,
greedy tokens of the single-sequence loop, and greedy tokens of a batch through the engine.

    mpiexec -n N python tests/tp_ranks.py MODEL OUT.npz [--device D --plugin LIB] [--die-after K]

``--device``/``--plugin``: the model on a plugin device, its collectives the plugin's
(``XcclCommunicator``). ``--die-after K``: rank 1 kills itself at its K-th pass (a rank that dies).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import numpy as np

PROMPTS = ([5, 17, 42, 9, 101, 7, 64, 33, 12, 250, 3, 77], [8, 8, 19, 200, 41], [60, 2, 2, 90, 14, 15, 160])
NEW_TOKENS = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--device", default=None)
    ap.add_argument("--plugin", default=None)
    ap.add_argument("--die-after", type=int, default=0)
    args = ap.parse_args()

    from llaisys.engine import LLMEngine, generate
    from llaisys.generation import GenerationConfig
    from llaisys.models import load_model
    from llaisys.models.tensor_parallel import follow, release
    from llaisys.parallel.mpi import MPICommunicator

    comm = MPICommunicator()
    if args.plugin:
        from llaisys.parallel.xccl import XcclCommunicator
        from llaisys.plugins import load_plugin
        load_plugin(args.plugin)
        comm = XcclCommunicator(args.device, comm)
    model = load_model(args.model, device=args.device, comm=comm)
    if comm.rank:
        if args.die_after and comm.rank == 1:
            passes, run, run_batch = [0], model.forward, model.forward_batch

            def dying(pass_):
                def counted(*a, **k):
                    passes[0] += 1
                    if passes[0] >= args.die_after:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return pass_(*a, **k)
                return counted
            model.forward, model.forward_batch = dying(run), dying(run_batch)
        follow(model)
        return
    greedy = GenerationConfig(temperature=0.0, max_new_tokens=10_000 if args.die_after else NEW_TOKENS,
                              ignore_eos=True)
    cache = model.new_cache(64)
    logits = model.forward(np.array(PROMPTS[0]), cache, all_logits=True)
    loop_tokens = generate(model, list(PROMPTS[0]), greedy).token_ids
    engine_tokens = [r.token_ids for r in LLMEngine(model, kv_cache_tokens=256).generate(
        [list(p) for p in PROMPTS], GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True))]
    release(model)
    np.savez(args.out, logits=logits, loop=np.array(loop_tokens),
             engine=np.array(engine_tokens))
    comm.close()


if __name__ == "__main__":
    sys.exit(main())
