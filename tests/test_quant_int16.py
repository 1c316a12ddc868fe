"""The int16 arithmetic of the quantized linear (csrc/kernels/quant_int.c): activations as
16-bit integers per 32-element block on the integer dot-product units; and the int8 arithmetic,
the same with 8-bit activations (each test that takes ``integer_math`` runs in both).

- the NumPy reference (reference_int16.py) lies within the activation quantization's bound of
  a float64 PyTorch product of gguf's dequantized weights;
- the native kernels equal that reference bit for bit, for every block format, any M, odd N,
  with a bias, into strided rows, on 1 and 2 threads, from the weights repacked at load and
  from the weights as stored;
- a row has the same bits alone and in any batch;
- the bundled SmolLM2 keeps transformers' greedy tokens with it.
Needs AVX512-VNNI: skipped, saying so, on a CPU without it. On a CPU with AMX, batches of 16
rows and more run on the tiles, so the same tests check them.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llaisys.kernels.quant import native
from llaisys.kernels.quant.reference_int16 import XQ_MAX, linear_int16, quantize_activations
from test_quant_kernels import gguf_dequantize, make_weights

BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _use_math(name: str):
    if not native.available() or name not in native.available_quant_maths():
        pytest.skip(f"the {name} arithmetic needs a CPU with AVX512-VNNI; this one has none")
    before = native.quant_math()
    native.set_quant_math(name)
    return before


@pytest.fixture
def int16():
    """The int16 arithmetic for one test (the one in use before is restored)."""
    before = _use_math("int16")
    yield
    native.set_quant_math(before)


@pytest.fixture(params=[16, 8], ids=["int16", "int8"])
def integer_math(request):
    """Each integer arithmetic in turn, for one test: yields its activation bits (16 or 8)."""
    before = _use_math(f"int{request.param}")
    yield request.param
    native.set_quant_math(before)


def quantization_bound(x: np.ndarray, w: np.ndarray, bits: int = 16) -> np.ndarray:
    """(M, N): what rounding the activations to s * q can move x . w (|x - s q| <= s / 2 per
    element), plus float32 rounding of the sums."""
    _, s = quantize_activations(x, bits)                 # (M, nb)
    absw = np.abs(w.astype(np.float64)).reshape(w.shape[0], -1, 32).sum(axis=2)  # (N, nb)
    step = (s.astype(np.float64) / 2) @ absw.T            # (M, N)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    return 1.0001 * step + 1e-6 * scale + 1e-6


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_reference_is_within_the_quantization_bound_of_float64(name, bits):
    rng = np.random.default_rng(7)
    k = 512
    raw = make_weights(name, 21, k, rng)
    w = gguf_dequantize(name, raw)
    x = (rng.standard_normal((6, k)) * np.exp(rng.uniform(-3, 3, (6, k)))).astype(np.float32)  # wide magnitudes
    x[2, :32] = 0.0  # an all-zero block
    got = linear_int16(x, name, raw, bits=bits).astype(np.float64)
    want = (torch.from_numpy(x.astype(np.float64)) @ torch.from_numpy(w.astype(np.float64)).T).numpy()
    excess = np.abs(got - want) - quantization_bound(x, w, bits)
    assert excess.max() <= 0, f"{name}: off by {excess.max():.3g} beyond the bound"
    _, s = quantize_activations(x, bits)
    assert XQ_MAX == 32639 and s[2, 0] == 0


INT_LEVELS = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}  # SIMD level -> the units the integer kernels use


@pytest.fixture(params=list(INT_LEVELS))
def int_level(request):
    """Each level of the integer kernels this CPU has, in turn (the SIMD level picks it)."""
    if request.param not in native.available_simd_levels():
        pytest.skip(f"this CPU lacks the {request.param} level")
    before = native.simd_level()
    native.set_simd_level(request.param)
    try:
        if native.int_level() != INT_LEVELS[request.param]:
            pytest.skip(f"this CPU has no {INT_LEVELS[request.param]} units (its integer kernels: {native.int_level()})")
        yield native.int_level()
    finally:
        native.set_simd_level(before)


@pytest.mark.parametrize("name", BLOCK_FORMATS)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9, 16, 17, 40])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "as-stored"])
def test_native_equals_the_reference_bitwise(integer_math, int_level, name, m, pack):
    """Both the weights repacked at load (fused in registers up to 16 rows of X, 8 for Q6_K,
    through a scratch above) and the weights read as stored, on AVX512-VNNI and on AVX-VNNI where the CPU
    has them; where it has AMX, 16 and 32 of the 17 and 40 rows run on its tiles, the rest on
    the VNNI kernels."""
    rng = np.random.default_rng(m)
    n, k = 37, 512  # 37: two groups of 16 rows and a part
    raw = make_weights(name, n, k, rng)
    weight = native.QuantWeight(name, raw, pack=pack)
    assert (weight.packed is not None) == pack
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    want = linear_int16(x, name, raw, bias, bits=integer_math)
    before = native.threads()
    try:
        for threads in (1, 2):
            native.set_threads(threads)
            got = weight.linear(x, bias)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{name} M={m} on {threads} thread(s)"
    finally:
        native.set_threads(before)
    out = np.full((m, n + 5), 7.0, np.float32)  # rows of Y wider than N
    weight.linear(x, None, out=out[:, :n])
    assert np.array_equal(out[:, :n], linear_int16(x, name, raw, bits=integer_math)) and np.all(out[:, n:] == 7.0)
    bound = np.zeros((m, n), np.float32)
    weight.bind(x, bias, bound)()  # the call a replayed decoding step makes
    assert np.array_equal(bound.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_both_levels_pack_the_same_bytes(int16, name):
    """The AVX-VNNI level packs in plain C what the AVX512-VNNI level packs with its shuffles."""
    levels = native.available_simd_levels()
    if "avx512" not in levels or "avx2" not in levels:
        pytest.skip("needs both the avx512 and avx2 levels")
    raw = make_weights(name, 37, 512, np.random.default_rng(5))
    packed = {}
    before = native.simd_level()
    try:
        for level in ("avx512", "avx2"):
            native.set_simd_level(level)
            if native.int_level() != INT_LEVELS[level]:
                pytest.skip(f"this CPU has no {INT_LEVELS[level]} units")
            packed[level] = native.QuantWeight(name, raw).packed.copy()
    finally:
        native.set_simd_level(before)
    assert np.array_equal(packed["avx512"], packed["avx2"])


def test_weights_are_packed_only_for_the_integer_arithmetics(integer_math):
    rng = np.random.default_rng(1)
    raw = make_weights("Q4_K", 20, 256, rng)
    assert native.QuantWeight("Q4_K", raw).packed is not None
    native.set_quant_math("f32")
    assert native.QuantWeight("Q4_K", raw).packed is None


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_rows_are_batch_invariant(integer_math, name):
    rng = np.random.default_rng(3)
    raw = make_weights(name, 50, 768, rng)
    x = rng.standard_normal((33, 768)).astype(np.float32)
    batch = native.linear(x, name, raw)
    for r in (0, 7, 32):
        for rows in (x[r:r + 1], x[max(0, r - 3):r + 1]):
            alone = native.linear(rows, name, raw)[-1]
            assert np.array_equal(alone.view(np.uint32), batch[r].view(np.uint32)), f"{name} row {r}"


def test_unknown_arithmetic_is_refused():
    with pytest.raises(ValueError, match="unknown arithmetic 'int4'; expected one of f32, int16, int8"):
        native.set_quant_math("int4")


def test_smollm2_keeps_transformers_greedy_tokens(int16, smollm2_path, hf_smollm2_model, hf_smollm2_tokenizer):
    from llaisys.engine import generate
    from llaisys.generation import GenerationConfig
    from llaisys.models import load_model

    model = load_model(smollm2_path)
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = model.tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        want = hf_smollm2_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    got = generate(model, ids, GenerationConfig(max_new_tokens=24, temperature=0.0)).token_ids
    eos = set(model.eos_token_ids)
    want = want[:next((i + 1 for i, t in enumerate(want) if t in eos), len(want))]
    assert got[:len(want)] == want


def test_int8_stays_within_llama_cpp_like_distance_of_transformers(smollm2_path, hf_smollm2_model):
    """The int8 arithmetic is not exact: teacher-forced on a passage, its next-token choices
    agree with transformers' float32 at most positions and its distributions lie close (mean
    KL), while the int16 arithmetic's lie closer by orders of magnitude."""
    from llaisys.models import load_model

    if "int8" not in native.available_quant_maths():
        pytest.skip("the int8 arithmetic needs a CPU with AVX512-VNNI; this one has none")
    text = ("The lighthouse keeper kept a ledger of every ship that passed the point, and in the winter of the "
            "long storms the entries grew short. A schooner bound for the southern ports, its mainsail torn. Two "
            "trawlers running for shelter before the wind turned. A steamer that did not answer the lamp.")
    before = native.quant_math()
    kl, agree = {}, {}
    try:
        for name in ("int16", "int8"):
            native.set_quant_math(name)
            model = load_model(smollm2_path)
            ids = model.tokenizer.encode(text)
            got = torch.from_numpy(np.asarray(model.forward(ids, model.new_cache(len(ids) + 8), all_logits=True)))
            with torch.no_grad():
                want = hf_smollm2_model(torch.tensor([ids])).logits[0].float()
            ref = torch.log_softmax(want.double(), -1)
            kl[name] = float((ref.exp() * (ref - torch.log_softmax(got.double(), -1))).sum(-1).mean())
            agree[name] = float((got.argmax(-1) == want.argmax(-1)).double().mean())
    finally:
        native.set_quant_math(before)
    assert agree["int8"] >= 0.9 and kl["int8"] < 1e-2, (agree, kl)
    assert agree["int16"] == 1.0 and kl["int16"] < kl["int8"] / 100, (agree, kl)


def test_projections_apart_in_the_file_stay_views_of_it(int16, gemma3_gguf_path):
    """Gemma 3's q and k (Q5_0; v is Q8_0) and its gate and up do not lie back to back in its
    file: where the integer arithmetic repacks them, each stays a view of the file's memory map
    (whose pages the packing lets go) instead of a stacked copy kept beside the packed one, with
    the stacked copies' logits, bit for bit, in the same arithmetic."""
    from llaisys.models import load_model

    apart = load_model(gemma3_gguf_path)
    layer, c = apart.params.layers[0], apart.config
    assert layer.qkv is None and layer.gate_up is None
    assert [t.shape[0] for t in layer.qkv_parts] == [c.num_attention_heads * c.head_dim,
                                                     c.num_key_value_heads * c.head_dim, c.num_key_value_heads * c.head_dim]
    assert [t.shape[0] for t in layer.gate_up_parts] == [c.intermediate_size] * 2
    assert all(t.storage.drop_file_pages(0, t.storage.nbytes) for t in (*layer.qkv_parts, *layer.gate_up_parts))
    native.set_quant_math("f32")
    stacked = load_model(gemma3_gguf_path)  # loaded where nothing is repacked: q and k copied into one
    native.set_quant_math("int16")
    assert [t.shape[0] for t in stacked.params.layers[0].qkv_parts] == [(c.num_attention_heads + c.num_key_value_heads)
                                                                        * c.head_dim, c.num_key_value_heads * c.head_dim]
    assert stacked.params.layers[0].gate_up is not None
    ids = apart.tokenizer.encode("The lighthouse keeper kept a ledger of every ship that passed the point.")
    want = stacked.forward(ids, stacked.new_cache(64), all_logits=True)
    got = apart.forward(ids, apart.new_cache(64), all_logits=True)
    assert np.array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
