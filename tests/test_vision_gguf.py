"""A SmolVLM as llama.cpp ships it: a GGUF text model and its GGUF ``mmproj`` vision tower,
written here from the random-weight transformers model (names from the gguf package's own
tensor map, as llama.cpp's converter names them). Greedy continuations of an image prompt equal
transformers' token for token; a broken mmproj is a clear error naming the file."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import SMOLVLM_TEMPLATE, SMOLVLM_TOKENS, random_image, write_smollm2_text_gguf
from llaisys.engine import chat, generate
from llaisys.generation import GenerationConfig
from llaisys.generation.prompts import image_prompt
from llaisys.models import ModelLoadError, load_model

PROMPT = "User:<image>Describe this.<end_of_utterance>\nAssistant:"
GREEDY = GenerationConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def _write_mmproj(path, hf, *, projector_type="idefics3", drop=(), extra=None) -> None:
    """The mmproj GGUF as llama.cpp's converter writes SmolVLM's (float32 tensors)."""
    import gguf

    vision = hf.config.vision_config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", projector_type)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.embedding_length", vision.hidden_size)
    w.add_uint32("clip.vision.feed_forward_length", vision.intermediate_size)
    w.add_uint32("clip.vision.block_count", vision.num_hidden_layers)
    w.add_uint32("clip.vision.attention.head_count", vision.num_attention_heads)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", vision.layer_norm_eps)
    w.add_uint32("clip.vision.image_size", vision.image_size)
    w.add_uint32("clip.vision.patch_size", vision.patch_size)
    w.add_uint32("clip.vision.preproc_image_size", 128)
    w.add_uint32("clip.vision.projector.scale_factor", hf.config.scale_factor)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_bool("clip.use_gelu", True)
    for name, value in hf.state_dict().items():
        if not name.startswith(("model.vision_model.", "model.connector.")):
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        if gname not in drop:
            w.add_tensor(gname, value.float().numpy())
    for gname, value in (extra or {}).items():
        w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def hf_model(tiny_smolvlm):
    from transformers import Idefics3ForConditionalGeneration

    torch.set_num_threads(2)
    return Idefics3ForConditionalGeneration.from_pretrained(tiny_smolvlm).eval()


@pytest.fixture(scope="module")
def gguf_pair(hf_model, smollm2_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smolvlm-gguf")
    write_smollm2_text_gguf(folder / "SmolVLM-tiny-F32.gguf", hf_model, "llama", "model.text_model.", SMOLVLM_TOKENS,
                            SMOLVLM_TEMPLATE)
    _write_mmproj(folder / "mmproj-SmolVLM-tiny-F32.gguf", hf_model)
    return folder / "SmolVLM-tiny-F32.gguf", folder / "mmproj-SmolVLM-tiny-F32.gguf"


def test_gguf_and_mmproj_equal_transformers(gguf_pair, hf_model, tiny_smolvlm):
    from transformers import AutoTokenizer, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    text_path, _ = gguf_pair
    model = load_model(str(text_path))  # its mmproj found beside it
    assert model.vision is not None and model.info()["mmproj"].endswith("mmproj-SmolVLM-tiny-F32.gguf")
    processor = Idefics3Processor(image_processor=Idefics3ImageProcessorPil.from_pretrained(tiny_smolvlm),
                                  tokenizer=AutoTokenizer.from_pretrained(tiny_smolvlm), image_seq_len=16)
    rng = np.random.default_rng(21)
    for size in ((90, 60), (200, 130)):
        image = random_image(rng, *size)
        inputs = processor(text=[PROMPT], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            want = hf_model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        ids, _ = image_prompt(model, PROMPT, [image])
        assert ids == inputs["input_ids"][0].tolist()
        assert generate(model, PROMPT, GREEDY, images=[image]).token_ids == want.tolist()
    # the chat template writes the same turn after its "<|im_start|>"
    inputs = processor(text=["<|im_start|>" + PROMPT], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        want = hf_model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    reply = chat(model, [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": "Describe this."}]}], GREEDY)
    assert reply.prompt_tokens == inputs["input_ids"].shape[1]
    assert reply.token_ids == want.tolist()


def test_mmproj_named_explicitly_and_errors(gguf_pair, hf_model, tmp_path):
    text_path, mmproj = gguf_pair
    alone = tmp_path / "text.gguf"
    alone.write_bytes(text_path.read_bytes())
    assert load_model(str(alone)).vision is None  # no mmproj beside it: a text model
    assert load_model(str(alone), mmproj=str(mmproj)).vision is not None
    with pytest.raises(FileNotFoundError, match="mmproj"):
        load_model(str(alone), mmproj=str(tmp_path / "absent.gguf"))
    bad = tmp_path / "mmproj-bad.gguf"
    _write_mmproj(bad, hf_model, projector_type="pixtral")
    with pytest.raises(ModelLoadError, match="clip.projector_type 'pixtral' is not supported"):
        load_model(str(alone), mmproj=str(bad))
    _write_mmproj(bad, hf_model, drop={"v.blk.1.ffn_down.weight"})
    with pytest.raises(ModelLoadError, match="missing vision tensor 'v.blk.1.ffn_down.weight'"):
        load_model(str(alone), mmproj=str(bad))
    _write_mmproj(bad, hf_model, extra={"v.blk.0.ls1.weight": np.ones(32, np.float32)})
    with pytest.raises(ModelLoadError, match="'v.blk.0.ls1.weight' is not applied"):
        load_model(str(alone), mmproj=str(bad))
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ModelLoadError, match="mmproj-bad.gguf"):
        load_model(str(alone), mmproj=str(bad))
