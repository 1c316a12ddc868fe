"""The block manager and the scheduler, with no model: budgets, chunking, preemption order,
abort, prefix hashing and reference counts."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from llaisys.engine import KVBlockManager, Scheduler, Sequence, Status, block_hash


def run_step(sched: Scheduler, next_token: int = 7):
    """Schedule, commit, and append a token to every sequence that reached its end."""
    step = sched.schedule()
    sched.commit(step)
    for c in step.chunks:
        if c.samples:
            c.seq.output_ids.append(next_token)
    return step


# ---- hashing ---------------------------------------------------------------------------
def test_block_hash_is_chained_blake2b_over_int64_ids():
    first = block_hash(None, [1, 2, 3, 4])
    assert first == hashlib.blake2b(np.array([1, 2, 3, 4], np.int64).tobytes(), digest_size=16).digest()
    second = block_hash(first, [5, 6, 7, 8])
    expect = hashlib.blake2b(first, digest_size=16)
    expect.update(np.array([5, 6, 7, 8], np.int64).tobytes())
    assert second == expect.digest()
    # the same block after another prefix is another hash: a hash names the whole prefix
    assert block_hash(block_hash(None, [9, 9, 9, 9]), [5, 6, 7, 8]) != second


# ---- block manager ---------------------------------------------------------------------
def test_grow_takes_blocks_and_refuses_without_change_when_short():
    m = KVBlockManager(num_blocks=4, block_size=4)
    assert m.grow("a", 5)  # 2 blocks
    assert len(m.block_table("a")) == 2 and m.pool.num_free == 2
    assert not m.grow("b", 13)  # 4 blocks > 2 free
    assert m.block_table("b") == [] and m.pool.num_free == 2
    assert m.grow("a", 8)  # still 2 blocks
    assert len(m.block_table("a")) == 2
    m.free("a")
    assert m.pool.num_free == 4 and m.held_references() == 0


def test_prefix_blocks_are_shared_and_reference_counted():
    m = KVBlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert m.match_prefix("a", prompt) == 0
    assert m.grow("a", 10)
    m.commit("a", prompt, 10)
    hit = m.match_prefix("b", prompt + [99])
    assert hit == 8
    assert m.block_table("b") == m.block_table("a")[:2]
    shared = m.block_table("a")[0]
    assert m.pool.ref_count[shared] == 2
    m.free("a")
    assert m.pool.ref_count[shared] == 1
    m.free("b")
    assert m.held_references() == 0
    # released but remembered: a third sequence still finds them
    assert m.match_prefix("c", prompt) == 8


def test_match_leaves_the_last_token_to_compute():
    m = KVBlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly 2 blocks
    m.grow("a", 8)
    m.commit("a", prompt, 8)
    assert m.match_prefix("b", prompt) == 4  # the second block would leave nothing to run


def test_different_prefix_does_not_hit_a_block_with_equal_tokens():
    m = KVBlockManager(num_blocks=8, block_size=2)
    a = [1, 2, 3, 4]
    m.grow("a", 4)
    m.commit("a", a, 4)
    assert m.match_prefix("b", [9, 9, 3, 4, 5]) == 0  # block [3, 4] follows another prefix


def test_eviction_takes_the_least_recently_released_block_first():
    m = KVBlockManager(num_blocks=2, block_size=2)
    m.grow("a", 2)
    m.commit("a", [1, 2], 2)
    m.free("a")
    m.grow("b", 2)  # takes the never-used block first
    m.commit("b", [3, 4], 2)
    m.free("b")
    assert m.match_prefix("probe", [1, 2, 0]) == 2
    m.free("probe")  # [1, 2] is now released more recently than [3, 4]
    m.grow("c", 2)  # evicts [3, 4]
    assert m.match_prefix("d", [3, 4, 0]) == 0
    assert m.match_prefix("e", [1, 2, 0]) == 2


def test_prefix_caching_off_never_hits():
    m = KVBlockManager(num_blocks=8, block_size=2, prefix_caching=False)
    m.grow("a", 4)
    m.commit("a", [1, 2, 3, 4], 4)
    assert m.match_prefix("b", [1, 2, 3, 4, 5]) == 0


# ---- scheduler -------------------------------------------------------------------------
def test_decodes_first_then_admissions_under_the_token_budget():
    m = KVBlockManager(num_blocks=64, block_size=4)
    s = Scheduler(m, max_batched_tokens=10)
    a, b = Sequence("a", [1] * 6, 4), Sequence("b", [2] * 6, 4)
    s.add(a)
    s.add(b)
    step = run_step(s)
    # a's 6 tokens, then b's first 4 (budget 10): b is chunked
    assert [(c.seq.seq_id, c.start, c.length) for c in step.chunks] == [("a", 0, 6), ("b", 0, 4)]
    assert step.chunks[0].samples and not step.chunks[1].samples
    step = run_step(s)
    assert [(c.seq.seq_id, c.start, c.length) for c in step.chunks] == [("a", 6, 1), ("b", 4, 2)]
    c = Sequence("c", [3] * 20, 4)
    s.add(c)
    step = run_step(s)
    assert [(ch.seq.seq_id, ch.length) for ch in step.chunks] == [("a", 1), ("b", 1), ("c", 8)]


def test_max_seqs_limits_admission():
    m = KVBlockManager(num_blocks=64, block_size=4)
    s = Scheduler(m, max_batched_tokens=100, max_seqs=2)
    for i in range(3):
        s.add(Sequence(i, [i] * 3, 4))
    step = run_step(s)
    assert [c.seq.seq_id for c in step.chunks] == [0, 1]
    assert s.counts() == (2, 1)


def test_request_that_alone_cannot_fit_is_refused_at_admission():
    m = KVBlockManager(num_blocks=4, block_size=4)  # 16 tokens
    s = Scheduler(m)
    with pytest.raises(ValueError, match=r"needs up to 20 tokens .* \(16 tokens\)"):
        s.add(Sequence("big", [1] * 10, 11))
    s.add(Sequence("ok", [1] * 10, 7))  # 16 tokens exactly


def test_preemption_takes_the_most_recent_and_recomputes_it_later():
    m = KVBlockManager(num_blocks=4, block_size=2, prefix_caching=False)  # 8 tokens
    s = Scheduler(m, max_batched_tokens=100)
    a, b = Sequence("a", [1, 1, 1], 4), Sequence("b", [2, 2, 2], 4)
    s.add(a)
    s.add(b)
    run_step(s)  # a: 3 tokens (2 blocks), b: 3 tokens (2 blocks); pool full
    assert m.pool.num_free == 0
    step = run_step(s)  # a needs a 3rd block at 5 tokens? a has 4 tokens now -> fits; b likewise
    assert [c.seq.seq_id for c in step.chunks] == ["a", "b"]
    step = run_step(s)  # both need a third block: b (most recent) gives way
    assert [c.seq.seq_id for c in step.chunks] == ["a"]
    assert step.preempted == [b] and b.status is Status.WAITING and b.num_computed == 0
    assert s.waiting[0] is b and b.output_ids == [7, 7]  # generated tokens are kept for recomputation
    s.finish(a)
    step = run_step(s)
    # b comes back: prompt and generated tokens run again, then it samples
    assert [(c.seq.seq_id, c.start, c.length) for c in step.chunks] == [("b", 0, 5)]
    assert step.chunks[0].samples


def test_a_sequence_that_cannot_grow_alone_preempts_itself():
    m = KVBlockManager(num_blocks=2, block_size=2, prefix_caching=False)
    s = Scheduler(m)
    a = Sequence("a", [1, 1, 1], 2)
    s.add(a)
    run_step(s)
    b = Sequence("b", [2], 2)
    # b would wait: a holds both blocks
    s.add(b)
    step = run_step(s)
    assert [c.seq.seq_id for c in step.chunks] == ["a"]
    assert s.counts() == (1, 1)


def test_finish_frees_blocks_at_once_and_counts_return_to_zero():
    m = KVBlockManager(num_blocks=16, block_size=4)
    s = Scheduler(m, max_batched_tokens=64)
    seqs = [Sequence(i, [5] * 9, 8) for i in range(3)]
    for q in seqs:
        s.add(q)
    run_step(s)
    assert m.held_references() > 0
    s.finish(seqs[1])  # abort while running
    assert seqs[1].status is Status.FINISHED and m.block_table(1) == []
    waiting = Sequence("w", [5] * 4, 2)
    s.add(waiting)
    s.finish(waiting)  # abort while waiting
    for q in (seqs[0], seqs[2]):
        s.finish(q)
    assert m.held_references() == 0 and not s.has_work


def test_shared_prefix_is_found_at_admission_and_counted():
    m = KVBlockManager(num_blocks=32, block_size=4)
    s = Scheduler(m, max_batched_tokens=64)
    system = list(range(100, 112))  # 3 blocks
    a = Sequence("a", system + [1, 2], 4)
    s.add(a)
    run_step(s)
    b = Sequence("b", system + [3, 4, 5], 4)
    s.add(b)
    step = run_step(s)
    chunk_b = next(c for c in step.chunks if c.seq is b)
    assert b.num_cached == 12 and chunk_b.start == 12 and chunk_b.length == 3
    assert m.prefix_hits == 12 and m.prefix_queries == len(a.prompt_ids) + len(b.prompt_ids)


def test_waiting_head_holds_no_blocks_while_it_cannot_start():
    m = KVBlockManager(num_blocks=4, block_size=2)
    s = Scheduler(m, max_batched_tokens=100)
    a = Sequence("a", [1, 2, 3, 4, 5], 3)  # 3 blocks
    s.add(a)
    run_step(s)
    b = Sequence("b", [1, 2, 3, 4, 9, 9, 9, 9], 1)  # shares 2 blocks with a, needs 2 more; 1 is free
    s.add(b)
    run_step(s)
    assert b.status is Status.WAITING and m.block_table("b") == []


def test_requests_arriving_together_compute_a_shared_prefix_once():
    m = KVBlockManager(num_blocks=64, block_size=4)
    s = Scheduler(m, max_batched_tokens=64)
    system = list(range(100, 112))  # 3 full blocks
    seqs = [Sequence(i, system + [i, i + 1, i + 2], 4) for i in range(4)]
    for q in seqs:
        s.add(q)
    step = run_step(s)
    assert [c.seq.seq_id for c in step.chunks] == [0]  # the others wait for its blocks
    step = run_step(s)
    later = [c for c in step.chunks if c.seq.seq_id != 0]
    assert [(c.start, c.length) for c in later] == [(12, 3)] * 3  # the prefix is shared, not recomputed
    assert m.prefix_hits == 3 * 12


def test_blocks_behind_a_window_go_back_and_are_not_freed_twice():
    from llaisys.engine.blocks import KVBlockManager

    blocks = KVBlockManager(10, 2, prefix_caching=True, window=5)
    tokens = list(range(20))
    assert blocks.grow("a", 14) and blocks.num_blocks - blocks.pool.num_free == 7
    blocks.commit("a", tokens, 14)
    blocks.release_behind("a", 14)  # a token at 14 or later sees keys 10.. : blocks 0..4 go back
    assert blocks.held_blocks("a") == 2 and blocks.pool.num_free == 8
    assert len(blocks.block_table("a")) == 7  # the ids stay in the table; the kernels never read them
    blocks.release_behind("a", 14)  # nothing more
    assert blocks.pool.num_free == 8
    blocks.free("a")
    assert blocks.held_references() == 0 and blocks.pool.num_free == 10
    assert blocks.match_prefix("b", tokens[:15]) == 14  # handed-back full blocks keep their prefix
    plain = KVBlockManager(10, 2)
    plain.grow("a", 14)
    plain.release_behind("a", 14)
    assert plain.held_blocks("a") == 7  # no window: nothing goes back
