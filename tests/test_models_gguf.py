"""GGUF files: the SmolLM2 file and small files written like llama.cpp's converter, loaded by
llaisys and by transformers (which dequantizes the same file to f32), compared token for token."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

import torch
import transformers
import gguf

from conftest import hf_to_gguf_tensors, logits_atol, random_hf_model, write_gguf  # noqa: E402

from llaisys import DataType  # noqa: E402
from llaisys.models import default_model_path, load_model  # noqa: E402
from llaisys.models.loaders.gguf import open_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for staying focused while studying.",
]


def _hf_gguf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(os.fspath(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()  # (S, V)


def _greedy(model, ids: list[int], n: int, stop=()) -> list[int]:
    cache = model.new_cache(len(ids) + n)
    logits = model.forward(ids, cache)
    out: list[int] = []
    while len(out) < n:
        out.append(int(np.argmax(logits)))
        if out[-1] in stop:
            break
        logits = model.forward([out[-1]], cache)
    return out


def _hf_greedy(model, ids: list[int], n: int, eos=None) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos[0] if eos else 0,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


# ---- SmolLM2 ---------------------------------------------------------------------------
def test_default_model_path_is_the_smollm2_file(smollm2_path):
    assert default_model_path() == smollm2_path


def test_loading_a_gguf_imports_neither_gguf_nor_jinja2(smollm2_path):
    """Load time: the container is parsed without the gguf package, and Jinja2 waits for the
    first chat template rendered (a fresh process: this one has imported both)."""
    import llaisys

    code = ("import sys; from llaisys.models import load_model; load_model(sys.argv[1]); "
            "print(sorted(m for m in ('gguf', 'jinja2', 'torch', 'transformers') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(llaisys.__file__))}
    out = subprocess.run([sys.executable, "-c", code, str(smollm2_path)], capture_output=True, text=True, env=env,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_smollm2_config_and_info(smollm2_model, hf_smollm2_model):
    c, h = smollm2_model.config, hf_smollm2_model.config
    assert c.architecture == "llama" and c.tie_word_embeddings
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (
        h.vocab_size, h.hidden_size, h.intermediate_size, h.num_hidden_layers)
    assert (c.num_attention_heads, c.num_key_value_heads) == (h.num_attention_heads, h.num_key_value_heads)
    assert c.rope_theta == pytest.approx(h.rope_parameters["rope_theta"])
    assert c.rms_norm_eps == pytest.approx(h.rms_norm_eps)
    info = smollm2_model.info()
    assert info["format"] == "gguf" and info["dtype"] == "f32"
    assert info["parameters"] == sum(p.numel() for p in hf_smollm2_model.parameters())
    assert set(info["tensor_types"]) == {"F32", "Q4_1", "Q8_0"}


def test_smollm2_logits_match_transformers(smollm2_model, hf_smollm2_model, hf_smollm2_tokenizer):
    ids = hf_smollm2_tokenizer.encode("The quick brown fox jumps over the lazy dog. In 1998, the")
    want = _hf_logits(hf_smollm2_model, ids)  # (S, V)
    got = smollm2_model.forward(ids, smollm2_model.new_cache(64), all_logits=True)
    # f32 through 30 layers: summation order differs from torch's, logits reach ~30
    np.testing.assert_allclose(got, want, atol=logits_atol(want, 2e-3), rtol=0)


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_smollm2_greedy_chat_matches_transformers(prompt, smollm2_model, hf_smollm2_model, hf_smollm2_tokenizer):
    msgs = [{"role": "user", "content": prompt}]
    text = hf_smollm2_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = hf_smollm2_tokenizer.encode(text)
    assert smollm2_model.tokenizer.encode(smollm2_model.tokenizer.apply_chat_template(msgs)) == ids
    eos = sorted(smollm2_model.eos_token_ids)
    want = _hf_greedy(hf_smollm2_model, ids, 32, eos=eos)
    assert _greedy(smollm2_model, ids, 32, stop=eos) == want


# ---- small files written like llama.cpp's converter -----------------------------------
def _tiny(arch: str, seed: int, hidden: int = 64, inter: int = 96, vocab: int = 320, **extra):
    return random_hf_model(arch, seed, hidden_size=hidden, intermediate_size=inter, vocab_size=vocab, **extra)


def _state(model) -> dict[str, np.ndarray]:
    skip = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items() if k not in skip}


@pytest.mark.parametrize("arch,extra", [
    ("llama", dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("qwen2", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
], ids=["llama_permuted_qk", "qwen2_bias_tied"])
def test_small_gguf_f32_matches_transformers(tmp_path, arch, extra):
    src = _tiny(arch, seed=1, **extra)
    path = tmp_path / f"{arch}.gguf"
    tokens = [f"<t{i}>" for i in range(src.config.vocab_size)]
    write_gguf(path, arch, hf_to_gguf_tensors(_state(src), src.config, arch), config=src.config, tokens=tokens)
    ours, ref = load_model(path), _hf_gguf(path)
    assert ours.config.tie_word_embeddings == src.config.tie_word_embeddings
    assert ours.config.attention_bias == (arch == "qwen2")
    ids = np.random.default_rng(0).integers(0, src.config.vocab_size, 20).tolist()
    want = _hf_logits(ref, ids)
    np.testing.assert_allclose(want, _hf_logits(src, ids), atol=1e-4, rtol=0)  # the file holds the model
    np.testing.assert_allclose(ours.forward(ids, ours.new_cache(64), all_logits=True), want, atol=1e-4, rtol=0)
    assert _greedy(ours, ids, 24) == _hf_greedy(ref, ids, 24)


def _random_quant_bytes(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Random blocks of ``qtype``. Every byte stays below 0x3C, so each f16 scale in a block is
    finite and below 1 (its high byte keeps the exponent small)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 0x3C, size=(rows, cols // block * size), dtype=np.uint8)


def test_every_supported_tensor_type_matches_transformers(tmp_path):
    src = _tiny("llama", seed=2, hidden=256, inter=512, vocab=256, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    tensors = hf_to_gguf_tensors(_state(src), src.config, "llama")
    rng = np.random.default_rng(3)
    layout = {  # every supported type at least once
        "blk.0.attn_q.weight": Q.Q2_K, "blk.0.attn_k.weight": Q.Q3_K, "blk.0.attn_v.weight": Q.Q4_K,
        "blk.0.attn_output.weight": Q.Q5_K, "blk.0.ffn_gate.weight": Q.Q6_K, "blk.0.ffn_up.weight": Q.Q8_0,
        "blk.0.ffn_down.weight": Q.Q4_0, "blk.1.attn_q.weight": Q.Q4_1, "blk.1.attn_k.weight": Q.Q5_0,
        "blk.1.attn_v.weight": Q.Q5_1, "blk.1.attn_output.weight": Q.F16, "blk.1.ffn_gate.weight": Q.BF16,
        "token_embd.weight": Q.Q8_0, "output.weight": Q.Q6_K,
    }
    for name, qtype in layout.items():
        if qtype.name.endswith("_K"):
            tensors[name] = _random_quant_bytes(rng, *tensors[name].shape, qtype)
    path = tmp_path / "types.gguf"
    write_gguf(path, "llama", tensors, config=src.config, types=layout)
    ours, ref = load_model(path), _hf_gguf(path)
    assert set(ours.info()["tensor_types"]) == {q.name for q in layout.values()} | {"F32"}
    ids = rng.integers(0, 256, 12).tolist()
    want = _hf_logits(ref, ids)
    got = ours.forward(ids, ours.new_cache(16), all_logits=True)
    np.testing.assert_allclose(got, want, atol=logits_atol(want, 1e-5 * np.abs(want).max() + 1e-4), rtol=0)


def test_dtype_choice_for_gguf(tmp_path):
    src = _tiny("qwen2", seed=4, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    tensors = hf_to_gguf_tensors(_state(src), src.config, "qwen2")
    f16 = {n: Q.F16 for n, a in tensors.items() if a.ndim == 2}
    path = tmp_path / "f16.gguf"
    write_gguf(path, "qwen2", tensors, config=src.config, types=f16)
    assert load_model(path, dtype="f16").dtype is DataType.F16
    # on the CPU, f32 activations over the F16 matrices, which stay F16 as views of the file
    ours, ref = load_model(path), _hf_gguf(path)
    p = ours.params
    assert ours.dtype is DataType.F32 and p.norm.dtype is DataType.F32
    assert {t.dtype for t in (p.embed, p.lm_head, p.layers[0].qkv, p.layers[0].o, p.layers[0].down)} == {DataType.F16}
    stored = {t.name: t.data for t in open_gguf(str(path)).tensors}
    base = p.layers[0].o.storage.host_memory()
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)  # not a copy
    assert np.array_equal(p.layers[0].o.host_array().view(np.uint16), stored["blk.0.attn_output.weight"].view(np.uint16))
    ids = [5, 17, 250, 3, 99, 42]
    np.testing.assert_allclose(ours.forward(ids, ours.new_cache(8), all_logits=True), _hf_logits(ref, ids),
                               atol=1e-4, rtol=0)
    full = load_model(path, dtype="f32", half_weights=False)
    assert full.params.layers[0].o.dtype is DataType.F32
    np.testing.assert_allclose(ours.forward(ids, ours.new_cache(8), all_logits=True),
                               full.forward(ids, full.new_cache(8), all_logits=True), atol=1e-5, rtol=0)


def _same_contents(ours, ref) -> None:
    """Our parse of a GGUF file holds what gguf.GGUFReader reads from it: every metadata value,
    in order, and every tensor with its type, place, shape and bytes."""
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.meta) == list(want)
    for key, value in want.items():
        assert ours.meta[key] == value and type(ours.meta[key]) is type(value), key
        if isinstance(value, list) and value:
            assert {type(v) for v in ours.meta[key]} == {type(v) for v in value}, key
    assert (ours.data_offset, ours.alignment) == (ref.data_offset, ref.alignment)
    assert [(t.name, int(t.tensor_type), t.shape, t.n_bytes, t.data_offset, t.data.dtype, t.data.shape)
            for t in ours.tensors] == [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), t.n_bytes,
                                        t.data_offset, t.data.dtype, t.data.shape) for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.data.tobytes() == b.data.tobytes(), a.name


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_metadata_parsing_equals_gguf_reader(smollm2_path, tmp_path, endian, native, monkeypatch):
    """The loader parses GGUF files itself; the result must be what gguf.GGUFReader reads, for
    the real file and for arrays of every scalar type, in either byte order, with string arrays
    gathered by the native library or read one by one in Python."""
    from llaisys.models.loaders import gguf_file
    from llaisys.models.loaders.gguf import open_gguf

    if not native:
        monkeypatch.setattr(gguf_file, "_library", [None])
    if endian == gguf.GGUFEndian.LITTLE:
        _same_contents(open_gguf(str(smollm2_path)), gguf.GGUFReader(smollm2_path))
    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    for i, vtype in enumerate([gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT16, gguf.GGUFValueType.UINT32,
                               gguf.GGUFValueType.INT64, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64,
                               gguf.GGUFValueType.BOOL]):
        values = [True, False, True] if vtype == gguf.GGUFValueType.BOOL else [1, 2, 3, 5][: i % 4 + 1]
        w.add_key_value(f"test.array{i}", values, gguf.GGUFValueType.ARRAY, sub_type=vtype)
    w.add_array("test.strings", ["", "a", "ünï", "日本"])
    w.add_array("test.zero_bytes", ["a\0b", "\0", "c"])
    w.add_array("test.empty", [])
    w.add_string("test.text", "hello")
    w.add_float32("test.float", 0.1)
    w.add_bool("test.flag", True)
    w.add_uint64("test.big", 2**63)
    w.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("h", np.arange(64, dtype=np.float16).reshape(2, 32))
    w.add_tensor("q", gguf.quants.quantize(np.ones((2, 32), np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_contents(open_gguf(str(path)), gguf.GGUFReader(path))


def test_ggml_block_sizes_match_the_gguf_package():
    from llaisys.models.loaders.gguf_file import BLOCK_SIZES, GGMLType

    for t, sizes in BLOCK_SIZES.items():
        assert gguf.GGMLQuantizationType[GGMLType(t).name] == t
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)] == sizes
