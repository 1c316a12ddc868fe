"""BF16 safetensors folders in an f32 model: the matrices and the embedding table stay BF16 in
memory (``linear`` and ``embedding`` widen them as they compute), views of the file where it
holds them as they are used, norms and biases are f32, and the logits match transformers' f32
run of the same bf16-rounded weights."""
from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

import torch
import transformers

from llaisys import DataType
from llaisys.models import load_model
from conftest import random_hf_model

VOCAB = 384
F32_ATOL = 1e-4  # as in test_models_hf.py

CASES = {
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "llama_bias": ("llama", dict(attention_bias=True, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, config extras, folder saved in bf16, transformers f32 model reloaded from it)."""
    arch, extra = CASES[request.param]
    hf = random_hf_model(arch, 7, vocab_size=VOCAB, intermediate_size=112, num_hidden_layers=3,
                         max_position_embeddings=512, **extra).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    # the same bf16 weights computed in f32 (reloaded, so rope frequencies are not bf16-rounded)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, extra, folder, ref


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()  # (S, V)


def test_matrices_stay_bf16(case):
    name, extra, folder, _ = case
    model = load_model(folder, dtype="f32")
    assert model.dtype is DataType.F32
    p = model.params
    for lp in p.layers:
        for t in (lp.qkv, lp.o, lp.gate_up, lp.down):
            assert t.dtype is DataType.BF16, name
        for t in (lp.attn_norm, lp.ffn_norm, lp.qkv_bias, lp.o_bias):
            assert t is None or t.dtype is DataType.F32, name
    assert p.embed.dtype is DataType.BF16 and p.norm.dtype is DataType.F32
    if extra["tie_word_embeddings"]:
        assert p.lm_head is p.embed
    else:
        assert p.lm_head.dtype is DataType.BF16


def _mapped_file(t) -> bool:
    """Whether tensor ``t``'s memory is a view of a memory-mapped file rather than its own."""
    base = t.storage.host_memory()
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, mmap.mmap) or (isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap))


def test_matrices_kept_as_stored_are_views_of_the_file(case):
    """o, down, gate/up (back to back in the file) and the embedding table are frozen views of
    the file's memory map holding the stored values; q/k/v, apart in the file, are one copy."""
    from safetensors.numpy import load_file

    name, extra, folder, _ = case
    stored = {k: v for k, v in load_file(folder / "model.safetensors").items()}  # bf16 as stored
    p = load_model(folder, dtype="f32").params
    for i, lp in enumerate(p.layers):
        pre = f"model.layers.{i}."
        for t, names in ((lp.o, ["self_attn.o_proj"]), (lp.down, ["mlp.down_proj"]),
                         (lp.gate_up, ["mlp.gate_proj", "mlp.up_proj"])):
            assert _mapped_file(t) and t.frozen and not t.host_array().flags.writeable, name
            want = np.concatenate([stored[pre + n + ".weight"] for n in names]).view(np.uint16)
            assert np.array_equal(t.host_array().view(np.uint16), want), name
        assert not _mapped_file(lp.qkv), name
    assert _mapped_file(p.embed)
    assert np.array_equal(p.embed.host_array().view(np.uint16), stored["model.embed_tokens.weight"].view(np.uint16))


def test_logits_and_greedy_match_transformers_f32(case):
    name, _, folder, ref = case
    model = load_model(folder, dtype="f32")
    ids = _prompt(24, seed=1)
    got = model.forward(ids, model.new_cache(64), all_logits=True)
    want = _hf_logits(ref, ids)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=F32_ATOL, rtol=0, err_msg=name)

    ids = _prompt(10, seed=3)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                           pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    want_tokens = out[0, len(ids):].tolist()
    cache = model.new_cache(len(ids) + 24)
    logits = model.forward(ids, cache)
    tokens = []
    for _ in range(24):
        tokens.append(int(np.argmax(logits)))
        logits = model.forward([tokens[-1]], cache)
    assert tokens == want_tokens, name


def test_resident_bytes_about_half(case):
    name, extra, folder, _ = case
    half = load_model(folder, dtype="f32")
    full = load_model(folder, dtype="f32", half_weights=False)
    assert full.params.layers[0].qkv.dtype is DataType.F32
    # only the 1-D norms and biases stay 4 bytes an element
    p = full.params
    f32_only = p.norm.nbytes + sum(
        t.nbytes for lp in p.layers for t in (lp.attn_norm, lp.ffn_norm, lp.qkv_bias, lp.o_bias) if t is not None)
    assert half.weight_bytes() == f32_only + (full.weight_bytes() - f32_only) // 2, name
    assert half.weight_bytes() < 0.6 * full.weight_bytes(), name
    ids = _prompt(12, seed=5)
    np.testing.assert_allclose(half.forward(ids, half.new_cache(16), all_logits=True),
                               full.forward(ids, full.new_cache(16), all_logits=True), atol=F32_ATOL, rtol=0)


def test_bf16_dtype_keeps_everything_bf16(case):
    _, _, folder, _ = case
    natural = load_model(folder, dtype="bf16")
    assert natural.dtype is DataType.BF16
    p = natural.params
    assert {t.dtype for t in (p.embed, p.norm, p.lm_head, p.layers[0].qkv, p.layers[0].attn_norm)} == {DataType.BF16}


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    hf = random_hf_model("llama", 9, vocab_size=VOCAB, intermediate_size=112, num_hidden_layers=2,
                         max_position_embeddings=128, tie_word_embeddings=False).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("bf16_llama")
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bare_device(tmp_path_factory):
    from conftest import plugin_libraries
    from llaisys.plugins import load_plugin

    source = Path(__file__).parent / "plugins" / "contract_devices.c"
    for libs in plugin_libraries(tmp_path_factory.mktemp("half_plugin"), {"half_bare": (source, ['DEVICE_TYPE="half_bare"'])}):
        load_plugin(libs["half_bare"])
        yield "half_bare:0"


@pytest.fixture(scope="module")
def reference_device():
    from llaisys.plugins import load_plugin, unload_plugin
    from llaisys.plugins.build import build_reference_plugin

    plugin = load_plugin(build_reference_plugin())
    yield "custom_cpu:0"
    unload_plugin(plugin.name)


@pytest.mark.parametrize("which", ["bare", "reference"])
def test_plugin_device_matches_the_cpu(bf16_llama, which, request):
    """A plugin without kernels, and one whose F32 linear does not take a BF16 weight: the
    BF16 matrices go to the CPU's mixed kernel through the fallback."""
    device = request.getfixturevalue(f"{which}_device")
    ids = [3, 17, 42, 5]
    got = load_model(bf16_llama, dtype="f32", device=device)
    assert got.params.layers[0].qkv.dtype is DataType.BF16 and str(got.params.lm_head.device) == device
    want = load_model(bf16_llama, dtype="f32")
    cache = got.new_cache(10)
    np.testing.assert_allclose(got.forward(ids, cache, all_logits=True),
                               want.forward(ids, want.new_cache(4), all_logits=True), atol=F32_ATOL, rtol=0)
    assert np.isfinite(got.forward([7], cache)).all()
