"""The serving engine on real models: batched forward against transformers, batched greedy
outputs equal to each prompt alone, prefix caching, preemption, per-request seeds, abort and
the engine thread."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from conftest import random_hf_model
from llaisys.engine import EngineStopped, EngineThread, LLMEngine, generate
from llaisys.generation import GenerationConfig
from llaisys.models import load_model
from llaisys.models.paged_cache import TokenBatch

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colours are",
    "Translate to French: good morning",
    "A list of fruits: apple, banana,",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random-weight Qwen2 folder (f32) and transformers' model of it."""
    hf = random_hf_model("qwen2", 3, vocab_size=300, num_hidden_layers=2, max_position_embeddings=128)
    folder = tmp_path_factory.mktemp("qwen2-engine")
    hf.save_pretrained(folder)
    return load_model(folder), hf


def _hf_all_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().numpy()  # (S, V)


def _alone(model, prompt, config, **engine_options):
    return LLMEngine(model, **engine_options).generate([prompt], config)[0]


# ---- the batched forward ---------------------------------------------------------------
def test_forward_batch_matches_transformers_for_mixed_chunks(tiny):
    """Three sequences at different stages in one pass: a first prefill chunk, a later chunk,
    and a decode step; each row's logits equal transformers' at that position."""
    model, hf = tiny
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, 300, n)) for n in (7, 23, 12)]
    cache = model.new_paged_cache(num_blocks=16, block_size=4)
    tables = [[3, 9, 1, 14, 2, 6], [0, 5, 7, 11, 12, 15], [4, 8, 10, 13]]  # shuffled, disjoint blocks
    # first pass: sequence 1 runs 15 tokens, sequence 2 runs 11: both prefill
    batch = TokenBatch.build([(seqs[1][:15], 0, tables[1], False), (seqs[2][:11], 0, tables[2], True)], 4,
                             cache.max_blocks)
    model.forward_batch(batch, cache)
    # second pass: sequence 0 starts (7 tokens), sequence 1 runs its last 8, sequence 2 decodes one
    batch = TokenBatch.build([(seqs[0], 0, tables[0], True), (seqs[1][15:], 15, tables[1], True),
                              (seqs[2][11:], 11, tables[2], True)], 4, cache.max_blocks)
    logits = model.forward_batch(batch, cache)  # (3, V)
    for row, ids in zip(logits, seqs):
        np.testing.assert_allclose(row, _hf_all_logits(hf, ids)[-1], rtol=1e-4, atol=1e-4)


def test_forward_batch_refuses_a_foreign_cache_and_bad_ids(tiny, smollm2_model):
    model, _ = tiny
    cache = smollm2_model.new_paged_cache(4, 4)
    batch = TokenBatch.build([([1, 2], 0, [0], True)], 4, cache.max_blocks)
    with pytest.raises(ValueError, match="not made for this model"):
        model.forward_batch(batch, cache)
    own = model.new_paged_cache(4, 4)
    bad = TokenBatch.build([([1, 999], 0, [0], True)], 4, own.max_blocks)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.forward_batch(bad, own)


# ---- batched equals alone --------------------------------------------------------------
def test_eight_prompts_together_equal_each_alone_and_single_sequence_generate(smollm2_model):
    config = GenerationConfig(max_new_tokens=12)
    together = LLMEngine(smollm2_model).generate(PROMPTS, config)
    for prompt, result in zip(PROMPTS, together):
        alone = _alone(smollm2_model, prompt, config)
        assert result.token_ids == alone.token_ids, prompt
        assert result.text == alone.text
        # and the single-sequence path (checked against transformers in test_models_gguf)
        assert result.token_ids == generate(smollm2_model, prompt, config).token_ids, prompt


def test_staggered_arrivals_and_small_token_budget_equal_each_alone(smollm2_model):
    config = GenerationConfig(max_new_tokens=10)
    engine = LLMEngine(smollm2_model, max_batched_tokens=8)  # prompts run in chunks beside decodes
    pending = list(enumerate(PROMPTS[:6]))
    tokens: dict[str, list[int]] = {}
    names: dict[str, int] = {}
    tick = 0
    while pending or engine.has_unfinished():
        if pending and tick % 3 == 0:  # a new arrival every third step
            i, prompt = pending.pop(0)
            names[engine.add_request(None, prompt, config)] = i
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        tick += 1
    for rid, i in names.items():
        assert tokens[rid] == _alone(smollm2_model, PROMPTS[i], config).token_ids, PROMPTS[i]


def test_logits_are_bitwise_equal_alone_and_batched(smollm2_model):
    """The native kernels are batch-invariant: a sequence's logits do not depend on what else
    runs in the pass, or on how its prompt was chunked."""
    model = smollm2_model
    ids = model.tokenizer.encode(PROMPTS[3])
    others = [model.tokenizer.encode(p) for p in PROMPTS[4:7]]
    bs, half = 16, len(ids) // 2

    def run(passes):
        cache = model.new_paged_cache(32, bs)
        for chunks in passes:
            rows = model.forward_batch(TokenBatch.build(chunks, bs, cache.max_blocks), cache)
        return rows[-1]

    alone = run([[(ids, 0, [0], True)]])
    split_alone = run([[(ids[:half], 0, [0], False)], [(ids[half:], half, [0], True)]])
    batched = run([[(others[0], 0, [1], False), (ids[:half], 0, [5], False)],
                   [(o, 0, [i + 2], True) for i, o in enumerate(others[1:])] + [(ids[half:], half, [5], True)]])
    assert np.array_equal(split_alone, alone)
    assert np.array_equal(batched, alone)
    # a decode step (one row: M = 1 in every linear) alone and among other sequences' rows
    step = [7]
    decode_alone = run([[(ids, 0, [0], False)], [(step, len(ids), [0], True)]])
    decode_batched = run([[(ids, 0, [0], False)] + [(o, 0, [i + 1], False) for i, o in enumerate(others)],
                          [(o[-1:], len(o), [i + 1], True) for i, o in enumerate(others)]
                          + [(step, len(ids), [0], True)]])
    assert np.array_equal(decode_batched, decode_alone)


# ---- prefix caching --------------------------------------------------------------------
def test_shared_system_prompt_is_computed_once_and_changes_nothing(smollm2_model):
    tok = smollm2_model.tokenizer
    system = tok.apply_chat_template([{"role": "system", "content": "You are a terse assistant who answers "
                                       "in one short sentence, always politely, never with lists."}],
                                     add_generation_prompt=False)
    prompts = [tok.encode(system + f"Question {i}: what is {i} plus {i}?") for i in range(3)]
    config = GenerationConfig(max_new_tokens=8)
    engine = LLMEngine(smollm2_model, block_size=16)
    first = engine.generate(prompts[:1], config)
    rest = engine.generate(prompts[1:], config)
    stats = engine.stats()
    shared_blocks = len(tok.encode(system)) // 16
    assert shared_blocks >= 1
    assert stats.prefix_hits >= 2 * shared_blocks * 16
    assert all(r.timings.cached_tokens >= shared_blocks * 16 for r in rest)
    plain = LLMEngine(smollm2_model, prefix_caching=False).generate(prompts, config)
    assert [r.token_ids for r in first + rest] == [r.token_ids for r in plain]
    assert engine.blocks.held_references() == 0


def test_eviction_under_pressure_keeps_results_right(smollm2_model):
    config = GenerationConfig(max_new_tokens=6)
    engine = LLMEngine(smollm2_model, kv_cache_tokens=64, block_size=4)  # 16 blocks
    results = [engine.generate([p], config)[0] for p in PROMPTS[:4]] + engine.generate(PROMPTS[:1], config)
    expect = [_alone(smollm2_model, p, config) for p in PROMPTS[:4] + PROMPTS[:1]]
    assert [r.token_ids for r in results] == [r.token_ids for r in expect]
    assert engine.blocks.held_references() == 0


# ---- preemption ------------------------------------------------------------------------
def test_pool_too_small_for_all_still_completes_every_request_equally(smollm2_model):
    config = GenerationConfig(max_new_tokens=16)
    small = LLMEngine(smollm2_model, kv_cache_tokens=96, block_size=8)  # 12 blocks for 6 sequences
    results = small.generate(PROMPTS[:6], config)
    assert small.stats().preemptions > 0
    big = LLMEngine(smollm2_model).generate(PROMPTS[:6], config)
    assert [r.token_ids for r in results] == [r.token_ids for r in big]
    assert small.blocks.held_references() == 0


def test_request_that_cannot_fit_the_pool_is_refused_at_once(smollm2_model):
    engine = LLMEngine(smollm2_model, kv_cache_tokens=32, block_size=8)
    with pytest.raises(ValueError, match="more than the whole pool holds"):
        engine.add_request(None, PROMPTS[0], GenerationConfig(max_new_tokens=64))
    assert not engine.has_unfinished()


# ---- sampling per request --------------------------------------------------------------
def test_a_seed_reproduces_the_same_text_alone_or_batched(smollm2_model):
    sampled = GenerationConfig(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = _alone(smollm2_model, PROMPTS[1], sampled)
    others = [GenerationConfig(max_new_tokens=12, temperature=1.0, seed=s) for s in range(3)]
    batched = LLMEngine(smollm2_model).generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]],
                                                [others[0], sampled, others[1], others[2]])
    assert batched[1].token_ids == alone.token_ids and batched[1].text == alone.text


def test_a_batch_of_mixed_settings_picks_what_each_sampler_picks_alone(smollm2_model):
    # The engine samples a step's rows in one call; the single-sequence loop uses Sampler row by row.
    configs = [GenerationConfig(max_new_tokens=10, temperature=t, top_k=k, top_p=p, min_p=mp, repetition_penalty=rep,
                                frequency_penalty=f, presence_penalty=pr, min_tokens=mt, logprobs=lp, seed=i)
               for i, (t, k, p, mp, rep, f, pr, mt, lp) in enumerate([
                   (0.3, 0, 0.9, 0.0, 1.0, 0.3, 0.0, 0, None), (0.0, 0, 1.0, 0.0, 1.2, 0.5, 0.0, 5, 2),
                   (1.0, 40, 0.95, 0.0, 1.0, 0.0, 0.0, 0, 1), (0.7, 0, 1.0, 0.1, 1.1, 0.0, 0.6, 3, None),
                   (1.3, 0, 0.8, 0.05, 1.0, 0.0, 0.0, 0, 0), (0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0, None),
                   (0.9, 5, 1.0, 0.0, 1.0, -0.5, 0.0, 0, None), (0.5, 0, 0.5, 0.0, 0.9, 0.0, 1.0, 10, 3)])]
    engine = LLMEngine(smollm2_model)
    ids = [engine.add_request(None, prompt, config) for prompt, config in zip(PROMPTS, configs)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            logprobs[out.request_id] += out.logprobs or []
    for i, prompt, config in zip(ids, PROMPTS, configs):
        alone = list(generate(smollm2_model, prompt, config).token_ids)
        assert tokens[i] == alone, prompt
        if config.logprobs is not None:
            single, want = LLMEngine(smollm2_model), []
            single.add_request("x", prompt, config)
            while single.has_unfinished():
                want += [lp for out in single.step() for lp in out.logprobs]
            assert logprobs[i] == want  # batched logits are bitwise those of a request alone


def test_stop_strings_and_finish_reasons(smollm2_model):
    greedy = _alone(smollm2_model, PROMPTS[2], GenerationConfig(max_new_tokens=12))
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12
    stop = greedy.text[3:6]
    stopped = _alone(smollm2_model, PROMPTS[2], GenerationConfig(max_new_tokens=12, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == greedy.text[:greedy.text.index(stop)]


def test_logprobs_per_token(smollm2_model):
    config = GenerationConfig(max_new_tokens=3, logprobs=2)
    engine = LLMEngine(smollm2_model)
    rid = engine.add_request(None, PROMPTS[0], config)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    ids = smollm2_model.tokenizer.encode(PROMPTS[0])
    cache = smollm2_model.new_cache()
    first = smollm2_model.forward(ids, cache).astype(np.float64)
    want = first - np.log(np.exp(first - first.max()).sum()) - first.max()
    lp = outs[0].logprobs[0]
    assert lp.token_id == int(np.argmax(first))
    assert lp.logprob == pytest.approx(want[lp.token_id], abs=1e-4)
    assert [t for t, _ in lp.top_logprobs] == list(np.argsort(-first)[:2])


# ---- requests coming and going -----------------------------------------------------------
def test_abort_frees_blocks_at_once(smollm2_model):
    engine = LLMEngine(smollm2_model)
    a = engine.add_request("a", PROMPTS[0], GenerationConfig(max_new_tokens=50))
    engine.add_request("b", PROMPTS[1], GenerationConfig(max_new_tokens=3))
    engine.step()
    held = engine.blocks.held_references()
    out = engine.abort(a)
    assert out.finished and out.finish_reason == "abort"
    assert engine.blocks.held_references() < held
    assert engine.abort(a) is None  # already gone
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.held_references() == 0


def test_bad_requests_are_refused_with_reasons(smollm2_model):
    engine = LLMEngine(smollm2_model)
    engine.add_request("x", PROMPTS[0])
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("x", PROMPTS[1])
    with pytest.raises(ValueError, match="context holds"):
        engine.add_request(None, [1] * smollm2_model.config.max_position_embeddings)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(None, "")
    with pytest.raises(ValueError, match="positive integer"):
        LLMEngine(smollm2_model, block_size=0)


def test_engine_thread_serves_concurrent_callers(smollm2_model):
    config = GenerationConfig(max_new_tokens=8)
    expect = {p: _alone(smollm2_model, p, config).token_ids for p in PROMPTS[:4]}
    loop = EngineThread(LLMEngine(smollm2_model))
    got: dict[str, list[int]] = {}

    def client(prompt: str) -> None:
        ids = []
        for out in loop.submit(prompt, config):
            ids += out.token_ids
        got[prompt] = ids

    threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS[:4]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == expect
    # a bad request is refused to its caller; a closed stream aborts its request
    with pytest.raises(ValueError, match="empty"):
        loop.submit("", config)
    stream = loop.submit(PROMPTS[0], GenerationConfig(max_new_tokens=200, ignore_eos=True))
    next(stream)
    stream.close()
    loop.call(lambda: None).result(10)  # the abort ran before this
    loop.call(lambda: None).result(10)
    assert loop.engine.blocks.held_references() == 0
    loop.stop()
    with pytest.raises(EngineStopped):
        loop.submit(PROMPTS[0], config)
