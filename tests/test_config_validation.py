"""Hostile model configs: each rope and block parameter is checked where the config is built,
so a value that would divide by zero, take the log of a number <= 0, give NaN or make another
model than transformers' is a ModelLoadError naming the key as the file spells it (config.json's
``rope_scaling.beta_fast``, a GGUF's ``llama.rope.scaling.factor``), before any arithmetic with it.
Where transformers defines the behaviour (a null YaRN factor, a Gemma 3 pattern of 2.0, a
``partial_rotary_factor`` that its Llama and Qwen2 ignore) llaisys follows it, checked against
transformers itself."""
from __future__ import annotations

import logging
import math

import gguf
import numpy as np
import pytest
import torch
import transformers

from llaisys.models import ModelLoadError, load_model
from llaisys.models.architectures import config_from_hf
from llaisys.models.rope import rope_frequencies

from conftest import random_hf_model
from test_rope_scaling import hf_frequencies, partial_llama  # noqa: F401  (a fixture)

LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
GEMMA = dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
             sliding_window=8, rope_theta=10000.0)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def yarn(**changes) -> dict:
    """A Llama config.json (as a dict) with a YaRN ``rope_scaling`` table changed by ``changes``."""
    return {**LLAMA, "rope_scaling": {**YARN, **changes}}


# ---- config.json: refused by name --------------------------------------------------------------
HF_REFUSED = {
    "yarn_theta_1": ({**LLAMA, "rope_parameters": {**YARN, "rope_theta": 1.0}},
                     r"rope_parameters\.rope_theta must be a positive number other than 1 for rope type 'yarn' "
                     r"\(its ramp divides by log\(rope_theta\)\), got 1\.0"),
    "yarn_flat_theta_1": ({**yarn(), "rope_theta": 1}, r"rope_theta must be a positive number other than 1"),
    "beta_fast_negative": (yarn(beta_fast=-1), r"rope_scaling\.beta_fast must be a non-negative number, got -1$"),
    "beta_fast_text": (yarn(beta_fast="x"), r"rope_scaling\.beta_fast must be a non-negative number, got 'x'$"),
    "beta_slow_list": (yarn(beta_slow=[1]), r"rope_scaling\.beta_slow must be a non-negative number, got \[1\]$"),
    "beta_slow_infinite": (yarn(beta_slow=math.inf), r"rope_scaling\.beta_slow must be a non-negative number, got inf"),
    "mscale_all_dim_negative": (yarn(mscale=1.0, mscale_all_dim=-10),
                                r"rope_scaling\.mscale_all_dim must be a non-negative number, got -10$"),
    "mscale_negative": (yarn(mscale=-30.0, mscale_all_dim=1.0), r"rope_scaling\.mscale must be a non-negative number"),
    "yarn_without_factor": ({**LLAMA, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 16}},
                            r"rope type 'yarn' needs factor in its rope parameters \(rope_scaling\)"),
    "dynamic_two_rotated_dims": ({**LLAMA, "hidden_size": 8, "head_dim": 2, "rope_scaling": DYNAMIC},
                                 r"rope type 'dynamic' needs more than 2 rotated dims .*head_dim=2 rotates 2"),
    "linear_on_part_of_a_head": ({**LLAMA, "partial_rotary_factor": 0.5, "rope_scaling": {"rope_type": "linear",
                                                                                         "factor": 2.0}},
                                 r"partial_rotary_factor=0\.5 with rope type 'linear' is not supported for "
                                 r"model_type 'llama', which rotates whole heads"),
    "qwen2_yarn_on_part_of_a_head": ({**LLAMA, "model_type": "qwen2",
                                      "rope_parameters": {**YARN, "partial_rotary_factor": 0.25}},
                                     r"rope_parameters\.partial_rotary_factor=0\.25 with rope type 'yarn' is not "
                                     r"supported for model_type 'qwen2'"),
    "head_dim_0": ({**LLAMA, "head_dim": 0}, r"head_dim must be a positive integer, got 0$"),
    "num_key_value_heads_0": ({**LLAMA, "num_key_value_heads": 0},
                              r"num_key_value_heads must be a positive integer, got 0$"),
    "context_past_uint32": ({**LLAMA, "max_position_embeddings": 2**64 - 1},
                            r"max_position_embeddings must be at most 4294967295, got 18446744073709551615"),
    "theta_underflowing_float32": ({**LLAMA, "rope_theta": 1e-300},
                                   r"rope_theta=1e-300 with rope type 'default' gives rotary frequencies or an "
                                   r"attention factor that are not finite float32 numbers"),
    "gemma_head_dim_0": ({**GEMMA, "head_dim": 0}, r"head_dim must be a positive integer, got 0$"),
    "gemma_query_pre_attn_scalar_0": ({**GEMMA, "query_pre_attn_scalar": 0},
                                      r"query_pre_attn_scalar must be a positive number, got 0$"),
    "gemma_query_pre_attn_scalar_null": ({**GEMMA, "query_pre_attn_scalar": None},
                                         r"query_pre_attn_scalar must be a number, got null"),
    "gemma_rope_local_base_freq_0": ({**GEMMA, "rope_local_base_freq": 0},
                                     r"rope_local_base_freq must be a positive number, got 0$"),
    "gemma_sliding_rope_theta_0": ({**GEMMA, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 0.0}}},
        r"rope_parameters\.sliding_attention\.rope_theta must be a positive number, got 0\.0"),
    "gemma_full_factor_negative": ({**GEMMA, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": -1.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
        r"rope_parameters\.full_attention\.factor must be a positive number, got -1\.0"),
    "gemma_pattern_0": ({**GEMMA, "sliding_window_pattern": 0},
                        r"sliding_window_pattern must be a positive integer \(every n-th layer global\), got 0"),
    "gemma_pattern_negative": ({**GEMMA, "sliding_window_pattern": -1}, r"sliding_window_pattern .* got -1$"),
    "gemma_pattern_text": ({**GEMMA, "sliding_window_pattern": "6"}, r"sliding_window_pattern .* got '6'$"),
    "gemma_pattern_fraction": ({**GEMMA, "sliding_window_pattern": 2.5}, r"sliding_window_pattern .* got 2\.5$"),
}


@pytest.mark.parametrize("name", list(HF_REFUSED))
def test_config_json_values_are_refused_by_key(name):
    raw, message = HF_REFUSED[name]
    with pytest.raises(ModelLoadError, match=r"^config\.json: " + message):
        config_from_hf(raw, "config.json")


def test_dynamic_rope_on_two_dims_of_a_partial_rotary_head_is_refused(partial_llama):  # noqa: F811
    """An architecture that rotates part of each head: the dims left to dynamic NTK are named."""
    raw = {**LLAMA, "model_type": partial_llama, "partial_rotary_factor": 0.125, "rope_scaling": DYNAMIC}
    with pytest.raises(ModelLoadError, match=r"config\.json: rope type 'dynamic' needs more than 2 rotated dims "
                                             r".*partial_rotary_factor=0\.125 of head_dim=16 rotates 2"):
        config_from_hf(raw, "config.json")


# ---- config.json: what transformers defines, followed ---------------------------------------------
@pytest.mark.parametrize("changes", [
    {"factor": None},  # max_position_embeddings / original_max_position_embeddings
    {"beta_fast": 0, "beta_slow": 0},  # their defaults, 32 and 1
    {"mscale": 0.0, "mscale_all_dim": 1.0},  # the attention factor from factor alone
    {"factor": 0.5},  # below 1: transformers warns, computes
], ids=["null_factor", "zero_betas", "zero_mscale", "factor_below_1"])
def test_yarn_values_transformers_takes_are_taken_as_it_takes_them(changes):
    raw = {**LLAMA, "rope_parameters": {**YARN, **changes, "rope_theta": 10000.0}}
    want, want_factor = hf_frequencies(raw)
    got, factor = rope_frequencies(config_from_hf(raw, "config.json"))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("pattern", [2, 2.0, 3])
def test_gemma3_sliding_window_pattern_gives_transformers_layer_types(pattern):
    raw = {**GEMMA, "num_hidden_layers": 7, "sliding_window_pattern": pattern}
    want = transformers.Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "model_type"}).layer_types
    assert config_from_hf(raw, "config.json").arch_args.layer_types == want


def test_gemma3_without_rope_theta_takes_transformers_global_base():
    raw = {k: v for k, v in GEMMA.items() if k != "rope_theta"}
    want = transformers.Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "model_type"}).rope_parameters
    config = config_from_hf(raw, "config.json")
    assert config.rope_theta == want["full_attention"]["rope_theta"] == 1e6
    assert config.arch_args.rope_local_theta == want["sliding_attention"]["rope_theta"] == 1e4


# ---- partial_rotary_factor on architectures that rotate whole heads ----------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_whole_head_models_ignore_partial_rotary_factor_like_transformers(arch, tmp_path, caplog):
    """transformers' Llama and Qwen2 size their default rope by the head alone, whatever
    partial_rotary_factor says (their output equals the same model's without it)."""
    hf = random_hf_model(arch, 21, vocab_size=128, head_dim=16, max_position_embeddings=64, partial_rotary_factor=0.5)
    hf.save_pretrained(tmp_path)
    ids = np.random.default_rng(2).integers(0, 128, 30).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()  # (S, V)
    with caplog.at_level(logging.WARNING, logger="llaisys.models.architectures"):
        model = load_model(tmp_path)
    got = model.forward(ids, model.new_cache(64), all_logits=True)  # (S, V)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert "partial_rotary_factor=0.5 is ignored" in caplog.text


# ---- GGUF: refused by key ------------------------------------------------------------------------
T = gguf.GGUFValueType
D, I, V, H, KH, DH = 32, 32, 16, 4, 2, 8  # hidden, MLP width, vocabulary, heads, kv heads, head dim
BASE_META = {  # key -> (value, type)
    "llama.block_count": (1, T.UINT32), "llama.context_length": (64, T.UINT32),
    "llama.embedding_length": (D, T.UINT32), "llama.feed_forward_length": (I, T.UINT32),
    "llama.attention.head_count": (H, T.UINT32), "llama.attention.head_count_kv": (KH, T.UINT32),
    "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32), "llama.rope.freq_base": (10000.0, T.FLOAT32),
    "llama.vocab_size": (V, T.UINT32),
}


def llama_gguf(path, changes: dict | None = None, tensors: dict | None = None):
    """A one-layer Llama GGUF with BASE_META's keys, ``changes`` (key -> (value, type)) over them
    and ``tensors`` added; returns ``path``."""
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    weights = {"token_embd.weight": f32(V, D), "output_norm.weight": f32(D), "blk.0.attn_norm.weight": f32(D),
               "blk.0.attn_q.weight": f32(H * DH, D), "blk.0.attn_k.weight": f32(KH * DH, D),
               "blk.0.attn_v.weight": f32(KH * DH, D), "blk.0.attn_output.weight": f32(D, H * DH),
               "blk.0.ffn_norm.weight": f32(D), "blk.0.ffn_gate.weight": f32(I, D),
               "blk.0.ffn_up.weight": f32(I, D), "blk.0.ffn_down.weight": f32(D, I), **(tensors or {})}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype) in {**BASE_META, **(changes or {})}.items():
        w.add_key_value(key, value, vtype)
    for name, arr in weights.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def scaling(kind: str, factor: float, **more) -> dict:
    """Metadata of llama.cpp's rope scaling ``kind`` with ``factor`` and ``more`` (key tail -> (value, type))."""
    return {"llama.rope.scaling.type": (kind, T.STRING), "llama.rope.scaling.factor": (factor, T.FLOAT32),
            **{f"llama.{k}": v for k, v in more.items()}}


def freqs(bad: float) -> dict:
    """A rope_freqs.weight of DH / 2 divisors whose third is ``bad``."""
    values = np.array([1.0, 2.0, bad, 4.0], np.float32)
    return {"rope_freqs.weight": values}


GGUF_REFUSED = {
    "key_length_0": ({"llama.attention.key_length": (0, T.UINT32)}, None,
                     r"llama\.attention\.key_length must be a positive integer, got 0$"),
    "head_count_kv_0": ({"llama.attention.head_count_kv": (0, T.UINT32)}, None,
                        r"llama\.attention\.head_count_kv must be a positive integer, got 0$"),
    "context_length_2**64-1": ({"llama.context_length": (2**64 - 1, T.UINT64)}, None,
                               r"llama\.context_length must be at most 4294967295, got 18446744073709551615"),
    "yarn_freq_base_1": ({**scaling("yarn", 4.0), "llama.rope.freq_base": (1.0, T.FLOAT32)}, None,
                         r"llama\.rope\.freq_base must be a positive number other than 1 for rope type 'yarn'"),
    "yarn_factor_negative": (scaling("yarn", -1.0), None, r"llama\.rope\.scaling\.factor must be a positive number, "
                                                          r"got -1\.0"),
    "yarn_original_context_0": (scaling("yarn", 4.0, **{"rope.scaling.original_context_length": (0, T.UINT32)}), None,
                                r"llama\.rope\.scaling\.original_context_length must be a positive number, got 0$"),
    "linear_factor_nan": (scaling("linear", math.nan), None, r"llama\.rope\.scaling\.factor must be a positive number, "
                                                             r"got nan"),
    "scale_linear_negative": ({"llama.rope.scale_linear": (-2.0, T.FLOAT32)}, None,
                              r"llama\.rope\.scale_linear must be a positive number, got -2\.0"),
    "rope_freqs_zero": ({}, freqs(0.0), r"rope_freqs\.weight must hold positive finite divisors of the frequencies; "
                                        r"found 0\.0 at 2"),
    "rope_freqs_negative": ({}, freqs(-3.0), r"rope_freqs\.weight must hold positive .*found -3\.0 at 2"),
    "rope_freqs_nan": ({}, freqs(math.nan), r"rope_freqs\.weight must hold positive .*found nan at 2"),
    "rope_freqs_inf": ({}, freqs(math.inf), r"rope_freqs\.weight must hold positive .*found inf at 2"),
}


def test_the_base_gguf_loads_with_rope_freqs(tmp_path):
    model = load_model(llama_gguf(tmp_path / "base.gguf", tensors=freqs(3.0)))
    assert model.config.rope_freq_factors == [1.0, 2.0, 3.0, 4.0]
    assert model.config.head_dim == DH and model.config.max_position_embeddings == 64


@pytest.mark.parametrize("name", list(GGUF_REFUSED))
def test_gguf_values_are_refused_by_key(name, tmp_path):
    changes, tensors, message = GGUF_REFUSED[name]
    path = llama_gguf(tmp_path / "bad.gguf", changes, tensors)
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: " + message):
        load_model(path)
