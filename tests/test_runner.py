"""The one runner: a single sequence (``forward`` over a ``KVCache``) runs the very pass a
serving batch runs, so its logits are bit for bit those of the same sequence inside a batch
of others, and its decoding step replays as one native stretch like a serving step."""
from __future__ import annotations

import numpy as np
import pytest

from llaisys.models.kv_cache import KVCache
from llaisys.models.paged_cache import PagedKVCache, TokenBatch
from llaisys.models.runner import BatchPass, sequence_batch


def test_a_kv_cache_is_a_one_block_paged_cache(smollm2_model):
    cache = smollm2_model.new_cache(40)
    assert isinstance(cache, PagedKVCache)
    assert (cache.num_blocks, cache.block_size, cache.max_blocks) == (1, 40, 1)
    k_new, v_new, k_seen, v_seen = cache.rows(2, 5, 7)
    assert k_new.shape[0] == 2 and k_seen.shape[0] == 7
    assert k_new.storage is cache.k.storage


def test_sequence_batch_maps_positions_to_slots():
    batch = sequence_batch(np.array([4, 5, 6], np.int64), 10, "last")
    assert batch.positions.tolist() == batch.slots.tolist() == [10, 11, 12]
    assert batch.block_tables.tolist() == [[0]] and batch.query_starts.tolist() == [0, 3]
    assert batch.context_lens.tolist() == [13] and batch.logit_rows.tolist() == [2]
    assert sequence_batch(np.array([1], np.int64), 0, "none").logit_rows.size == 0
    assert sequence_batch(np.array([1, 2], np.int64), 0, "all").logit_rows.tolist() == [0, 1]


def test_single_sequence_logits_equal_the_same_sequence_in_a_batch(smollm2_model):
    """Batch invariance across the two entry points: prefill then decode of one prompt alone
    (``forward``) and inside a paged batch of three sequences (``forward_batch``), bitwise."""
    model = smollm2_model
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(0, 2000, n))) for n in (9, 4, 13)]
    alone = model.new_cache(32)
    want = [model.forward(prompts[0], alone)]
    steps = [int(t) for t in rng.integers(0, 2000, 3)]
    want += [model.forward([t], alone) for t in steps]

    bs = 8
    cache = model.new_paged_cache(num_blocks=12, block_size=bs)
    tables = [[3, 7], [0, 1], [5, 2, 9]]
    first = TokenBatch.build([(p, 0, t, True) for p, t in zip(prompts, tables)], bs, cache.max_blocks)
    got = [model.forward_batch(first, cache)[0]]
    for i, t in enumerate(steps):
        chunks = [([t], len(prompts[0]) + i, tables[0], True)] + [
            ([int(rng.integers(0, 2000))], len(p) + i, tb, True) for p, tb in zip(prompts[1:], tables[1:])]
        got.append(model.forward_batch(TokenBatch.build(chunks, bs, cache.max_blocks), cache)[0])
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)


def test_single_sequence_decoding_step_is_one_native_stretch(smollm2_model):
    """The decoding step of ``forward`` is the recorded paged pass, and on the CPU it replays
    in one native stretch after the (quantized) token embedding."""
    from llaisys.kernels.cpu import native_calls

    if not native_calls.available():
        pytest.fail("the native ops library is not built; the test suite runs against a built package")
    model = smollm2_model
    cache = model.new_cache(16)
    model.forward([1, 2, 3], cache)
    model.forward([4], cache)
    step = model.runner.decoding_pass(cache)
    assert isinstance(step, BatchPass)
    stats = step.plan.stats()
    assert stats.stretches == 1 and stats.python <= 1, stats  # the quantized embedding's NumPy kernel at most


def test_cache_length_counts_chunks_and_refuses_overflow(smollm2_model):
    model = smollm2_model
    cache = model.new_cache(300)
    logits = model.forward(list(range(1, 271)), cache)  # two chunks: 256 + 14
    assert cache.length == 270 and logits.shape == (model.config.vocab_size,)
    with pytest.raises(ValueError, match="KV cache overflow"):
        model.forward(list(range(40)), cache)
    assert cache.length == 270
    assert isinstance(cache, KVCache)
