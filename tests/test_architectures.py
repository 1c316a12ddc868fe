"""The architecture registry: Llama and Qwen2 are found by name, an unknown name is a clear
error, and registering one more Architecture is all a new architecture needs to load."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import hf_to_gguf_tensors, random_hf_model, write_gguf  # noqa: E402

from llaisys.models import ModelLoadError, architectures, load_model  # noqa: E402
from llaisys.models.layers import decoder_layer  # noqa: E402
from llaisys.models.weights import HF_NAMES, NameTable  # noqa: E402

TWIN = "llama_twin"  # a Llama under another model_type, registered by the tests that use it


def test_registry_finds_llama_and_qwen2():
    assert {"llama", "qwen2"} <= set(architectures.names())
    for name in ("llama", "qwen2"):
        arch = architectures.get(name)
        assert arch.name == name
        assert arch.decoder_layer is decoder_layer
    assert architectures.get("qwen2").hf_config({}, "config.json", {}) == {
        "attention_bias": True, "attention_out_bias": False, "hidden_act": "silu"}
    assert architectures.get("llama").hf_config({"attention_bias": True}, "config.json", {}) == {
        "attention_bias": True, "attention_out_bias": True, "hidden_act": "silu"}
    assert architectures.get("qwen2").gguf_row_fix("layers.0.q", None) is None


@pytest.mark.parametrize("name", ["mamba", "", None, 3, ["llama"]])
def test_unknown_name_lists_the_supported_ones(name):
    with pytest.raises(ModelLoadError, match=re.escape(f"unsupported architecture {name!r}; expected one of "
                                                       f"{', '.join(architectures.names())}")):
        architectures.get(name)
    message = f"config.json: unsupported model_type {name!r}; expected one of {', '.join(architectures.names())}"
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        architectures.get(name, "config.json", key="model_type")


def test_register_refuses_a_taken_name():
    with pytest.raises(ValueError, match="'llama' is already registered"):
        architectures.register(architectures.get("llama"))
    with pytest.raises(ValueError, match="'no_such' is not registered"):
        architectures.unregister("no_such")


@pytest.fixture
def twin():
    """A copy of the Llama architecture registered as ``TWIN``, removed afterwards."""
    arch = architectures.register(dataclasses.replace(architectures.get("llama"), name=TWIN))
    yield arch
    architectures.unregister(TWIN)


def _retyped(folder, out, model_type: str):
    """A copy of model folder ``folder`` at ``out`` whose config.json says ``model_type``."""
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config["model_type"] = model_type
    (out / "config.json").write_text(json.dumps(config))
    return out


def _logits(model, ids: list[int]) -> np.ndarray:
    return model.forward(ids, model.new_cache(64), all_logits=True)  # (S, V)


IDS = [5, 17, 3, 250, 9, 42, 7, 199]


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A random-weight Llama (q/k/v/o biases, untied head) saved by transformers; with the model."""
    hf = random_hf_model("llama", 11, attention_bias=True, tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder)
    return hf, folder


def test_one_registration_makes_a_new_model_type_load(llama_folder, tmp_path):
    _, folder = llama_folder
    twin_folder = _retyped(folder, tmp_path / TWIN, TWIN)
    with pytest.raises(ModelLoadError, match=f"unsupported model_type '{TWIN}'; expected one of gemma3, gemma3_text, llama, mistral, qwen2, qwen2_5_vl_text, qwen2_vl_text, qwen2vl, qwen3"):
        load_model(twin_folder)
    arch = architectures.register(dataclasses.replace(architectures.get("llama"), name=TWIN))
    try:
        assert architectures.get(TWIN) is arch and TWIN in architectures.names()
        ours, want = load_model(twin_folder), load_model(folder)
        assert ours.config.architecture == TWIN and ours.config.attention_out_bias
        np.testing.assert_array_equal(_logits(ours, IDS), _logits(want, IDS))
    finally:
        architectures.unregister(TWIN)
    with pytest.raises(ModelLoadError, match=f"unsupported model_type '{TWIN}'"):
        load_model(twin_folder)


def test_registered_gguf_architecture_uses_its_fixups(twin, llama_folder, tmp_path):
    """A GGUF whose general.architecture (and key prefix) is the new name loads with Llama's
    bias rule and q/k row fix, as the same tensors do under "llama"."""
    hf, _ = llama_folder
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    tensors = hf_to_gguf_tensors(state, hf.config, "llama")  # stored with llama.cpp's q/k permutation
    write_gguf(tmp_path / "llama.gguf", "llama", tensors, config=hf.config)
    write_gguf(tmp_path / "twin.gguf", TWIN, tensors, config=hf.config)
    ours, want = load_model(tmp_path / "twin.gguf"), load_model(tmp_path / "llama.gguf")
    assert ours.config.architecture == TWIN and ours.config.attention_bias and ours.config.attention_out_bias
    np.testing.assert_array_equal(_logits(ours, IDS), _logits(want, IDS))


def test_registered_architecture_uses_its_own_name_table(llama_folder, tmp_path):
    """An architecture with its own tensor names (GPT-style "transformer.h.{i}.") needs only its table."""
    _, folder = llama_folder
    renamed = {f"attn.{k.split('.', 1)[1]}" if k.startswith("self_attn.") else k: v for k, v in HF_NAMES.layer.items()}
    table = NameTable({"transformer.wte.weight": "embed", "transformer.ln_f.weight": "norm",
                       "lm_head.weight": "lm_head"}, "transformer.h.{i}.", renamed, HF_NAMES.ignored,
                      HF_NAMES.layer_count_key)
    out = _retyped(folder, tmp_path / "renamed", "renamed_llama")
    (out / "model.safetensors").unlink()
    save_file({table.to_file(HF_NAMES.to_ours(k)): v for k, v in load_file(folder / "model.safetensors").items()},
              out / "model.safetensors", metadata={"format": "pt"})
    architectures.register(dataclasses.replace(architectures.get("llama"), name="renamed_llama", hf_names=table))
    try:
        ours, want = load_model(out), load_model(folder)
        np.testing.assert_array_equal(_logits(ours, IDS), _logits(want, IDS))
        (out / "model.safetensors").unlink()
        save_file(load_file(folder / "model.safetensors"), out / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.[a-z_.0-9]+'; "
                                                 r"it is not part of a renamed_llama decoder"):
            load_model(out)
    finally:
        architectures.unregister("renamed_llama")
