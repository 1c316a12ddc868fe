"""Gemma 3 with images as llama.cpp ships it: a GGUF text model and its GGUF ``mmproj``, written
here from a random-weight transformers Gemma3ForConditionalGeneration the way llama.cpp's
converter writes them (norms stored as 1 + w, the soft-embedding norm too; tensor names from
the gguf package's own maps; the Gemma 3 tokenizer of the bundled 270M GGUF with the image
token appended). Greedy continuations of an image prompt equal transformers' token for token."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from conftest import random_image, sharpen_gemma3
from llaisys.engine import generate
from llaisys.generation import GenerationConfig
from llaisys.generation.prompts import image_prompt
from llaisys.models import load_model

GREEDY = GenerationConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = "<start_of_turn>user\nLook <start_of_image> and tell me.<end_of_turn>\n<start_of_turn>model\n"
# transformers' Gemma 3 text names -> llama.cpp's, per layer
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


@pytest.fixture(scope="module")
def hf_folder(tiny_gemma3_vlm, tmp_path_factory):
    """A random Gemma 3 VLM whose layers are all sliding (as a GGUF of 3 layers reads them:
    every sixth layer global) and whose attention scale is its head size's (as a GGUF says it),
    with the tiny folder's tokenizer and image processor."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    folder = tmp_path_factory.mktemp("gemma3-vlm-sliding")
    config = Gemma3Config.from_pretrained(tiny_gemma3_vlm)
    config.text_config.layer_types = ["sliding_attention"] * 3
    config.text_config.query_pre_attn_scalar = config.text_config.head_dim  # what a GGUF's key_length says
    torch.manual_seed(1)
    sharpen_gemma3(Gemma3ForConditionalGeneration(config).eval()).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja"):
        if (tiny_gemma3_vlm / name).exists():
            shutil.copy(tiny_gemma3_vlm / name, folder / name)
    return folder


def _write_text(path, model, gemma3_gguf_path) -> None:
    import gguf

    text = model.config.text_config
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in (("context_length", text.max_position_embeddings), ("embedding_length", text.hidden_size),
                       ("block_count", text.num_hidden_layers), ("feed_forward_length", text.intermediate_size),
                       ("attention.head_count", text.num_attention_heads),
                       ("attention.head_count_kv", text.num_key_value_heads),
                       ("attention.key_length", text.head_dim), ("attention.value_length", text.head_dim),
                       ("attention.sliding_window", text.sliding_window)):
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", text.rms_norm_eps)
    w.add_float32("gemma3.rope.freq_base", 1e6)
    reader = gguf.GGUFReader(str(gemma3_gguf_path))
    f = reader.fields
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data]
    scores = [float(f["tokenizer.ggml.scores"].parts[i][0]) for i in f["tokenizer.ggml.scores"].data]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre(bytes(f["tokenizer.ggml.pre"].parts[-1]).decode())
    pad = text.vocab_size - len(tokens) - 1  # the converter pads the vocabulary to the embedding's rows
    w.add_token_list(tokens + ["<image_soft_token>"] + [f"<pad_{i}>" for i in range(pad)])
    w.add_token_scores(scores + [0.0] * (1 + pad))
    w.add_token_types(types + [gguf.TokenType.CONTROL] + [gguf.TokenType.UNUSED] * pad)
    for key in ("bos", "eos", "unknown", "padding"):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", int(f[f"tokenizer.ggml.{key}_token_id"].parts[-1][0]))
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    for name, value in model.state_dict().items():
        if not name.startswith("model.language_model."):
            continue
        rest = name[len("model.language_model."):]
        array = value.float().numpy()
        if rest == "embed_tokens.weight":
            gname = "token_embd.weight"
        elif rest == "norm.weight":
            gname = "output_norm.weight"
        else:
            _, layer, stem = rest.split(".", 2)
            module, _, kind = stem.rpartition(".")
            gname = f"blk.{layer}.{LAYER[module]}.{kind}"
        if gname.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + w
            array = array + np.float32(1.0)
        w.add_tensor(gname, array.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_mmproj(path, model) -> None:
    import gguf

    vision = model.config.vision_config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.has_vision_encoder", True)
    for key, value in (("embedding_length", vision.hidden_size), ("feed_forward_length", vision.intermediate_size),
                       ("block_count", vision.num_hidden_layers), ("attention.head_count", vision.num_attention_heads),
                       ("image_size", vision.image_size), ("patch_size", vision.patch_size)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", vision.layer_norm_eps)
    w.add_uint32("clip.vision.projector.scale_factor", vision.image_size // vision.patch_size // 4)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    for name, value in model.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            continue
        array = value.float().numpy()
        hf = name.replace("model.vision_tower.", "vision_tower.vision_model.").replace(
            "model.multi_modal_projector.", "multi_modal_projector.").replace("_weight", ".weight")
        gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        if "soft_emb_norm" in gname:
            array = array + np.float32(1.0)  # as llama.cpp's converter corrects it
        w.add_tensor(gname, array.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def pair(hf_folder, gemma3_gguf_path, tmp_path_factory):
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(hf_folder).eval()
    out = tmp_path_factory.mktemp("gemma3-gguf")
    _write_text(out / "gemma-3-tiny-F32.gguf", model, gemma3_gguf_path)
    _write_mmproj(out / "mmproj-gemma-3-tiny-F32.gguf", model)
    return model, out / "gemma-3-tiny-F32.gguf"


def test_gguf_and_mmproj_equal_transformers(pair, hf_folder):
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    torch.set_num_threads(2)
    hf, text_path = pair
    tokenizer = AutoTokenizer.from_pretrained(hf_folder, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(hf_folder),
                                tokenizer=tokenizer, image_seq_length=16)
    model = load_model(str(text_path))
    assert model.vision is not None and model.vision.family == "gemma3"
    rng = np.random.default_rng(30)
    for size in ((64, 64), (90, 40)):
        image = random_image(rng, *size)
        inputs = processor(text=[PROMPT], images=[image], return_tensors="pt")
        with torch.no_grad():
            want = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        ids, _ = image_prompt(model, PROMPT, [image])
        assert ids == inputs["input_ids"][0].tolist()
        assert generate(model, PROMPT, GREEDY, images=[image]).token_ids == want.tolist()
