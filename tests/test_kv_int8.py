"""The KV cache in 8 bits (``LLMEngine(kv_cache_dtype="int8")``): quantization against torch
(codes and scales equal), attention over the int8 pool against torch's scaled_dot_product_attention
on the dequantized keys and values (windows, key_ends, GQA, several sequences), the native kernel's
bits across SIMD levels, thread counts and batches, the Triton kernels through the interpreter, and
the engine on the bundled model: batch invariance, speculative decoding unchanged, argument errors."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llaisys import DataType, Tensor, ops
from llaisys.engine import LLMEngine
from llaisys.generation import GenerationConfig
from llaisys.kernels.cpu import paged, paged_native
from llaisys.models.paged_cache import PagedKVCache

from conftest import dtype_params
from test_speculative import COPYING, OTHER

NOT_BUILT = "llaisys._native._kernels was not built: pip install -e . needs a C compiler"


@pytest.fixture
def rng():
    return np.random.default_rng(808)


@pytest.fixture
def pool_threads():
    """Sets the native pool's thread count (``pool_threads(n)``); the old count comes back after."""
    from llaisys.kernels.quant import native as quant

    before = quant.threads()
    yield quant.set_threads
    quant.set_threads(before)


def _i64(a) -> Tensor:
    return Tensor.from_numpy(np.asarray(a, np.int64))


def torch_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: rows x (..., D) -> int8 codes, float32 scales (amax / 127; round half to even)."""
    x = x.float()
    scale = x.abs().amax(-1) / 127
    codes = torch.round(x / torch.where(scale == 0, 1.0, scale)[..., None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


class Pool:
    """An 8-bit pool (NB blocks of BS slots) holding B sequences written through kv_cache_write_q8,
    and a flat batch of queries over them: specs are (context_len, q_len) per sequence."""

    def __init__(self, rng, specs, bs, h, kh, d, dv=None, dtype=DataType.F32, device="cpu"):
        dv = d if dv is None else dv
        need = [math.ceil(c / bs) for c, _ in specs]
        nb = sum(need) + 2
        self.mb = max(need + [1]) + 1
        order = rng.permutation(nb)
        tables, at = np.full((len(specs), self.mb), -1, np.int64), 0
        for b, k in enumerate(need):
            tables[b, :k] = order[at:at + k]
            at += k
        starts = np.concatenate([[0], np.cumsum([s for _, s in specs])]).astype(np.int64)
        self.n, self.h, self.d, self.dv, self.scale = int(starts[-1]), h, d, dv, 1 / math.sqrt(d)
        self.specs, self.bs, self.dtype, self.device = specs, bs, dtype, device
        def on(a, dt=None) -> Tensor:  # the values in type dt on the device
            return Tensor.from_numpy(Tensor.from_numpy(np.asarray(a), dtype=dt).numpy(), device=device)

        self.k_cache = on(np.zeros((nb, bs, kh, d), np.int8))
        self.v_cache = on(np.zeros((nb, bs, kh, dv), np.int8))
        self.k_scale = on(np.zeros((nb, bs, kh), np.float32))
        self.v_scale = on(np.zeros((nb, bs, kh), np.float32))
        slots = np.concatenate([tables[b, np.arange(c) // bs] * bs + np.arange(c) % bs
                                for b, (c, _) in enumerate(specs)])
        # keys and values of varied sizes per head, a few rows of zeros among them
        t = len(slots)
        k = rng.standard_normal((t, kh, d)) * rng.uniform(0.05, 8, (t, kh, 1))
        v = rng.standard_normal((t, kh, dv)) * rng.uniform(0.05, 8, (t, kh, 1))
        k[::17, 0], v[::13, -1] = 0, 0
        ops.kv_cache_write(self.k_cache, self.v_cache, on(k, dtype), on(v, dtype), on(slots.astype(np.int64)),
                           k_scale=self.k_scale, v_scale=self.v_scale)
        self.q = on(rng.standard_normal((self.n, h, d)), dtype)  # (N, H, D)
        self.block_tables, self.query_starts = on(tables), on(starts)
        self.context_lens = on(np.array([c for c, _ in specs], np.int64))
        self.key_ends = None

    @property
    def inputs(self) -> tuple:
        base = (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_starts, self.context_lens)
        return base + ((self.key_ends,) if self.key_ends is not None else ()) + (self.k_scale, self.v_scale)

    def run(self, kernel: str = "op", window: int = 0) -> Tensor:
        out = Tensor.empty((self.n, self.h, self.dv), self.dtype, self.device)
        attrs = {"scale": self.scale, **({"window": window} if window else {})}
        if kernel == "native":
            assert paged_native.available(), NOT_BUILT
            paged_native.native_paged_attention((out,), self.inputs, attrs, q8=True)
        elif kernel == "numpy":
            paged.paged_attention_q8((out,), self.inputs, attrs)
        else:
            ends = {"key_ends": self.key_ends} if self.key_ends is not None else {}
            ops.paged_attention(out, *self.inputs[:6], self.scale, window=window, k_scale=self.k_scale,
                                v_scale=self.v_scale, **ends)
        return out

    def sdpa(self, window: int = 0) -> np.ndarray:
        """torch's scaled_dot_product_attention in float64 over the dequantized keys and values,
        gathered slot by slot through each sequence's table, the mask built per row."""
        kc, vc = torch.from_numpy(self.k_cache.numpy()).double(), torch.from_numpy(self.v_cache.numpy()).double()
        ks, vs = torch.from_numpy(self.k_scale.numpy()).double(), torch.from_numpy(self.v_scale.numpy()).double()
        q = torch.from_numpy(self.q.numpy().astype(np.float64))
        bt, qs = self.block_tables.numpy(), self.query_starts.numpy()
        ends = self.key_ends.numpy() if self.key_ends is not None else None
        out = torch.zeros(self.n, self.h, self.dv, dtype=torch.float64)
        for b, (t, s) in enumerate(self.specs):
            if s == 0:
                continue
            q0, pos = int(qs[b]), torch.arange(t)
            blk, off = torch.from_numpy(bt[b])[pos // self.bs], pos % self.bs
            k = kc[blk, off] * ks[blk, off][..., None]  # (T, KH, D) dequantized
            v = vc[blk, off] * vs[blk, off][..., None]
            g = self.h // k.shape[1]
            at = torch.arange(s)[:, None] + (t - s)  # (S, 1) each query's position
            end = at + 1 if ends is None else torch.from_numpy(ends[q0:q0 + s])[:, None]
            seen = (pos[None, :] < end) & ((pos[None, :] > at - window) if window else True)  # (S, T)
            out[q0:q0 + s] = torch.nn.functional.scaled_dot_product_attention(
                q[q0:q0 + s].transpose(0, 1), k.repeat_interleave(g, 1).transpose(0, 1),
                v.repeat_interleave(g, 1).transpose(0, 1), attn_mask=seen, scale=self.scale).transpose(0, 1)
        return out.numpy()


# decoding rows, a fresh prefill, a chunk after cached keys, a first token, a sequence idle this step
MIXED = [(37, 1), (9, 9), (50, 7), (1, 1), (20, 0), (70, 1)]


# ---- quantization ----------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["op", "numpy"])
@pytest.mark.parametrize("dtype", dtype_params())
def test_codes_and_scales_equal_torch(kernel, dtype, rng):
    """Each head of each token: scale = amax / 127, codes round(x / scale) half to even; a row
    of zeros gets scale 0; ties (x / scale = 0.5, 1.5, 2.5) go to the even code."""
    nb, bs, kh, d = 6, 4, 3, 40
    n = 11
    k = rng.standard_normal((n, kh, d)) * rng.uniform(1e-3, 50, (n, kh, 1))
    v = rng.standard_normal((n, kh, d)) * 3
    k[2, 1], v[5, 0] = 0, 0
    k[7, 2, :5] = [127, 0.5, 1.5, 2.5, -0.5]  # amax 127: scale 1, so the codes are x rounded
    k[7, 2, 5:] = 0
    k_t, v_t = Tensor.from_numpy(k, dtype=dtype), Tensor.from_numpy(v, dtype=dtype)
    stores = [Tensor.zeros((nb, bs, kh, d), DataType.I8), Tensor.zeros((nb, bs, kh, d), DataType.I8),
              Tensor.zeros((nb, bs, kh)), Tensor.zeros((nb, bs, kh))]
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    if kernel == "op":
        ops.kv_cache_write(stores[0], stores[1], k_t, v_t, _i64(slots), k_scale=stores[2], v_scale=stores[3])
    else:
        paged.kv_cache_write_q8(tuple(stores), (k_t, v_t, _i64(slots)), {})
    blk, off = np.divmod(slots, bs)
    for x, codes, scales in ((k_t, stores[0], stores[2]), (v_t, stores[1], stores[3])):
        want_codes, want_scales = torch_quantize(torch.from_numpy(x.numpy().astype(np.float32)))
        assert np.array_equal(codes.numpy()[blk, off], want_codes.numpy())
        assert np.array_equal(scales.numpy()[blk, off], want_scales.numpy())
    assert stores[0].numpy()[blk[7], off[7], 2, :5].tolist() == [127, 0, 2, 2, 0]
    assert stores[2].numpy()[blk[2], off[2], 1] == 0 and not stores[0].numpy()[blk[2], off[2], 1].any()


def test_a_slot_never_changes_when_its_block_fills(rng):
    """Scales are per slot: writing later tokens (or a draft written over again) into a block
    leaves its earlier slots' codes and scales as they were."""
    kh, d = 2, 16
    stores = [Tensor.zeros((2, 8, kh, d), DataType.I8), Tensor.zeros((2, 8, kh, d), DataType.I8),
              Tensor.zeros((2, 8, kh)), Tensor.zeros((2, 8, kh))]

    def write(x: Tensor, slots: list[int]) -> None:
        ops.kv_cache_write(stores[0], stores[1], x, x, _i64(slots), k_scale=stores[2], v_scale=stores[3])

    write(Tensor.from_numpy(rng.standard_normal((3, kh, d)).astype(np.float32)), [8, 9, 10])
    before = [s.numpy()[1, :3].copy() for s in stores]
    for _ in range(2):  # a draft much larger than the prompt, then another in its place
        write(Tensor.from_numpy((rng.standard_normal((5, kh, d)) * 100).astype(np.float32)), [11, 12, 13, 14, 15])
    assert all(np.array_equal(s.numpy()[1, :3], b) for s, b in zip(stores, before))


# ---- attention against torch -------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["op", "native", "numpy"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("window", [0, 5])
def test_attention_matches_sdpa_on_the_dequantized_cache(kernel, heads, window, rng):
    h, kh = heads
    pool = Pool(rng, MIXED + [(300, 3)], 4, h, kh, 64)
    got = pool.run(kernel, window).numpy()
    np.testing.assert_allclose(got, pool.sdpa(window), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("kernel", ["op", "native", "numpy"])
@pytest.mark.parametrize("window", [0, 6])
def test_attention_with_key_ends(kernel, window, rng):
    """Rows that see past their own position (an image's tokens), with and without a window."""
    pool = Pool(rng, [(30, 8), (12, 1), (9, 9)], 4, 6, 2, 32, dv=24)
    ends = np.array([26, 26, 26, 26, 30, 30, 29, 30, 12] + [5, 5, 5, 5, 5, 6, 8, 9, 9], np.int64)
    pool.key_ends = _i64(ends)
    np.testing.assert_allclose(pool.run(kernel, window).numpy(), pool.sdpa(window), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [DataType.F16, DataType.BF16])
def test_half_queries_over_the_int8_cache(dtype, rng):
    pool = Pool(rng, MIXED, 4, 6, 2, 32, dtype=dtype)
    tol = 2e-2 if dtype is DataType.BF16 else 4e-3
    np.testing.assert_allclose(pool.run().numpy().astype(np.float64), pool.sdpa(), rtol=tol, atol=tol)


# ---- the native kernel's bits -----------------------------------------------------------------
def _rows(pool: Pool, out: Tensor, b: int) -> np.ndarray:
    qs = pool.query_starts.numpy()
    return out.numpy()[qs[b]:qs[b + 1]]


@pytest.mark.parametrize("shape", [(6, 2, 64, 64), (9, 3, 64, 64), (6, 6, 72, 40), (8, 1, 20, 24)],
                         ids=["gqa", "smol", "tails", "mqa"])
def test_simd_levels_and_thread_counts_give_the_same_bits(shape, rng, pool_threads):
    """The portable, AVX2 and AVX-512 steps over int8 keys and values, on 1, 2 and 3 threads,
    head dims with tails, contexts of several segments, windows: one set of bits."""
    h, kh, d, dv = shape
    pool = Pool(rng, MIXED + [(600, 1), (300, 17)], 4, h, kh, d, dv=dv)
    before = paged_native.set_simd(-1)
    try:
        for window in (0, 40):
            paged_native.set_simd(0)
            pool_threads(1)
            want = pool.run("native", window).numpy()
            levels = sorted({paged_native.set_simd(level) for level in range(len(paged_native.SIMD_LEVELS))})
            for level in levels:
                paged_native.set_simd(level)
                for threads in (1, 2, 3):
                    pool_threads(threads)
                    got = pool.run("native", window).numpy()
                    assert np.array_equal(got, want), (paged_native.SIMD_LEVELS[level], threads, window)
    finally:
        paged_native.set_simd(before)


def test_a_row_has_the_same_bits_alone_or_batched(rng, pool_threads):
    """Batch invariance over the int8 pool: a decoding row over 600 keys (cut into segments over
    the threads when alone) and a prompt chunk give the bits they have among other sequences."""
    pool = Pool(rng, MIXED + [(600, 1), (300, 17)], 4, 9, 3, 64)
    pool_threads(2)
    together = pool.run("native")
    for b in (6, 7, 2):
        qs = pool.query_starts.numpy()
        alone = Tensor.empty((int(qs[b + 1] - qs[b]), 9, 64))
        inputs = (pool.q.slice(0, int(qs[b]), int(qs[b + 1])), pool.k_cache, pool.v_cache,
                  _i64(pool.block_tables.numpy()[b:b + 1]), _i64([0, qs[b + 1] - qs[b]]),
                  _i64(pool.context_lens.numpy()[b:b + 1]), pool.k_scale, pool.v_scale)
        paged_native.native_paged_attention((alone,), inputs, {"scale": pool.scale}, q8=True)
        assert np.array_equal(alone.numpy(), _rows(pool, together, b)), b


def test_a_plan_runs_both_ops_natively_with_the_direct_bits(rng):
    from llaisys.ops.plan import ReplayStats

    pool = Pool(rng, MIXED, 4, 6, 2, 32)
    k = Tensor.from_numpy(rng.standard_normal((pool.n, 2, 32)).astype(np.float32))
    slots = _i64(np.arange(pool.n) + 4)
    stores = [Tensor.from_numpy(t.numpy()) for t in (pool.k_cache, pool.v_cache, pool.k_scale, pool.v_scale)]
    out = Tensor.empty((pool.n, 6, 32))
    plan = ops.Plan()
    ops.kv_cache_write(*stores[:2], k, k, slots, k_scale=stores[2], v_scale=stores[3], plan=plan)
    ops.paged_attention(out, pool.q, *stores[:2], *pool.inputs[3:6], pool.scale, k_scale=stores[2],
                        v_scale=stores[3], plan=plan)
    assert plan.stats() == ReplayStats(calls=2, native=2, stretches=1, python=0)
    plan.run()
    ops.kv_cache_write(pool.k_cache, pool.v_cache, k, k, slots, k_scale=pool.k_scale, v_scale=pool.v_scale)
    assert all(np.array_equal(a.numpy(), b.numpy())
               for a, b in zip(stores, (pool.k_cache, pool.v_cache, pool.k_scale, pool.v_scale)))
    assert np.array_equal(out.numpy(), pool.run().numpy())


# ---- argument errors, a device without the kernels -----------------------------------------------
def test_argument_errors():
    kc, vc = Tensor.zeros((4, 2, 1, 8), DataType.I8), Tensor.zeros((4, 2, 1, 8), DataType.I8)
    ks, vs = Tensor.zeros((4, 2, 1)), Tensor.zeros((4, 2, 1))
    k, slots = Tensor.zeros((1, 1, 8)), _i64([0])
    with pytest.raises(ValueError, match="k_scale given without v_scale"):
        ops.kv_cache_write(kc, vc, k, k, slots, k_scale=ks)
    with pytest.raises(TypeError, match=r"k_cache \(with k_scale and v_scale: an 8-bit cache\) has data type F32"):
        ops.kv_cache_write(Tensor.zeros((4, 2, 1, 8)), vc, k, k, slots, k_scale=ks, v_scale=vs)
    with pytest.raises(TypeError, match="v_scale .* has data type F16; expected one of F32"):
        ops.kv_cache_write(kc, vc, k, k, slots, k_scale=ks, v_scale=Tensor.zeros((4, 2, 1), DataType.F16))
    with pytest.raises(ValueError, match=r"v_scale has shape \(4, 2\); expected \(4, 2, 1\)"):
        ops.kv_cache_write(kc, vc, k, k, slots, k_scale=ks, v_scale=Tensor.zeros((4, 2)))
    with pytest.raises(ValueError, match="I8 are an 8-bit cache; give its k_scale and v_scale"):
        ops.kv_cache_write(kc, vc, k, k, slots)  # int8 caches without their scales
    out, idx = Tensor.zeros((1, 2, 8)), (_i64([[0]]), _i64([0, 1]), _i64([1]))
    with pytest.raises(ValueError, match="v_scale given without k_scale"):
        ops.paged_attention(out, Tensor.zeros((1, 2, 8)), kc, vc, *idx, 0.5, v_scale=vs)
    with pytest.raises(TypeError, match="q has data type F32 but out has F16"):
        ops.paged_attention(Tensor.zeros((1, 2, 8), DataType.F16), Tensor.zeros((1, 2, 8)), kc, vc, *idx, 0.5,
                            k_scale=ks, v_scale=vs)


def test_through_the_cpu_fallback(fake_device, rng):
    """On a device without the 8-bit kernels the registry's CPU fallback keeps the slots it
    does not write (every store goes in as an input too)."""
    pool = Pool(rng, [(9, 1), (6, 2)], 4, 6, 2, 16)
    on = lambda t: t.to("fakedev:0")  # noqa: E731
    stores = [on(t) for t in (pool.k_cache, pool.v_cache, pool.k_scale, pool.v_scale)]
    k = Tensor.from_numpy(rng.standard_normal((2, 2, 16)).astype(np.float32))
    slots = _i64([3, 12])
    ops.kv_cache_write(*stores[:2], on(k), on(k), on(slots), k_scale=stores[2], v_scale=stores[3])
    ops.kv_cache_write(pool.k_cache, pool.v_cache, k, k, slots, k_scale=pool.k_scale, v_scale=pool.v_scale)
    assert all(np.array_equal(a.numpy(), b.numpy())
               for a, b in zip(stores, (pool.k_cache, pool.v_cache, pool.k_scale, pool.v_scale)))
    out = Tensor.empty((pool.n, 6, 16), device="fakedev:0")
    ops.paged_attention(out, on(pool.q), *stores[:2], *(on(t) for t in pool.inputs[3:6]), pool.scale,
                        k_scale=stores[2], v_scale=stores[3])
    assert np.array_equal(out.numpy(), pool.run().numpy())


# ---- Triton, through the interpreter (or on a GPU) ----------------------------------------------
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("specs", [[(9, 1), (6, 6), (5, 0), (13, 3)], [(9, 2), (5, 0), (13, 1)]],
                         ids=["chunks", "per-token"])
def test_triton_kernels_match_the_reference(nvidia_device, dtype, specs, rng):
    """kv_cache_write_q8 gives the CPU's codes and scales bit for bit; paged_attention_q8 (and
    its window / key_ends form) the reference's values within the type's rounding."""
    seed = int(rng.integers(1 << 30))
    cpu = Pool(np.random.default_rng(seed), specs, 4, 6, 2, 16, dtype=dtype)
    dev = Pool(np.random.default_rng(seed), specs, 4, 6, 2, 16, dtype=dtype, device=nvidia_device)
    for a, b in ((cpu.k_cache, dev.k_cache), (cpu.v_cache, dev.v_cache), (cpu.k_scale, dev.k_scale),
                 (cpu.v_scale, dev.v_scale)):
        assert np.array_equal(a.numpy(), b.numpy())
    tol = {DataType.F32: 1e-5, DataType.F16: 4e-3, DataType.BF16: 3e-2}[dtype]
    for window, ends in ((0, None), (3, [c for c, q in specs for _ in range(q)])):
        if ends is not None:
            cpu.key_ends, dev.key_ends = _i64(ends), Tensor.from_numpy(np.array(ends, np.int64), device=nvidia_device)
        want = cpu.run("numpy", window).numpy().astype(np.float64)
        got = dev.run("op", window).numpy().astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"window {window}, ends {ends}")


# ---- the engine on the bundled model -------------------------------------------------------------
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,", "Water boils at",
           "The opposite of hot is", "import numpy as", "My favourite colour is", "Q: What is 2 + 2?\nA:",
           "The sun rises in the", "Dear Sir or Madam,", "for i in range(", "Paris is the capital of",
           "Roses are red,", "The quick brown fox", "Hello, my name is"]


def _texts(engine: LLMEngine, prompts, config) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, config)]


def test_the_pool_takes_a_quarter_of_f32s_bytes(smollm2_model):
    f32 = LLMEngine(smollm2_model, kv_cache_tokens=256, block_size=16)
    int8 = LLMEngine(smollm2_model, kv_cache_tokens=256, block_size=16, kv_cache_dtype="int8")
    c = smollm2_model.config  # 30 layers, 3 KV heads of 64
    assert smollm2_model.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 4 == 46080
    assert smollm2_model.kv_bytes_per_token("int8") == 2 * 30 * 3 * (64 + 4) == 12240
    assert int8.cache.nbytes == 256 * 12240 and f32.cache.nbytes == 256 * 46080
    stores = int8.cache.stores()
    assert [t.dtype for t in stores] == [DataType.I8, DataType.I8, DataType.F32, DataType.F32]
    assert [t.shape for t in stores] == [(30, 16, 16, 3, 64)] * 2 + [(30, 16, 16, 3)] * 2
    assert int8.kv_cache_dtype == "int8" and f32.kv_cache_dtype == "auto" and c.num_hidden_layers == 30
    assert LLMEngine(smollm2_model, kv_cache_tokens=64, kv_cache_dtype="q8_0").cache.k.dtype is DataType.I8


def test_sixteen_requests_together_equal_each_alone(smollm2_model):
    config = GenerationConfig(max_new_tokens=10)
    together = _texts(LLMEngine(smollm2_model, kv_cache_tokens=2048, kv_cache_dtype="int8"), PROMPTS, config)
    alone = LLMEngine(smollm2_model, kv_cache_tokens=512, kv_cache_dtype="int8", prefix_caching=False)
    for prompt, got in zip(PROMPTS, together):
        assert _texts(alone, [prompt], config)[0] == got, prompt


def test_speculative_decoding_leaves_the_output_unchanged(smollm2_model):
    config = GenerationConfig(max_new_tokens=40)
    plain = _texts(LLMEngine(smollm2_model, kv_cache_dtype="int8", kv_cache_tokens=2048), [COPYING, OTHER], config)
    engine = LLMEngine(smollm2_model, kv_cache_dtype="int8", kv_cache_tokens=2048, speculative_tokens=6)
    assert _texts(engine, [COPYING, OTHER], config) == plain
    assert engine.accepted_tokens > 10  # drafts were taken, and some rejected ones written over


@pytest.mark.parametrize("bad", ["fp8", "int4", "", 8, None])
def test_a_bad_kv_cache_dtype_names_the_accepted_values(smollm2_model, bad):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'int8', 'q8_0'"):
        LLMEngine(smollm2_model, kv_cache_tokens=64, kv_cache_dtype=bad)


def test_a_device_without_the_int8_kernels_says_so(smollm2_model, monkeypatch):
    from llaisys.models import runner

    real = runner.find_kernel
    monkeypatch.setattr(runner, "find_kernel", lambda op, *a, **k: None if "_q8" in op else real(op, *a, **k))
    with pytest.raises(ValueError, match="an int8 KV cache needs the 8-bit paged kernels on cpu:0 .* lacks "
                                         "kv_cache_write_q8, paged_attention_q8"):
        LLMEngine(smollm2_model, kv_cache_tokens=64, kv_cache_dtype="int8")
