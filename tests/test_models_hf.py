"""Hugging Face folders: small random-weight Qwen2/Llama models saved by transformers, loaded by
llaisys, compared with transformers' own forward pass and greedy generation."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

import torch
import transformers

from llaisys import DataType  # noqa: E402
from llaisys.models import load_model  # noqa: E402
from conftest import random_hf_model  # noqa: E402

VOCAB = 384
F32_ATOL = 1e-4
# bf16 keeps 8 significant bits: weights and every intermediate buffer are rounded to it, so
# logits of magnitude ~10 move by ~0.1 after a few layers. The bound is on max |diff| relative to
# the largest reference logit.
BF16_REL = 0.04

CASES = {
    # name: (architecture, extra config)
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    "llama_bias_headdim": ("llama", dict(attention_bias=True, head_dim=24, rms_norm_eps=1e-5,
                                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "llama": ("llama", dict(tie_word_embeddings=False)),
}


def _build(arch: str, extra: dict, seed: int = 0):
    """A random-weight transformers model with biases and norm weights away from their defaults."""
    return random_hf_model(arch, seed, **{**dict(vocab_size=VOCAB, intermediate_size=112, num_hidden_layers=3,
                                                 max_position_embeddings=512), **extra})


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, transformers model, folder it was saved to as f32 safetensors)."""
    arch, extra = CASES[request.param]
    model = _build(arch, extra)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


@pytest.fixture(scope="module")
def smollm2_tokenizer_files(hf_smollm2_tokenizer, tmp_path_factory):
    """tokenizer.json / tokenizer_config.json / chat_template.jinja as transformers saves them."""
    folder = tmp_path_factory.mktemp("tokenizer")
    hf_smollm2_tokenizer.save_pretrained(folder)
    return folder


def _prompt(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()  # (S, V)


def _greedy(model, ids: list[int], n: int) -> list[int]:
    cache = model.new_cache(len(ids) + n)
    logits = model.forward(ids, cache)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]], cache)
    return out


def test_config_read_from_folder(case):
    name, hf, folder = case
    model = load_model(folder)
    c, h = model.config, hf.config
    assert c.architecture == h.model_type
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        h.hidden_size, h.num_hidden_layers, h.num_attention_heads, h.num_key_value_heads)
    assert c.head_dim == getattr(h, "head_dim", h.hidden_size // h.num_attention_heads)
    assert c.rope_theta == h.rope_parameters["rope_theta"]
    assert c.tie_word_embeddings == h.tie_word_embeddings
    assert model.dtype is DataType.F32
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())
    if c.tie_word_embeddings:
        assert model.params.lm_head is model.params.embed  # shared, not copied


def test_logits_match_transformers_f32(case):
    name, hf, folder = case
    model = load_model(folder)
    ids = _prompt(24)
    want = _hf_logits(hf, ids)  # (S, V)
    got = model.forward(ids, model.new_cache(64), all_logits=True)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=F32_ATOL, rtol=0, err_msg=name)


def test_incremental_decode_matches_full_pass(case):
    """Prefill then one token at a time through the KV cache gives the full pass's logits."""
    name, hf, folder = case
    model = load_model(folder)
    ids = _prompt(20, seed=2)
    want = _hf_logits(hf, ids)  # (S, V)
    cache = model.new_cache(32)
    got = [model.forward(ids[:7], cache, all_logits=True)]
    for t in ids[7:]:
        got.append(model.forward([t], cache)[None])
    assert cache.length == len(ids)
    np.testing.assert_allclose(np.concatenate(got), want, atol=F32_ATOL, rtol=0, err_msg=name)


def test_greedy_tokens_match_generate(case):
    name, hf, folder = case
    model = load_model(folder)
    ids = _prompt(10, seed=3)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    want = out[0, len(ids):].tolist()
    assert len(want) == 32
    assert _greedy(model, ids, 32) == want


def test_bf16_within_stated_bound(case):
    name, hf, folder = case
    model = load_model(folder, dtype="bf16")
    assert model.dtype is DataType.BF16
    ids = _prompt(16, seed=4)
    want = _hf_logits(hf, ids)
    got = model.forward(ids, model.new_cache(16), all_logits=True)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < BF16_REL, f"{name}: bf16 logits off by {err:.3g} of the largest logit"


def test_stored_bf16_kept_or_converted(tmp_path):
    hf = _build("qwen2", dict(tie_word_embeddings=True), seed=5).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    natural = load_model(tmp_path, dtype="bf16")
    assert natural.dtype is DataType.BF16
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        stored = len(list(f.keys()))
    assert natural.info()["tensor_types"] == {"BF16": stored}
    widened = load_model(tmp_path, dtype="f32")
    assert widened.dtype is DataType.F32
    default = load_model(tmp_path)  # on the CPU: f32 activations, the 16-bit matrices as stored
    assert default.dtype is DataType.F32 and default.params.layers[0].qkv.dtype is DataType.BF16
    ids = _prompt(12, seed=6)
    # the same bf16 weights computed in f32 (reloaded: casting back would keep bf16-rounded rope frequencies)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    want = _hf_logits(ref, ids)
    got = widened.forward(ids, widened.new_cache(16), all_logits=True)
    np.testing.assert_allclose(got, want, atol=F32_ATOL, rtol=0)
    embed = widened.params.embed.numpy()
    np.testing.assert_array_equal(embed, hf.model.embed_tokens.weight.detach().float().numpy())


def test_sharded_folder(tmp_path):
    hf = _build("llama", dict(), seed=7)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = load_model(tmp_path)
    ids = _prompt(12, seed=8)
    np.testing.assert_allclose(model.forward(ids, model.new_cache(16), all_logits=True), _hf_logits(hf, ids),
                               atol=F32_ATOL, rtol=0)


def test_folder_tokenizer_generation_config_and_eos(tmp_path, smollm2_tokenizer_files, hf_smollm2_tokenizer):
    hf = _build("llama", dict(), seed=9)
    hf.generation_config = transformers.GenerationConfig(eos_token_id=[2, 7], temperature=0.6, top_p=0.9,
                                                         do_sample=True, repetition_penalty=1.1)
    hf.config.eos_token_id = 2
    hf.save_pretrained(tmp_path)
    for f in smollm2_tokenizer_files.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    model = load_model(tmp_path)
    text = "Hello, world! 你好 🙂  spaces\tand\n<|im_start|>user"
    assert model.tokenizer.encode(text) == hf_smollm2_tokenizer.encode(text)
    msgs = [{"role": "user", "content": "Hi there"}]
    assert model.tokenizer.apply_chat_template(msgs) == hf_smollm2_tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    assert model.generation_defaults == {"do_sample": True, "temperature": 0.6, "top_p": 0.9,
                                         "repetition_penalty": 1.1}
    # union of config (2), generation_config (2, 7) and tokenizer eos (<|im_end|> = 2)
    assert sorted(model.eos_token_ids) == [2, 7]


def test_kv_cache_truncate_and_reuse(case):
    """Dropping the cache back to a shared prefix and continuing equals a fresh run."""
    name, hf, folder = case
    model = load_model(folder)
    prefix, a, b = _prompt(8, seed=10), _prompt(5, seed=11), _prompt(5, seed=12)
    cache = model.new_cache(32)
    model.forward(prefix + a, cache)
    cache.truncate(len(prefix))
    got = model.forward(b, cache, all_logits=True)
    want = _hf_logits(hf, prefix + b)[len(prefix):]
    np.testing.assert_allclose(got, want, atol=F32_ATOL, rtol=0)
    cache.reset()
    assert cache.length == 0


# config.json rope entries that disagree -> the rope_theta transformers 5 runs with
# (``convert_rope_params_to_dict``: rope_scaling, when non-empty, replaces rope_parameters; the
# table's rope_theta comes first, then the flat key, then 10000).
DEFAULT = {"rope_type": "default"}
ROPE_CONFLICTS = {  # name: (architecture, config.json rope entries, the rope_theta transformers uses)
    "flat_and_parameters": ("llama", dict(rope_theta=5000.0, rope_parameters={**DEFAULT, "rope_theta": 700.0}), 700.0),
    "flat_and_scaling": ("qwen2", dict(rope_theta=5000.0, rope_scaling={**DEFAULT, "rope_theta": 900.0}), 900.0),
    "parameters_and_scaling": ("llama", dict(rope_parameters={**DEFAULT, "rope_theta": 700.0},
                                             rope_scaling={**DEFAULT, "rope_theta": 900.0}), 900.0),
    "scaling_without_theta": ("qwen2", dict(rope_parameters={**DEFAULT, "rope_theta": 700.0},
                                            rope_scaling={"type": "default"}), 10000.0),
    "scaling_without_theta_flat": ("llama", dict(rope_theta=500.0, rope_parameters={**DEFAULT, "rope_theta": 700.0},
                                                 rope_scaling={"type": "default"}), 500.0),
    "parameters_without_theta": ("qwen2", dict(rope_theta=500.0, rope_parameters=DEFAULT), 500.0),
    "scaling_replaces_llama3_parameters": ("llama", dict(
        rope_theta=500.0, rope_scaling=DEFAULT,
        rope_parameters={"rope_type": "llama3", "rope_theta": 700.0, "factor": 8.0}), 500.0),
}


@pytest.mark.parametrize("case_name", list(ROPE_CONFLICTS))
def test_conflicting_rope_theta_follows_transformers(tmp_path, case_name):
    arch, rope, theta = ROPE_CONFLICTS[case_name]
    _build(arch, dict(tie_word_embeddings=False), seed=13).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    raw = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("rope_theta", "rope_parameters")}
    path.write_text(json.dumps({**raw, **rope}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert ref.config.rope_parameters["rope_type"] == "default"
    assert ref.config.rope_parameters["rope_theta"] == theta  # the case is what it says
    model = load_model(tmp_path)
    assert model.config.rope_theta == theta
    ids = _prompt(24, seed=14)
    np.testing.assert_allclose(model.forward(ids, model.new_cache(32), all_logits=True), _hf_logits(ref, ids),
                               atol=F32_ATOL, rtol=0, err_msg=case_name)
