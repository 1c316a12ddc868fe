"""Speculative decoding (prompt lookup): the drafter on small id lists, and on the bundled model
the same token ids and text with speculation as without it, greedy and seeded sampling alike,
whether the drafts are accepted (a prompt that copies from itself) or rejected."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from llaisys.engine import generate, stream

from llaisys.engine import LLMEngine
from llaisys.generation import GenerationConfig
from llaisys.generation.speculative import Drafter, draft_tokens

CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    mu = mean(values)
    total = 0
    for v in values:
        total += (v - mu) ** 2
    return total / len(values)
'''
COPYING = "# stats.py, version 1\n" + CODE + "\n\n# stats.py, version 2 (the same code, with type hints added)\n"
OTHER = "Once upon a time, in a small village by the sea, there lived"


# ---- the drafter ---------------------------------------------------------------------------
def test_draft_follows_the_most_recent_longest_match():
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert draft_tokens(ids, 2) == [7, 8]  # "2 3" last seen before 7 8 (the trigram "5 2 3" never recurs)
    assert draft_tokens([4, 1, 2, 3, 5, 6, 0, 2, 3, 8, 1, 2, 3], 3) == [5, 6, 0]  # "1 2 3" beats the later "2 3"
    long = [7, 1, 2, 3, 4, 5, 6, 50, 0, 5, 6, 60, 0, 1, 2, 3, 4, 5, 6]
    assert draft_tokens(long, 1) == [50]  # the run "1 2 3 4 5 6" matched beats the later "5 6"


def test_draft_is_cut_at_k_and_at_the_end():
    assert draft_tokens([1, 2, 3, 4, 5, 1, 2], 2) == [3, 4]
    assert draft_tokens([1, 2, 3, 1, 2], 8) == [3, 1, 2]  # all that followed, up to the end
    assert draft_tokens([7, 7, 7], 4) == [7]  # a run repeats itself (the match overlaps the suffix)


def test_no_draft_without_a_match():
    assert draft_tokens([1, 2, 3, 4], 4) == []
    assert draft_tokens([5], 4) == []
    assert draft_tokens([], 4) == []
    assert draft_tokens([1, 2, 1], 0) == []


def test_draft_takes_numpy_ids():
    assert draft_tokens(np.array([3, 4, 5, 3, 4]), 1) == [5]


@pytest.mark.parametrize("bad", [-1, 65, 2.0, True])
def test_config_checks_speculative_tokens(bad):
    with pytest.raises((TypeError, ValueError), match="speculative_tokens"):
        GenerationConfig(speculative_tokens=bad)


# ---- on the bundled model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    from llaisys.models import load_model

    return load_model()


CONFIGS = {
    "greedy": GenerationConfig(max_new_tokens=48),
    "sampled": GenerationConfig(max_new_tokens=48, temperature=0.8, top_p=0.95, seed=7),
    "penalized": GenerationConfig(max_new_tokens=48, temperature=0.7, top_k=40, repetition_penalty=1.1,
                                  presence_penalty=0.5, frequency_penalty=0.3, seed=11),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("prompt", [COPYING, OTHER], ids=["copying", "other"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_speculation_changes_nothing(model, name, prompt, k):
    cfg = CONFIGS[name]
    plain = generate(model, prompt, cfg)
    fast = generate(model, prompt, cfg.replace(speculative_tokens=k))
    assert fast.token_ids == plain.token_ids
    assert fast.text.encode() == plain.text.encode()
    assert fast.finish_reason == plain.finish_reason
    t = fast.timings
    assert 0 <= t.accepted_tokens <= t.drafted_tokens
    assert plain.timings.drafted_tokens == 0


def test_drafts_are_accepted_on_a_copying_prompt(model):
    r = generate(model, COPYING, GenerationConfig(max_new_tokens=64, speculative_tokens=6))
    assert r.timings.accepted_tokens >= 20, r.timings.as_dict()


def test_drafts_are_rejected_and_dropped(model):
    r = generate(model, OTHER, GenerationConfig(max_new_tokens=48, temperature=1.0, seed=3, speculative_tokens=8))
    assert r.timings.drafted_tokens > r.timings.accepted_tokens


def test_stop_rules_per_accepted_token(model):
    """A stop string or the token limit falling inside an accepted draft ends it there."""
    base = GenerationConfig(max_new_tokens=37)
    plain = generate(model, COPYING, base)
    for cfg in (base, base.replace(stop=("len(",)), base.replace(max_new_tokens=5), base.replace(stop=("total",))):
        want = generate(model, COPYING, cfg)
        got = generate(model, COPYING, cfg.replace(speculative_tokens=8))
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    short = generate(model, COPYING, base.replace(max_new_tokens=5, speculative_tokens=8))
    assert short.token_ids == plain.token_ids[:5]


def test_cache_holds_what_plain_decoding_leaves(model):
    """After the end, and after closing a stream early, the engine's prefix cache holds the
    prompt and the tokens picked, with no rejected draft left behind: a later request that
    reuses those blocks decodes as on a fresh engine."""
    cfg = GenerationConfig(max_new_tokens=40)
    plain = generate(model, COPYING, cfg)
    engine = LLMEngine(model, kv_cache_tokens=1024)
    fast = generate(engine, COPYING, cfg.replace(speculative_tokens=8))
    assert fast.token_ids == plain.token_ids and fast.timings.drafted_tokens > 0

    s = stream(engine, COPYING, cfg.replace(speculative_tokens=8))
    events = [next(s) for _ in range(7)]
    s.close()
    assert not engine.has_unfinished() and engine.blocks.usage == 0.0  # every block handed back
    follow_up = COPYING + plain.text[:20]
    again = generate(engine, follow_up, cfg)
    assert again.timings.cached_tokens > 0  # the blocks written while drafting are reused ...
    assert again.token_ids == generate(model, follow_up, cfg).token_ids  # ... and hold the right keys
    assert [e.token_id for e in events] == plain.token_ids[:7]


def test_multi_token_logits_are_bitwise_one_at_a_time(model):
    """The premise: a pass of k tokens gives each row bit for bit as k one-token passes do."""
    ids = model.tokenizer.encode(COPYING)
    one, many = model.new_cache(512), model.new_cache(512)
    model.forward(ids[:-6], one)
    model.forward(ids[:-6], many)
    rows = np.stack([model.forward([t], one) for t in ids[-6:]])  # (6, V)
    assert np.array_equal(model.forward(ids[-6:], many, all_logits=True), rows)


def test_drafter_drafts_k_ids_or_none():
    ids = [9, 1, 2, 3, 4, 5, 6, 7, 9, 1, 2]  # "9 1 2" recurs: a match of 3 ids
    assert Drafter(4).propose(ids, 100) == [3, 4]  # the first draft: 2 long
    assert Drafter(1).propose(ids, 100) == [3]
    d = Drafter(4)
    d.length = 4
    assert d.propose([7, 7, 7, 7, 7], 100) == [7, 7, 7]  # a match of 4 ids drafts 3, padded with its last id
    assert Drafter(4).propose(ids, 1) == []  # fewer tokens left to pick than its length
    assert Drafter(4).propose([5, 1, 9, 1], 100) == []  # a lone recurring id is no match at min_ngram 2


def test_drafter_draft_is_as_long_as_its_match_is_sure():
    """A draft is one id shorter than the ids its occurrence matched: a bare bigram drafts one
    id, a long copied run up to the length; of several occurrences the longest match wins."""
    d = Drafter(8)
    d.length = 8
    assert d.propose([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2], 100) == [3]  # matched "1 2" only
    run = [20, 21, 22, 23, 24, 25]
    ids = run + [1, 2, 30, 31, 32, 33, 34, 35, 36, 37, 1, 2, 40, 41] + run + [1, 2]
    d = Drafter(8)
    d.length = 8
    # "1 2" last occurred before 40 41, but the occurrence after the same run matches 8 ids
    assert d.propose(ids, 100) == [30, 31, 32, 33, 34, 35, 36]
    copied = list(range(100, 140))
    d = Drafter(32)
    d.length = 32
    # a match of all 16 ids compared drafts the whole length
    assert d.propose(copied + [0] + copied[:20], 100) == copied[20:40] + [0] + copied[:11]


def test_drafter_length_follows_how_the_last_draft_fared():
    base = list(range(1, 21))
    ids = base + base[:9]  # copying 1..20 again, 9 ids in: a match of 9 ids
    d = Drafter(8)
    d.length = 8
    assert d.propose(ids, 100) == [10, 11, 12, 13, 14, 15, 16, 17]
    d.propose(ids + [10, 11, 99], 100)  # two accepted, then another token: the next draft is 3 long
    assert d.length == 3
    d = Drafter(8)
    d.length = 8
    assert d.propose(ids, 100) == [10, 11, 12, 13, 14, 15, 16, 17]
    d.propose(ids + [42], 100)  # its first id missed: the next draft is 1 long
    assert d.length == 1
    d = Drafter(8)
    d.length = 2
    assert d.propose(ids, 100) == [10, 11]
    assert d.propose(ids + [10, 11, 12], 100) == [13, 14, 15, 16] and d.length == 4  # all accepted: twice as long


class OffTheCpu:
    """The bundled model, claiming to run on a device where speculation is not established."""

    device = SimpleNamespace(is_cpu=False)

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def test_no_speculation_off_the_cpu(model):
    cfg = GenerationConfig(max_new_tokens=24)
    r = generate(OffTheCpu(model), COPYING, cfg.replace(speculative_tokens=4))
    assert r.timings.drafted_tokens == 0
    assert r.token_ids == generate(model, COPYING, cfg).token_ids


def found_ids(d: Drafter, k: int) -> list[int]:
    """Up to ``k`` ids after the occurrence the drafter's index finds for the ids it holds."""
    found = d._find()
    return [] if found is None else d._ids[found[0] + d.min_ngram:found[0] + d.min_ngram + k]


def test_drafter_index_gives_what_a_scan_gives():
    """The drafter's n-gram index (extended as the ids grow) against ``draft_tokens`` (a scan
    of every id), at a fixed draft length, on growing sequences with many repeats, and on a
    sequence that is not an extension (the index rebuilt)."""
    import random

    from llaisys.generation.speculative import draft_tokens

    rng = random.Random(3)
    for k in (1, 3, 5):
        d = Drafter(k)
        d.length = k
        ids: list[int] = []
        for _ in range(300):
            ids.append(rng.choice([1, 2, 3, 4, 5, 6, 7, 8]) if rng.random() < 0.7 else rng.randrange(50))
            d._catch_up(ids)
            assert found_ids(d, k) == draft_tokens(ids, k, min_ngram=2), (k, len(ids))
        other = [9, 9, 1, 2, 9, 9]
        d._catch_up(other)
        assert found_ids(d, k) == draft_tokens(other, k, min_ngram=2)
