"""The prefix cache's tiers beyond the pool (engine/prefix_tiers.py): block copies in and out of
the paged cache, exact keys, the disk tier across a restart (damaged and foreign files never
loaded), the host tier under eviction pressure, budgets. Every engine output is compared with a
cold engine without tiers, token for token."""
from __future__ import annotations

import inspect
import logging
import os
import shutil
import types

import numpy as np
import pytest

from conftest import dtype_params
from llaisys import DataType, Tensor
from llaisys.engine import EngineThread, LLMEngine
from llaisys.engine.blocks import block_hash
from llaisys.engine.prefix_tiers import (SUFFIX, CacheLayout, DiskTier, HostTier, PrefixTiers, model_identity,
                                         open_tiers, tier_key)
from llaisys.generation import GenerationConfig
from llaisys.models.multimodal.tower import PromptImages
from llaisys.models.paged_cache import PagedKVCache
from llaisys.runtime.device import as_device

GREEDY = GenerationConfig(max_new_tokens=6)


class ScaledCache(PagedKVCache):
    """A cache with a third store, F32 scales (L, NB, BS, KH), as an int8 layout keeps: the
    tiers must copy whatever ``stores()`` returns."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        layers, kh, _, _, device = self.spec
        self.scales = Tensor.empty((layers, self.num_blocks, self.block_size, kh), DataType.F32, device)

    def stores(self):
        return [self.k, self.v, self.scales]


def _random_cache(cls, dtype: DataType, device: str, seed: int = 0, num_blocks: int = 10) -> PagedKVCache:
    cache = cls(3, num_blocks, 4, 2, 8, dtype, as_device(device), num_blocks)
    rng = np.random.default_rng(seed)
    for t in cache.stores():
        t.load(rng.standard_normal(t.shape).astype(t.dtype.numpy))
    return cache


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


# ---- read_blocks / write_blocks ----------------------------------------------------------
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("where", ["cpu", "fakedev:0"])
def test_read_and_write_blocks_copy_every_store_exactly(dtype, where, request):
    if where != "cpu":
        request.getfixturevalue("fake_device")  # a device whose memory only its copies reach
    cache = _random_cache(ScaledCache, dtype, where)
    whole = [t.numpy() for t in cache.stores()]  # (L, NB, ...) each
    got = cache.read_blocks([5, 2, 3])
    assert [a.shape for a in got] == [(w.shape[0], 3, *w.shape[2:]) for w in whole]
    for a, w in zip(got, whole):
        assert a.dtype == w.dtype and np.array_equal(_bits(a), _bits(w[:, [5, 2, 3]]))
    cache.write_blocks([0, 9, 1], got)
    after = [t.numpy() for t in cache.stores()]
    for a, w, g in zip(after, whole, got):
        assert np.array_equal(_bits(a[:, [0, 9, 1]]), _bits(g))
        untouched = [b for b in range(10) if b not in (0, 9, 1)]
        assert np.array_equal(_bits(a[:, untouched]), _bits(w[:, untouched]))


def test_write_blocks_refuses_what_does_not_fit_the_stores():
    cache = _random_cache(PagedKVCache, DataType.F32, "cpu")
    good = cache.read_blocks([1, 2])
    half = [a.astype(np.float16) for a in good]
    for blocks, arrays, what in [([1, 2], good[:1], "2 stores"), ([1, 2], half, "F32"), ([1], good, "F32 \\(3, 1"),
                                 ([1, 1], good, "repeat"), ([1, 10], good, "in \\[0, 10\\)")]:
        with pytest.raises(ValueError, match=what):
            cache.write_blocks(blocks, arrays)


# ---- keys --------------------------------------------------------------------------------
def test_keys_differ_for_another_model_layout_prefix_or_image(tmp_path):
    f32 = CacheLayout.of(_random_cache(PagedKVCache, DataType.F32, "cpu"))
    bf16 = CacheLayout.of(_random_cache(PagedKVCache, DataType.BF16, "cpu"))
    scaled = CacheLayout.of(_random_cache(ScaledCache, DataType.F32, "cpu"))
    h = block_hash(None, range(4))
    key = tier_key(b"model-a", f32, h)
    assert key == tier_key(b"model-a", f32, block_hash(None, range(4)))
    others = [tier_key(b"model-b", f32, h), tier_key(b"model-a", bf16, h), tier_key(b"model-a", scaled, h),
              tier_key(b"model-a", f32, block_hash(None, [0, 1, 2, 5])),
              tier_key(b"model-a", f32, block_hash(block_hash(None, range(4)), range(4)))]
    assert len({key, *others}) == 6
    # an image stands for its digest in the ids a block is hashed by
    ids = list(range(8))
    rows = np.zeros((2, 4), np.float32)
    one, two = (PromptImages(np.array([2, 3]), rows, (d,), np.array([0, 0])).key_ids(ids) for d in ("aa", "bb"))
    assert tier_key(b"m", f32, block_hash(None, one[:4])) != tier_key(b"m", f32, block_hash(None, two[:4]))
    # the model's identity: its file (size, mtime, contents at the ends) and how it computes
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x" * 3_000_000)
    model = types.SimpleNamespace(source=str(path), info=lambda: {"dtype": "f32"}, device=as_device("cpu"))
    first = model_identity(model)
    assert first == model_identity(model) and len(first) == 32
    assert model_identity(types.SimpleNamespace(**{**vars(model), "info": lambda: {"dtype": "bf16"}})) != first
    with open(path, "r+b") as f:
        f.seek(2_999_000)
        f.write(b"y")
    os.utime(path, ns=(1, 1))
    assert model_identity(model) != first
    assert model_identity(types.SimpleNamespace(source=None)) is None  # built in memory: no disk tier


# ---- the disk and host tiers alone -------------------------------------------------------
def _block(cache: PagedKVCache, b: int) -> list[np.ndarray]:
    return cache.read_blocks([b])


def test_disk_tier_round_trip_budget_and_foreign_files(tmp_path, caplog):
    cache = _random_cache(ScaledCache, DataType.BF16, "cpu")
    layout = CacheLayout.of(cache)
    hashes = [block_hash(None, [i]) for i in range(5)]
    disk = DiskTier(tmp_path, 10 << 20, b"model-a", layout)
    for b, h in enumerate(hashes):
        assert disk.put(tier_key(b"model-a", layout, h), h, _block(cache, b))
    assert disk.close(10.0)
    again = DiskTier(tmp_path, 10 << 20, b"model-a", layout)  # a restart: the index from the files
    for b, h in enumerate(hashes):
        got = again.get(tier_key(b"model-a", layout, h), h)
        assert all(np.array_equal(_bits(g), _bits(w)) for g, w in zip(got, _block(cache, b)))
    size = max(f.stat().st_size for f in tmp_path.glob(f"*{SUFFIX}"))
    # a budget of three files keeps the three most recently used
    small = DiskTier(tmp_path, 3 * size, b"model-a", layout)
    assert small.nbytes <= 3 * size and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 3
    small.close()
    # another model's or layout's files are left alone, and never found
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llaisys.engine.prefix_tiers"):
        other = DiskTier(tmp_path, 10 << 20, b"model-b", layout)
        assert other.nbytes == 0 and other.get(tier_key(b"model-b", layout, hashes[4]), hashes[4]) is None
    assert len(caplog.records) == 3 and all("another model" in r.getMessage() for r in caplog.records)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 3


def test_disk_writes_never_wait_and_host_tier_keeps_its_budget(tmp_path):
    cache = _random_cache(PagedKVCache, DataType.F32, "cpu")
    layout = CacheLayout.of(cache)
    block = _block(cache, 0)
    size = sum(a.nbytes for a in block)
    disk = DiskTier(tmp_path, 10 << 20, b"m", layout, max_queued=size)  # room for one block in the queue
    taken = [disk.put(bytes([i]) * 32, b"h" * 16, block) for i in range(50)]
    assert taken[0] and not all(taken) and disk.files.dropped == taken.count(False)
    disk.close()
    host = HostTier(3 * size)
    for i in range(5):
        host.put(bytes([i]), _block(cache, i))
        assert host.nbytes <= 3 * size
    assert len(host) == 3 and host.dropped == 2 and bytes([0]) not in host and host.get(bytes([4])) is not None


def test_a_model_without_a_file_gets_the_host_tier_only(tmp_path, caplog):
    cache = _random_cache(PagedKVCache, DataType.F32, "cpu")
    memory = types.SimpleNamespace(source=None, shard=None)
    with caplog.at_level(logging.WARNING, logger="llaisys.engine.prefix_tiers"):
        assert open_tiers(memory, cache, True, 0, tmp_path) is None
        tiers = open_tiers(memory, cache, True, 1 << 20, tmp_path)
    assert isinstance(tiers, PrefixTiers) and tiers.disk is None and tiers.host is not None
    assert "no source file" in caplog.text and not list(tmp_path.iterdir())
    assert open_tiers(memory, cache, False, 1 << 20, tmp_path) is None  # prefix caching off: no tiers
    with pytest.raises(ValueError, match="prefix_cache_host_bytes"):
        open_tiers(memory, cache, True, -1)


# ---- engines over the bundled model ------------------------------------------------------
@pytest.fixture(scope="module")
def prompt(smollm2_model) -> list[int]:
    ids = smollm2_model.tokenizer.encode("You are a careful assistant. Tools: search(query), read(url), "
                                         "write(path, text). Answer briefly and cite sources. " * 8)
    assert len(ids) >= 150
    return ids[:150]  # 9 full blocks of 16 and 6 tokens


@pytest.fixture(scope="module")
def cold(smollm2_model, prompt):
    """The prompt's greedy output on an engine without tiers."""
    return LLMEngine(smollm2_model, kv_cache_tokens=512).generate([prompt], GREEDY)[0].token_ids


def _keys(engine: LLMEngine, ids: list[int], n: int) -> list[bytes]:
    hashes, parent = [], None
    for i in range(n):
        parent = block_hash(parent, ids[i * 16:(i + 1) * 16])
        hashes.append(parent)
    return [engine.tiers.key(h) for h in hashes]


def test_a_restarted_engine_takes_the_prompt_from_disk_and_answers_as_cold(smollm2_model, prompt, cold, tmp_path):
    first = EngineThread(LLMEngine(smollm2_model, kv_cache_tokens=512, prefix_cache_dir=tmp_path))
    assert [t for out in first.submit(prompt, GREEDY) for t in out.token_ids] == cold
    first.stop()  # its shutdown writes the queued blocks
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) >= 9
    second = LLMEngine(smollm2_model, kv_cache_tokens=512, prefix_cache_dir=tmp_path)
    assert second.generate([prompt], GREEDY)[0].token_ids == cold
    stats = second.stats()
    assert stats.prefix_restored_disk == 144 == stats.prefix_hits and stats.prefix_restored_host == 0
    assert stats.prompt_tokens == len(prompt) - 144
    second.close()


def test_the_8_bit_layout_goes_through_disk_and_another_layout_misses(smollm2_model, prompt, tmp_path, caplog):
    if "kv_cache_dtype" not in inspect.signature(LLMEngine).parameters:
        pytest.skip("this engine has no 8-bit KV cache")
    int8 = dict(kv_cache_tokens=512, kv_cache_dtype="int8")
    cold8 = LLMEngine(smollm2_model, **int8).generate([prompt], GREEDY)[0].token_ids
    first = LLMEngine(smollm2_model, prefix_cache_dir=tmp_path, **int8)
    first.generate([prompt], GREEDY)
    first.close()
    assert len(first.tiers.layout.stores) == 4  # codes and scales of k and v: all copied
    with caplog.at_level(logging.WARNING, logger="llaisys.engine.prefix_tiers"):
        f32 = LLMEngine(smollm2_model, kv_cache_tokens=512, prefix_cache_dir=tmp_path)
    assert f32.tiers.disk.nbytes == 0 and "another cache layout" in caplog.text
    f32.close()
    again = LLMEngine(smollm2_model, prefix_cache_dir=tmp_path, **int8)
    assert again.generate([prompt], GREEDY)[0].token_ids == cold8
    assert again.stats().prefix_restored_disk == 9 * 16
    again.close()


def test_damaged_renamed_and_foreign_files_are_never_loaded(smollm2_model, prompt, cold, tmp_path, caplog):
    engine = LLMEngine(smollm2_model, kv_cache_tokens=512, prefix_cache_dir=tmp_path)
    engine.generate([prompt], GREEDY)
    engine.close()
    keys = [tmp_path / f"{k.hex()}{SUFFIX}" for k in _keys(engine, prompt, 9)]
    damaged, renamed = keys[3], keys[5]
    raw = bytearray(damaged.read_bytes())
    raw[-100] ^= 0xFF  # a payload byte: only the checksum can tell
    damaged.write_bytes(bytes(raw))
    shutil.copyfile(keys[7], renamed)  # another block's contents under this block's name
    keys[8].write_bytes(keys[8].read_bytes()[:5000])  # truncated
    foreign = DiskTier(tmp_path, 1 << 30, b"another model", engine.tiers.layout)
    foreign.put(tier_key(b"another model", engine.tiers.layout, b"h" * 16), b"h" * 16, engine.cache.read_blocks([0]))
    foreign.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llaisys.engine.prefix_tiers"):
        again = LLMEngine(smollm2_model, kv_cache_tokens=512, prefix_cache_dir=tmp_path)
        assert again.generate([prompt], GREEDY)[0].token_ids == cold
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    for path, why in ((damaged, "checksum"), (renamed, "name"), (keys[8], "truncated"), (None, "another model")):
        assert sum(why in line and (path is None or str(path) in line) for line in lines) == 1, (why, lines)
    assert again.stats().prefix_restored_disk == 3 * 16  # blocks 0-2, then the damaged one ends the match
    again.close()  # the blocks it computed again were written again, whole
    third = LLMEngine(smollm2_model, kv_cache_tokens=512, prefix_cache_dir=tmp_path)
    assert third.generate([prompt], GREEDY)[0].token_ids == cold
    assert third.stats().prefix_restored_disk == 9 * 16


def test_another_image_misses_from_its_first_block(smollm2_model, tmp_path):
    ids = list(range(1000, 1100))
    d = smollm2_model.config.hidden_size
    rng = np.random.default_rng(0)

    def images(digest: str) -> PromptImages:
        return PromptImages(np.arange(40, 44), rng.standard_normal((4, d)).astype(np.float32), (digest,),
                            np.zeros(4, np.int64))

    def run(engine: LLMEngine, placed: PromptImages) -> list[int]:
        rid = engine.add_request(None, ids, GenerationConfig(max_new_tokens=2), placed)
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
        return out

    first = LLMEngine(smollm2_model, kv_cache_tokens=256, prefix_cache_dir=tmp_path)
    run(first, images("picture-a"))
    first.close()
    other = LLMEngine(smollm2_model, kv_cache_tokens=256, prefix_cache_dir=tmp_path)
    run(other, images("picture-b"))
    assert other.stats().prefix_restored_disk == 32  # the two blocks before the image (tokens 0-31)
    other.close()


def test_sixteen_conversations_through_a_small_pool_restore_from_host(smollm2_model):
    tok = smollm2_model.tokenizer
    system = tok.encode("You are a terse assistant for a hardware shop. Answer in one short sentence. " * 3)[:64]
    turn1 = [system + tok.encode(f" Customer {i} asks: do you sell {i} screws?") for i in range(16)]
    config = GenerationConfig(max_new_tokens=5)
    cold = LLMEngine(smollm2_model, kv_cache_tokens=256, block_size=8, prefix_caching=False)
    budget = 20 * 8 * smollm2_model.runner.kv_bytes_per_token()  # 20 blocks: fewer than the turns leave behind
    engine = LLMEngine(smollm2_model, kv_cache_tokens=256, block_size=8, prefix_cache_host_bytes=budget)
    first = engine.generate(turn1, config)
    turn2 = [p + r.token_ids + tok.encode(f" And {i} nuts?") for i, (p, r) in enumerate(zip(turn1, first))]
    second = engine.generate(turn2, config)
    for p, r in zip(turn1 + turn2, first + second):
        assert r.token_ids == cold.generate([p], config)[0].token_ids
    stats = engine.stats()
    host = engine.tiers.host
    assert stats.prefix_restored_host > 0 and stats.prefix_restored_disk == 0
    assert stats.prefix_hits >= stats.prefix_restored_host
    assert host.nbytes <= budget and host.dropped > 0
    assert engine.blocks.held_references() == 0
