"""Mutated model files: whatever is wrong with a GGUF file or a model folder, loading it either
succeeds or raises ModelLoadError, never another exception, a crash or a hang.

Every case is derived from a fixed seed: a small GGUF (quantized and float tensors, a byte-level
BPE tokenizer, a chat template) and a small sharded folder are mutated by byte flips,
truncations and replaced values of the header's counts, types and offsets or of the JSON files'
keys. A failing case names its seed, so it can be replayed on its own.
"""
from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest

import gguf
from safetensors.numpy import save_file
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from llaisys.models import ModelLoadError, load_model

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN from corrupt scales

Q = gguf.GGMLQuantizationType
D, I, V, H, KH, DH = 32, 64, 40, 4, 2, 8  # hidden, MLP width, vocabulary, heads, kv heads, head dim
MERGES = ["a b", "c d", "Ġ a", "ab c", "Ġa b"]
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *"abcdeĠ", "ab", "cd", "Ġa", "abc", "Ġab"]
TOKENS += [f"t{i}" for i in range(V - len(TOKENS))]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# Values a corrupt header or JSON file may hold instead of the real one.
INTEGERS = [0, 1, 2, 3, 7, 31, 32, 33, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
JSON_VALUES = [None, True, False, 0, -1, 1, 3, 2**63, 10**12, 1.5, float("nan"), "x", "32", "../x", "/etc/passwd",
               [], [1], [1.5], ["a"], {}, {"content": 5}, {"a": [1]}]


def _tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, Q]]:
    """The GGUF tensors of a one-layer Llama model (name -> float values and stored type)."""
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return {"token_embd.weight": (f32(V, D), Q.Q8_0), "output_norm.weight": (f32(D), Q.F32),
            "output.weight": (f32(V, D), Q.F16), "blk.0.attn_norm.weight": (f32(D), Q.F32),
            "blk.0.attn_q.weight": (f32(H * DH, D), Q.Q4_1), "blk.0.attn_k.weight": (f32(KH * DH, D), Q.F32),
            "blk.0.attn_v.weight": (f32(KH * DH, D), Q.F32), "blk.0.attn_output.weight": (f32(D, H * DH), Q.F32),
            "blk.0.ffn_norm.weight": (f32(D), Q.F32), "blk.0.ffn_gate.weight": (f32(I, D), Q.F32),
            "blk.0.ffn_up.weight": (f32(I, D), Q.F32), "blk.0.ffn_down.weight": (f32(D, I), Q.F32)}


T = gguf.GGUFValueType
BASE_METADATA = {  # key -> (value, type, array item type)
    "llama.block_count": (1, T.UINT32, None), "llama.context_length": (64, T.UINT32, None),
    "llama.embedding_length": (D, T.UINT32, None), "llama.feed_forward_length": (I, T.UINT32, None),
    "llama.attention.head_count": (H, T.UINT32, None), "llama.attention.head_count_kv": (KH, T.UINT32, None),
    "llama.rope.freq_base": (10000.0, T.FLOAT32, None), "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32, None),
    "llama.rope.dimension_count": (DH, T.UINT32, None), "tokenizer.ggml.model": ("gpt2", T.STRING, None),
    "tokenizer.ggml.pre": ("qwen2", T.STRING, None), "tokenizer.ggml.tokens": (TOKENS, T.ARRAY, T.STRING),
    "tokenizer.ggml.token_type": ([3, 3, 3] + [1] * (V - 3), T.ARRAY, T.INT32),
    "tokenizer.ggml.merges": (MERGES, T.ARRAY, T.STRING), "tokenizer.ggml.bos_token_id": (1, T.UINT32, None),
    "tokenizer.ggml.eos_token_id": (2, T.UINT32, None), "tokenizer.ggml.add_bos_token": (False, T.BOOL, None),
    "tokenizer.chat_template": (TEMPLATE, T.STRING, None),
}
# Values of other types and sizes that a metadata key may hold instead (None: the key is left out).
METADATA_VALUES = [None, (0, T.UINT32, None), (2**32, T.UINT64, None), (2**63, T.UINT64, None), (-1, T.INT32, None),
                   (1.5, T.FLOAT32, None), (float("nan"), T.FLOAT64, None), ("x", T.STRING, None), (True, T.BOOL, None),
                   ([1, 2], T.ARRAY, T.INT32), (["a b", "x"], T.ARRAY, T.STRING), ([1.5], T.ARRAY, T.FLOAT32),
                   ([0], T.ARRAY, T.UINT8), (["a"] * V, T.ARRAY, T.STRING), (list(range(V)), T.ARRAY, T.UINT64)]


def _write_gguf(path, metadata: dict = BASE_METADATA) -> None:
    """A one-layer Llama GGUF with a byte-level BPE tokenizer and ``metadata`` (key -> (value,
    type, array item type); a value of None leaves the key out)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, item in metadata.items():
        if item is not None:
            w.add_key_value(key, item[0], item[1], sub_type=item[2])
    for name, (values, qtype) in _tensors(np.random.default_rng(0)).items():
        w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _header_fields(path) -> list[tuple[str, str, int, int]]:
    """(kind, label, byte offset, size) of each integer in the header that gives a count, a
    length, a type, a dimension, an offset or a number, as the stock reader finds them; kind
    is "type" for value and tensor types, else "int". Arrays contribute their first items."""
    reader = gguf.GGUFReader(str(path))
    base = reader.data.ctypes.data
    out = []

    def add(kind: str, label: str, part: np.ndarray) -> None:
        for k in range(min(len(part), 4)):
            if part.dtype.kind in "iu" and part.itemsize in (4, 8):
                out.append((kind, f"{label}[{k}]", part.ctypes.data - base + k * part.itemsize, part.itemsize))
    for name, f in reader.fields.items():
        for k, part in enumerate(f.parts[:8]):
            is_type = k == 2 or (k == 3 and f.types[:1] == [gguf.GGUFValueType.ARRAY])
            add("type" if is_type else "int", f"{name}.part{k}", part)
    for t in reader.tensors:
        for label, part in zip(("name_length", "name", "n_dims", "dims", "type", "offset"), t.field.parts):
            if label != "name":
                add("type" if label == "type" else "int", f"{t.name}.{label}", part)
    return out


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory):
    """The unmodified file's bytes and its header fields; the file itself loads."""
    path = tmp_path_factory.mktemp("fuzz") / "base.gguf"
    _write_gguf(path)
    load_model(path)
    return path.read_bytes(), _header_fields(path)


def _outcome(path) -> str:
    """"ok" or "refused"; any other exception fails the test that called it."""
    try:
        load_model(path)
    except ModelLoadError as exc:
        assert str(path) in str(exc) or path.name in str(exc), f"the message does not name the file: {exc}"
        return "refused"
    return "ok"


def _flip_bytes(data: bytes, rng: random.Random) -> bytes:
    """A few random bits flipped, mostly in the header (flips in tensor data only change weights)."""
    out = bytearray(data)
    header_end = min(len(data), 1200)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(header_end) if rng.random() < 0.85 else rng.randrange(len(data))
        out[at] ^= 1 << rng.randrange(8)
    return bytes(out)


def _set_int(data: bytes, offset: int, size: int, value: int) -> bytes:
    out = bytearray(data)
    out[offset:offset + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
    return bytes(out)


def _replace_field(data: bytes, fields: list, rng: random.Random) -> bytes:
    """One header integer given another value: for a type, another type id; for a count, a
    length, a dimension, an offset or a number, a boundary value, a neighbour, or the value of
    another field of the same size."""
    kind, _, offset, size = rng.choice(fields)
    old = int.from_bytes(data[offset:offset + size], "little")
    if kind == "type":
        value = rng.randrange(40)
    else:
        same_size = [int.from_bytes(data[o:o + s], "little") for _, _, o, s in fields if s == size]
        value = rng.choice([*INTEGERS, old + 1, old - 1, old * 2, old + 32, rng.choice(same_size)])
    return _set_int(data, offset, size, value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(60))
def test_gguf_byte_flips(tmp_path, base_gguf, seed):
    data, _ = base_gguf
    path = tmp_path / f"flip{seed}.gguf"
    path.write_bytes(_flip_bytes(data, random.Random(seed)))
    _outcome(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(30))
def test_gguf_truncations(tmp_path, base_gguf, seed):
    data, fields = base_gguf
    rng = random.Random(seed)
    # a cut inside the header, at a field boundary, or anywhere in the tensor data
    cut = [rng.randrange(len(data)), rng.choice(fields)[2], rng.randrange(min(len(data), 600))][seed % 3]
    path = tmp_path / f"cut{seed}.gguf"
    path.write_bytes(data[:cut])
    assert _outcome(path) == "refused"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(120))
def test_gguf_header_values(tmp_path, base_gguf, seed):
    data, fields = base_gguf
    rng = random.Random(seed)
    for _ in range(1 + seed % 2):
        data = _replace_field(data, fields, rng)
    path = tmp_path / f"field{seed}.gguf"
    path.write_bytes(data)
    _outcome(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(20))
def test_gguf_tensor_offsets(tmp_path, base_gguf, seed):
    """Tensor offsets moved onto, into or past their neighbours are refused."""
    data, fields = base_gguf
    offsets = [(label, o, s) for _, label, o, s in fields if label.endswith(".offset[0]")]
    rng = random.Random(seed)
    label, offset, size = rng.choice(offsets)
    old = int.from_bytes(data[offset:offset + size], "little")
    other = int.from_bytes(data[rng.choice(offsets)[1]:][:size], "little")
    value = [other, old + 1, old + 32, old - 32, other + 64][seed % 5]
    path = tmp_path / f"offset{seed}.gguf"
    path.write_bytes(_set_int(data, offset, size, value))
    assert value == old or _outcome(path) == "refused", label


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(80))
def test_gguf_metadata_types(tmp_path, seed):
    """Metadata keys holding values of other types (strings for counts, floats and arrays for
    token ids, integers for the vocabulary, 2**63 layers) or left out."""
    rng = random.Random(seed)
    metadata = dict(BASE_METADATA)
    for _ in range(1 + seed % 2):
        metadata[rng.choice(sorted(BASE_METADATA))] = rng.choice(METADATA_VALUES)
    path = tmp_path / f"meta{seed}.gguf"
    _write_gguf(path, metadata)
    _outcome(path)


# ---- model folders ---------------------------------------------------------------------
HF_CONFIG = {"model_type": "llama", "vocab_size": V, "hidden_size": D, "intermediate_size": I,
             "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": KH,
             "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 1, "eos_token_id": [2]}
TOKENIZER_CONFIG = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "chat_template": TEMPLATE}
GENERATION_CONFIG = {"eos_token_id": [2, 0], "temperature": 0.7}


def _hf_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    state = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for layer in range(HF_CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        state.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                      p + "self_attn.q_proj.weight": (H * DH, D), p + "self_attn.k_proj.weight": (KH * DH, D),
                      p + "self_attn.v_proj.weight": (KH * DH, D), p + "self_attn.o_proj.weight": (D, H * DH),
                      p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
                      p + "mlp.down_proj.weight": (D, I)})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in state.items()}


def _write_base_folder(folder) -> None:
    """A sharded Llama folder: config, two safetensors shards and their index, a BPE tokenizer,
    tokenizer_config.json and generation_config.json."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    state = _hf_state(np.random.default_rng(1))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({n: state[n] for n in part}, str(folder / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    vocab = {t: i for i, t in enumerate(TOKENS)}
    tok = Backend(models.BPE(vocab, [tuple(m.split(" ")) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """The unmodified folder; it loads."""
    folder = tmp_path_factory.mktemp("fuzz") / "base"
    _write_base_folder(folder)
    load_model(folder)
    return folder


def _copy(base_folder, tmp_path, name: str):
    folder = tmp_path / name
    shutil.copytree(base_folder, folder)
    return folder


def _nested(value, rng: random.Random):
    """``value`` with one key's value replaced or removed, at the top or one level down."""
    if isinstance(value, dict) and value:
        key = rng.choice(sorted(value))
        out = dict(value)
        if isinstance(out[key], (dict, list)) and out[key] and rng.random() < 0.3:
            out[key] = _nested(out[key], rng)
        elif rng.random() < 0.15:
            del out[key]
        else:
            out[key] = rng.choice(JSON_VALUES)
        return out
    if isinstance(value, list) and value:
        out = list(value)
        out[rng.randrange(len(out))] = rng.choice(JSON_VALUES)
        return out
    return rng.choice(JSON_VALUES)


def _mutate_text(data: bytes, rng: random.Random) -> bytes:
    """A JSON file's bytes cut short, bit-flipped, made invalid UTF-8, or nested very deeply."""
    kind = rng.randrange(4)
    if kind == 0:
        return data[:rng.randrange(len(data))]
    if kind == 1:
        out = bytearray(data)
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out)
    if kind == 2:
        at = rng.randrange(len(data))
        return data[:at] + b"\xff\xfe" + data[at:]
    return b"[" * 100_000 + b"]" * 100_000


JSON_FILES = ["config.json", "tokenizer_config.json", "generation_config.json", "model.safetensors.index.json"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(90))
def test_folder_json_values(tmp_path, base_folder, seed):
    rng = random.Random(seed)
    folder = _copy(base_folder, tmp_path, f"json{seed}")
    file = folder / JSON_FILES[seed % len(JSON_FILES)]
    file.write_text(json.dumps(_nested(json.loads(file.read_text()), rng)))
    _outcome(folder)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(40))
def test_folder_file_bytes(tmp_path, base_folder, seed):
    """JSON files, the tokenizer, a chat template file and shards with damaged bytes, or a
    folder where a file should be."""
    rng = random.Random(seed)
    folder = _copy(base_folder, tmp_path, f"bytes{seed}")
    names = [*JSON_FILES, "tokenizer.json", "chat_template.jinja", "model-00001-of-00002.safetensors"]
    file = folder / names[seed % len(names)]
    if seed % 10 == 9:
        file.unlink(missing_ok=True)
        file.mkdir()
    elif file.name == "chat_template.jinja":
        file.write_bytes(rng.choice([b"\xff\xfe{{ x }}", TEMPLATE.encode(), b"{% if %}"]))
    elif file.suffix == ".safetensors":
        data = bytearray(file.read_bytes())
        if rng.random() < 0.5:
            data = data[:rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(min(len(data), 600))] ^= 1 << rng.randrange(8)
        file.write_bytes(bytes(data))
    else:
        file.write_bytes(_mutate_text(file.read_bytes(), rng))
    _outcome(folder)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(12))
def test_folder_shard_index_paths(tmp_path, base_folder, seed):
    """An index naming files outside the folder, non-strings or absent files is refused."""
    folder = _copy(base_folder, tmp_path, f"index{seed}")
    index = folder / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    name = random.Random(seed).choice(sorted(content["weight_map"]))
    bad = ["../base/model-00001-of-00002.safetensors", str(folder / "model-00001-of-00002.safetensors"),
           "/etc/passwd", "", 7, None, ["x"], "absent.safetensors", "a/../../x", "\0", {"a": 1}, 1.5][seed]
    content["weight_map"][name] = bad
    index.write_text(json.dumps(content))
    assert _outcome(folder) == "refused"
