"""Speculative decoding in the serving engine: the scheduler's drafts and roll-back on block
counts alone, then on the bundled model the same tokens, text, finish reasons and logprobs with
speculation as without it (greedy, seeded sampling, penalties; drafts accepted and rejected;
stop rules inside an accepted run; prefix caching; preemption), and the server's
``speculative_tokens`` field and metrics through the official openai client."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from llaisys.engine import KVBlockManager, LLMEngine, Scheduler, Sequence
from llaisys.engine.grammar import GrammarCompiler, GuidedConfig
from llaisys.generation import GenerationConfig
from llaisys.generation.speculative import Drafter
from test_server import client_for, metric, post, running
from test_speculative import COPYING, OTHER

LIST = ("Repeat this list exactly.\nList: apple, pear, plum, fig, kiwi, lime, date, lemon, cherry, mango.\n"
        "Repeated: apple, pear,")
PROMPTS = [COPYING, OTHER, COPYING.replace("stats", "numbers"), LIST]


# ---- the scheduler, no model -------------------------------------------------------------------
def _decoding(blocks: KVBlockManager, scheduler: Scheduler, ids: list[int], k: int, max_tokens: int = 32
              ) -> Sequence:
    """A sequence whose prompt ``ids`` ran and whose first token was picked: decoding next
    (its drafter drafting k ids from the first draft on)."""
    drafter = Drafter(k)
    drafter.length = k
    seq = Sequence("s", ids[:-1], max_tokens, drafter=drafter)
    scheduler.add(seq)
    scheduler.commit(scheduler.schedule())
    seq.output_ids.append(ids[-1])
    return seq


# the last 7 ids copy the first 7: the match of 7 ids lets a draft be up to 6 long (8, 9, 10, ...)
COPY = list(range(1, 21)) + list(range(1, 8))


def test_a_draft_joins_the_decoding_chunk_and_counts_against_the_budget():
    blocks = KVBlockManager(16, 4)
    scheduler = Scheduler(blocks, max_batched_tokens=64)
    seq = _decoding(blocks, scheduler, COPY, k=3)
    (chunk,) = scheduler.schedule().chunks
    assert chunk.draft == (8, 9, 10) and chunk.length == 4 and chunk.samples
    assert chunk.token_ids == [7, 8, 9, 10]  # the last token, then the draft
    assert len(blocks.block_table("s")) == 8 and seq.num_computed == 26  # 32 slots for positions 0..29


def test_no_draft_when_the_budget_or_the_blocks_are_short():
    blocks = KVBlockManager(16, 4)
    scheduler = Scheduler(blocks, max_batched_tokens=64)
    _decoding(blocks, scheduler, COPY, k=3)
    scheduler.max_batched_tokens = 3  # the token and two more: a draft of 3 does not fit
    (chunk,) = scheduler.schedule().chunks
    assert chunk.draft == () and chunk.length == 1
    tight = KVBlockManager(9, 4)  # the prompt takes 7 blocks (positions 0..27)
    scheduler = Scheduler(tight, max_batched_tokens=64)
    seq = _decoding(tight, scheduler, COPY, k=6, max_tokens=8)
    tight.pool.take_new()  # another user's block: one free, but a draft of 6 (positions 27..32) needs two
    step = scheduler.schedule()
    assert step.chunks[0].draft == () and not step.preempted and seq.status.value == "running"


def test_a_draft_grown_by_the_last_one_holding_still_fits_the_budget():
    blocks = KVBlockManager(16, 4)
    scheduler = Scheduler(blocks, max_batched_tokens=64)
    seq = _decoding(blocks, scheduler, COPY, k=4)
    seq.drafter.length = 2
    step = scheduler.schedule()
    assert step.chunks[0].draft == (8, 9)
    scheduler.commit(step)
    seq.output_ids += [8, 9, 10]  # the whole draft held: the next one would be 4 long
    scheduler.accept_draft(seq, 2)
    scheduler.max_batched_tokens = 4  # the token and 3 more
    step = scheduler.schedule()
    assert step.chunks[0].draft == () and step.num_tokens <= 4


def test_no_drafts_while_more_than_speculative_max_seqs_run():
    ids = {"a": [9, 1, 2, 3, 4, 5, 6, 7, 9, 1, 2], "b": [7, 8, 9, 3, 4, 5, 6, 7, 8, 9]}  # no shared prefix
    blocks = KVBlockManager(32, 4)
    scheduler = Scheduler(blocks, max_batched_tokens=64, speculative_max_seqs=1)
    seqs = [Sequence(name, ids[name][:-1], 16, drafter=Drafter(2)) for name in ids]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.commit(scheduler.schedule())
    for seq in seqs:
        seq.output_ids.append(ids[seq.seq_id][-1])
    assert [c.draft for c in scheduler.schedule().chunks] == [(), ()]  # two run, one may speculate
    scheduler.speculative_max_seqs = 2
    assert [c.draft for c in scheduler.schedule().chunks] == [(3, 4), (3, 4)]


def test_accepting_a_draft_rolls_back_its_rejected_tail_and_caches_only_verified_blocks():
    blocks = KVBlockManager(16, 4)
    scheduler = Scheduler(blocks, max_batched_tokens=64)
    seq = _decoding(blocks, scheduler, [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], k=6)  # 10 computed, 11 tokens
    step = scheduler.schedule()
    assert step.chunks[0].draft == (3, 1, 2, 2, 2, 2)  # what followed "1 2", padded with its last id
    table = list(blocks.block_table("s"))
    assert len(table) == 5  # positions 0..16
    scheduler.commit(step)
    assert seq.num_computed == 11  # the draft does not count yet
    assert set(blocks.pool.by_hash.values()) == {table[0], table[1]}
    seq.output_ids += [3, 9]  # the draft's first id held, its second did not: 9 was picked instead
    scheduler.accept_draft(seq, 1)
    assert seq.num_computed == 12 and seq.num_tokens == 13
    assert blocks.block_table("s") == table[:4]  # the fifth block held only rejected positions
    assert set(blocks.pool.by_hash.values()) == {table[0], table[1], table[2]}  # 8..11 verified; 12..15 not full
    assert next(iter(blocks.pool.free)) == table[4]  # handed back first in the free queue: it holds nothing
    scheduler.finish(seq)
    assert blocks.held_references() == 0


# ---- on the bundled model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    from llaisys.models import load_model

    return load_model()


def _run(model, prompts, configs, **engine_options):
    """Results and stats of ``prompts`` run together by a new engine."""
    engine = LLMEngine(model, **engine_options)
    results = engine.generate(prompts, configs)
    return results, engine.stats()


def _same(plain, fast) -> None:
    for a, b in zip(plain, fast):
        assert b.token_ids == a.token_ids
        assert b.text.encode() == a.text.encode()
        assert b.finish_reason == a.finish_reason


CONFIGS = {
    "greedy": GenerationConfig(max_new_tokens=40),
    "sampled": GenerationConfig(max_new_tokens=40, temperature=0.8, top_p=0.95, seed=7),
    "penalized": GenerationConfig(max_new_tokens=40, temperature=0.7, top_k=40, repetition_penalty=1.1,
                                  presence_penalty=0.5, frequency_penalty=0.3, min_tokens=5, seed=11),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("k", [2, 5])
def test_a_batch_with_speculation_equals_it_without(model, name, k):
    cfg = CONFIGS[name]
    configs = [cfg if cfg.greedy else cfg.replace(seed=cfg.seed + i) for i in range(len(PROMPTS))]
    plain, plain_stats = _run(model, PROMPTS, configs)
    fast, stats = _run(model, PROMPTS, [c.replace(speculative_tokens=k) for c in configs])
    _same(plain, fast)
    assert plain_stats.drafted_tokens == 0
    assert 0 < stats.accepted_tokens <= stats.drafted_tokens == sum(r.timings.drafted_tokens for r in fast)
    assert stats.generation_tokens == plain_stats.generation_tokens


def test_copying_prompts_accept_and_an_unrelated_one_seldom_drafts(model):
    cfg = GenerationConfig(max_new_tokens=48, speculative_tokens=4)
    copying, story = _run(model, [COPYING, OTHER], [cfg, cfg.replace(temperature=1.0, seed=3,
                                                                         speculative_tokens=8)])[0]
    assert copying.timings.accepted_tokens >= 12, copying.timings
    # the story's drafts are few: its rare recurring pairs match no longer run, so they stay one id long
    assert story.timings.drafted_tokens <= story.timings.generated_tokens // 8, story.timings
    assert story.timings.accepted_tokens < copying.timings.accepted_tokens // 4, story.timings


def test_the_engine_option_is_the_default_and_a_request_may_set_its_own(model):
    cfg = GenerationConfig(max_new_tokens=24)
    plain, _ = _run(model, [COPYING, LIST], cfg)
    fast, stats = _run(model, [COPYING, LIST], [cfg, cfg.replace(speculative_tokens=2)], speculative_tokens=4)
    _same(plain, fast)
    assert fast[0].timings.drafted_tokens > 0 and fast[1].timings.drafted_tokens > 0
    engine = LLMEngine(model, speculative_tokens=4)
    own = engine.add_request(None, LIST, cfg.replace(speculative_tokens=2))
    default = engine.add_request(None, COPYING, cfg)
    assert (engine.requests[own].seq.drafter.k, engine.requests[default].seq.drafter.k) == (2, 4)
    assert stats.drafts > 0 and stats.drafted_tokens == fast[0].timings.drafted_tokens + fast[1].timings.drafted_tokens
    with pytest.raises(ValueError, match="speculative_tokens"):
        LLMEngine(model, speculative_tokens=65)
    with pytest.raises(ValueError, match="speculative_max_seqs"):
        LLMEngine(model, speculative_max_seqs=0)
    limited, limited_stats = _run(model, [COPYING, LIST], [cfg, cfg.replace(speculative_tokens=2)],
                                  speculative_tokens=4, speculative_max_seqs=1)
    _same(plain, limited)
    assert limited_stats.drafted_tokens < stats.drafted_tokens  # drafts only once one request is left


def test_logprobs_and_streamed_deltas_are_those_of_plain_decoding(model):
    cfg = GenerationConfig(max_new_tokens=32, logprobs=2)

    def outputs(k: int) -> tuple[list, str, list[int], list]:
        engine = LLMEngine(model)
        engine.add_request("a", COPYING, cfg.replace(speculative_tokens=k))
        steps = []
        while engine.has_unfinished():
            steps += engine.step()
        logprobs = [lp for out in steps for lp in out.logprobs]
        return logprobs, "".join(out.text_delta for out in steps), [t for out in steps for t in out.token_ids], steps

    want_lp, want_text, want_ids, plain_steps = outputs(0)
    got_lp, got_text, got_ids, fast_steps = outputs(4)
    assert (got_text, got_ids) == (want_text, want_ids)
    assert [(s.token_id, s.logprob, s.top_logprobs) for s in got_lp] == [
        (s.token_id, s.logprob, s.top_logprobs) for s in want_lp]
    assert len(fast_steps) < len(plain_steps)
    assert max(len(out.token_ids) for out in fast_steps) > 1  # an accepted run comes as one delta
    assert [out.completion_tokens for out in fast_steps][-1] == len(want_ids)


@pytest.mark.parametrize("cut, k", [({"stop": ("len(",)}, 8), ({"stop": ("total",)}, 8), ({"max_new_tokens": 7}, 2),
                                    ({"max_new_tokens": 21}, 3)])
def test_stop_rules_inside_an_accepted_run(model, cut, k):
    """A stop string falling inside an accepted draft ends the request there: what came after
    it is dropped, as plain decoding never picks it. Drafts never run past the token limit (a
    draft of k needs k + 1 tokens left), so it ends an accepted run at its last token at most."""
    cfg = GenerationConfig(max_new_tokens=48).replace(**cut)
    plain, _ = _run(model, [COPYING], cfg)
    fast, stats = _run(model, [COPYING], cfg.replace(speculative_tokens=k))
    _same(plain, fast)
    assert stats.accepted_tokens > 0


def test_prefix_caching_never_keeps_rejected_keys_and_values(model):
    """Blocks a speculating engine registered, generated tokens included, serve a follow-up
    that continues each reply: its output equals an engine's that computes everything."""
    cfg = GenerationConfig(max_new_tokens=40, temperature=0.9, seed=5)
    engine = LLMEngine(model, block_size=4)
    first = engine.generate(PROMPTS, [cfg.replace(speculative_tokens=3, seed=i) for i in range(len(PROMPTS))])
    assert engine.stats().drafted_tokens > engine.stats().accepted_tokens > 0
    tok = model.tokenizer
    follow = [tok.encode(p, add_special_tokens=True) + r.token_ids for p, r in zip(PROMPTS, first)]
    greedy = GenerationConfig(max_new_tokens=16)
    hits = engine.stats().prefix_hits
    again = engine.generate(follow, greedy)
    assert engine.stats().prefix_hits - hits >= sum(len(f) for f in follow) // 2  # served from the cache
    fresh = LLMEngine(model, prefix_caching=False).generate(follow, greedy)
    _same(fresh, again)
    assert engine.blocks.held_references() == 0


def test_preemption_under_a_small_pool_changes_nothing(model):
    cfg = GenerationConfig(max_new_tokens=40)
    prompts = [COPYING, COPYING.replace("stats", "numbers"), LIST, COPYING.replace("stats", "values")]
    plain, _ = _run(model, prompts, cfg)
    need = max(len(model.tokenizer.encode(p, add_special_tokens=True)) for p in prompts) + 40
    fast, stats = _run(model, prompts, cfg.replace(speculative_tokens=4), kv_cache_tokens=need + 48, block_size=8)
    _same(plain, fast)
    assert stats.preemptions > 0 and stats.accepted_tokens > 0


def test_constrained_requests_and_other_devices_do_not_speculate(model):
    grammar = GrammarCompiler(model.tokenizer, model.eos_token_ids).compile("regex", "[a-z]+( [a-z]+)*")
    engine = LLMEngine(model)
    engine.add_request("g", LIST, GuidedConfig(max_new_tokens=8, grammar=grammar, speculative_tokens=4))
    engine.add_request("p", LIST, GenerationConfig(max_new_tokens=8, speculative_tokens=4))
    assert engine.requests["g"].seq.drafter is None and engine.requests["p"].seq.drafter is not None

    class OffTheCpu:  # the model, claiming a device where multi-row passes are not shown exact
        device = SimpleNamespace(is_cpu=False, type=None)

        def __getattr__(self, name: str):
            return getattr(model, name)

    other = LLMEngine(OffTheCpu(), speculative_tokens=4)
    cfg = GenerationConfig(max_new_tokens=16)
    results = other.generate([COPYING], cfg)
    assert other.stats().drafted_tokens == 0
    assert results[0].token_ids == LLMEngine(model).generate([COPYING], cfg)[0].token_ids


# ---- the server ---------------------------------------------------------------------------------
def test_the_server_field_and_metrics(smollm2_model):
    from llaisys.server import ServerOptions, create_app

    with running(create_app(ServerOptions(speculative_tokens=3), model=smollm2_model)) as url:
        client = client_for(url)
        name = client.models.list().data[0].id
        ask = dict(model=name, prompt=COPYING, max_tokens=32, temperature=0)
        plain = client.completions.create(**ask, extra_body={"speculative_tokens": 0}).choices[0].text
        assert metric(url, "vllm:spec_decode_num_draft_tokens_total", model_name=name) == 0
        fast = client.completions.create(**ask, extra_body={"speculative_tokens": 5}).choices[0].text
        default = client.completions.create(**ask).choices[0].text  # the server's 3
        assert fast == plain == default
        drafted = metric(url, "vllm:spec_decode_num_draft_tokens_total", model_name=name)
        accepted = metric(url, "vllm:spec_decode_num_accepted_tokens_total", model_name=name)
        drafts = metric(url, "vllm:spec_decode_num_drafts_total", model_name=name)
        assert 0 < accepted <= drafted and drafts > 0
        chat = [{"role": "user", "content": "Repeat exactly: red green blue red green blue red green blue"}]
        replies = {k: client.chat.completions.create(model=name, messages=chat, max_tokens=24, temperature=0.8,
                                                     seed=4, extra_body={"speculative_tokens": k})
                   .choices[0].message.content for k in (0, 4)}
        assert replies[0] == replies[4]
        lp = [client.completions.create(**ask, logprobs=2, extra_body={"speculative_tokens": k}).choices[0].logprobs
              for k in (0, 5)]
        assert lp[0].model_dump() == lp[1].model_dump()
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            **ask, stream=True, extra_body={"speculative_tokens": 5}) if c.choices)
        assert streamed == plain
        for bad in (65, -1, "2", 2.5, True):
            r = post(f"{url}/v1/completions", json_body={**ask, "speculative_tokens": bad})
            assert r.status_code == 400, bad
            assert r.json()["error"]["param"] == "speculative_tokens"
            assert "speculative_tokens" in r.json()["error"]["message"]


def test_server_options_check_speculative_tokens():
    from llaisys.server import ServerOptions

    for bad in (-1, 65, 1.5, True):
        with pytest.raises(ValueError, match="speculative_tokens"):
            ServerOptions(speculative_tokens=bad)
    with pytest.raises(ValueError, match="speculative_max_seqs"):
        ServerOptions(speculative_max_seqs=0)


def test_serve_takes_speculative_tokens():
    from llaisys.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--speculative-tokens", "3"]).speculative_tokens == 3
    assert parser.parse_args(["serve"]).speculative_tokens == 0
    assert parser.parse_args(["serve", "--speculative-max-seqs", "2"]).speculative_max_seqs == 2
    for bad in ("65", "-1", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--speculative-tokens", bad])
