"""What constrained decoding costs per engine step: N requests decoding together on the bundled
SmolLM2-135M, all following a JSON schema (llguidance), against the same N unconstrained.

Printed per run: the median time of a decode step with all N sequences running, for each
kind, and for the constrained one the time the grammar work itself took per step (filling the
N token masks in one llguidance call, unpacking them to boolean rows with the end-of-sequence
ids set, and advancing the matchers; the masked copy of the logits the sampler makes is not
counted there, only in the step). Runs alternate (unconstrained, constrained, ...) so that a
busy machine weighs on both alike.

    python3 benchmarks/structured.py [--requests 16] [--tokens 48] [--repeats 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "rating": {"type": "integer"}}, "required": ["title", "tags", "rating"]}
PROMPT = "Describe a made-up book as a JSON object with a title, a list of tags and a rating."


class Timer:
    """Wraps a function, adding the seconds of its calls to ``total``."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start
        return timed


def run(model, prompt_ids: list[int], n: int, tokens: int, grammar) -> dict[str, float]:
    """One batch of ``n`` requests; the median full-batch decode step (ms) and, with a grammar,
    the grammar work per such step (ms)."""
    from llaisys.engine import LLMEngine, grammar as grammar_module
    from llaisys.engine.grammar import GuidedConfig
    from llaisys.generation import GenerationConfig

    engine = LLMEngine(model)
    masks, consume = Timer(), Timer()
    engine._grammar_masks = masks.wrap(engine._grammar_masks)
    original_consume = grammar_module.GrammarMatcher.consume
    grammar_module.GrammarMatcher.consume = consume.wrap(original_consume)
    try:
        for i in range(n):
            base = dict(max_new_tokens=tokens, temperature=0.8, seed=i, ignore_eos=True)
            config = GuidedConfig(**base, grammar=grammar) if grammar is not None else GenerationConfig(**base)
            engine.add_request(None, prompt_ids, config)
        steps, grammar_s = [], []
        while engine.has_unfinished():
            before = masks.total + consume.total
            start = time.perf_counter()
            outs = engine.step()
            elapsed = time.perf_counter() - start
            decoding = all(not s.prefilling for s in engine.scheduler.running)
            if len(outs) == n and decoding and all(not o.finished for o in outs):
                steps.append(elapsed)
                grammar_s.append(masks.total + consume.total - before)
    finally:
        grammar_module.GrammarMatcher.consume = original_consume
    return {"step_ms": 1e3 * statistics.median(steps) if steps else float("nan"),
            "grammar_ms": 1e3 * statistics.median(grammar_s) if steps else float("nan"), "steps": len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from llaisys.engine.grammar import GrammarCompiler
    from llaisys.models import load_model

    model = load_model()
    tok = model.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]), add_special_tokens=False)
    start = time.perf_counter()
    compiler = GrammarCompiler(tok, model.eos_token_ids)
    grammar = compiler.compile("json_schema", SCHEMA)
    compile_ms = 1e3 * (time.perf_counter() - start)
    rows: dict[str, list[dict[str, float]]] = {"unconstrained": [], "constrained": []}
    run(model, ids, args.requests, 8, None)  # warm up
    for _ in range(args.repeats):
        rows["unconstrained"].append(run(model, ids, args.requests, args.tokens, None))
        rows["constrained"].append(run(model, ids, args.requests, args.tokens, grammar))
    free = statistics.median(r["step_ms"] for r in rows["unconstrained"])
    guided = statistics.median(r["step_ms"] for r in rows["constrained"])
    own = statistics.median(r["grammar_ms"] for r in rows["constrained"])
    result = {"requests": args.requests, "tokens": args.tokens, "tokenizer_and_compile_ms": round(compile_ms, 1),
              "unconstrained_step_ms": round(free, 2), "constrained_step_ms": round(guided, 2),
              "grammar_work_per_step_ms": round(own, 2), "overhead_pct": round(100 * (guided / free - 1), 1),
              "runs": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.requests} requests, {args.tokens} tokens each, median of {args.repeats} runs "
          f"(first compile with the tokenizer view: {compile_ms:.0f} ms)")
    print(f"  unconstrained decode step: {free:8.2f} ms")
    print(f"  constrained decode step:   {guided:8.2f} ms  ({result['overhead_pct']:+.1f} %)")
    print(f"  grammar work per step:     {own:8.2f} ms  (masks filled and unpacked, matchers advanced)")


if __name__ == "__main__":
    main()
