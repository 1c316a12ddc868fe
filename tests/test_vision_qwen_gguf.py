"""A Qwen2.5-VL as llama.cpp ships it: a GGUF text model (``general.architecture`` "qwen2vl",
Hugging Face row order, rope sections in ``qwen2vl.rope.dimension_sections``) and an mmproj of
projector type "qwen2.5vl_merger" (the Conv3d split into its two frames, qkv split into q, k and
v), written here from the random-weight transformers model with the gguf package's own names.
The tower's rows and greedy continuations of an image prompt equal transformers'; a broken
pair is a clear error naming the file and the key or tensor."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import QWEN_VL_TEMPLATE, QWEN_VL_TOKENS, random_image, write_smollm2_text_gguf
from llaisys.engine import generate
from llaisys.generation import GenerationConfig
from llaisys.generation.prompts import image_prompt
from llaisys.models import ModelLoadError, load_model
from test_vision_qwen_model import PROMPT, _reference

GREEDY = GenerationConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def _write(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_text(path, hf, sections=(2, 3, 3, 0)) -> None:
    """The text model as llama.cpp's converter writes it (``sections`` None: the key left out)."""
    write_smollm2_text_gguf(path, hf, "qwen2vl", "model.language_model.", QWEN_VL_TOKENS, QWEN_VL_TEMPLATE,
                            sections)


def _vision_tensors(hf) -> dict[str, np.ndarray]:
    """The vision model's tensors under llama.cpp's names, split as its converter splits them."""
    import gguf

    vision = hf.config.vision_config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.depth)
    out = {}
    for name, value in hf.state_dict().items():
        if not name.startswith("model.visual."):
            continue
        name, arr = name[len("model."):], value.float().numpy()
        if name == "visual.patch_embed.proj.weight":  # (D, C, 2, p, p): one 2-D kernel per frame
            out["v.patch_embd.weight"], out["v.patch_embd.weight.1"] = arr[:, :, 0], arr[:, :, 1]
            continue
        parts = {name: arr}
        if ".attn.qkv." in name:
            parts = {name.replace(".qkv.", f".{x}."): part for x, part in zip("qkv", np.split(arr, 3))}
        for part, part_arr in parts.items():
            gname = names.get_name(part, try_suffixes=(".weight", ".bias"))
            assert gname is not None, part
            out[gname] = part_arr
    return out


def _write_mmproj(path, hf, processor, *, drop=(), extra=None, meta=None) -> None:
    """The mmproj GGUF as llama.cpp's converter writes Qwen2.5-VL's (float32 tensors), plus the
    window size, merge size and pixel limits of this small model (gguf-py's keys for them)."""
    import gguf

    vision = hf.config.vision_config
    w = gguf.GGUFWriter(str(path), "clip")
    values = {"clip.projector_type": "qwen2.5vl_merger", "clip.has_vision_encoder": True,
              "clip.vision.projection_dim": vision.out_hidden_size, "clip.vision.image_size": 560,
              "clip.vision.patch_size": vision.patch_size, "clip.vision.embedding_length": vision.hidden_size,
              "clip.vision.feed_forward_length": vision.intermediate_size, "clip.vision.block_count": vision.depth,
              "clip.vision.attention.head_count": vision.num_heads, "clip.use_silu": True,
              "clip.vision.n_wa_pattern": vision.fullatt_block_indexes[0] + 1,
              "clip.vision.attention.layer_norm_epsilon": 1e-6, "clip.vision.window_size": vision.window_size,
              "clip.vision.spatial_merge_size": vision.spatial_merge_size,
              "clip.vision.image_min_pixels": processor.size["shortest_edge"],
              "clip.vision.image_max_pixels": processor.size["longest_edge"],
              "clip.vision.image_mean": list(processor.image_mean), "clip.vision.image_std": list(processor.image_std),
              **(meta or {})}
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, arr in {**_vision_tensors(hf), **(extra or {})}.items():
        if name not in drop:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    _write(w)


@pytest.fixture(scope="module")
def hf_qwen(tiny_qwen25_vl):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.set_num_threads(2)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen25_vl).eval()
    processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_qwen25_vl)
    return model, AutoTokenizer.from_pretrained(tiny_qwen25_vl), processor


@pytest.fixture(scope="module")
def gguf_pair(hf_qwen, smollm2_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen25-vl-gguf")
    _write_text(folder / "Qwen2.5-VL-tiny-F32.gguf", hf_qwen[0])
    _write_mmproj(folder / "mmproj-Qwen2.5-VL-tiny-F32.gguf", hf_qwen[0], hf_qwen[2])
    return folder / "Qwen2.5-VL-tiny-F32.gguf", folder / "mmproj-Qwen2.5-VL-tiny-F32.gguf"


@pytest.fixture(scope="module")
def qwen(gguf_pair):
    return load_model(str(gguf_pair[0]))  # its mmproj found beside it


def test_gguf_and_mmproj_equal_transformers(qwen, gguf_pair, hf_qwen):
    model, _, processor = hf_qwen
    assert qwen.vision is not None and qwen.info()["mmproj"] == str(gguf_pair[1])
    assert qwen.config.arch_args.mrope_section == [2, 3, 3]
    rng = np.random.default_rng(5)
    for size in ((56, 56), (120, 70)):
        image = random_image(rng, *size)
        pixels = processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            rows = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"]).pooler_output
        rows = torch.cat(list(rows)) if isinstance(rows, (list, tuple)) else rows
        np.testing.assert_allclose(qwen.vision.embed(image).rows, rows.numpy(), atol=3e-5, rtol=0)
        want_prompt, want = _reference(hf_qwen, PROMPT, [image])
        assert image_prompt(qwen, PROMPT, [image])[0] == want_prompt
        assert generate(qwen, PROMPT, GREEDY, images=[image]).token_ids == want


def test_text_gguf_alone_equals_transformers(gguf_pair, hf_qwen, tmp_path):
    alone = tmp_path / "text.gguf"
    alone.write_bytes(gguf_pair[0].read_bytes())
    model = load_model(str(alone))
    assert model.vision is None and model.config.architecture == "qwen2vl"
    text = "<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n"
    want_prompt, want = _reference(hf_qwen, text, [])
    result = generate(model, text, GREEDY)
    assert result.prompt_tokens == len(want_prompt) and result.token_ids == want


@pytest.mark.parametrize("sections, match", [
    (None, r"qwen2vl\.rope\.dimension_sections must list the multimodal rope's pair counts .* got None"),
    ((2, 3, 4, 0), r"qwen2vl\.rope\.dimension_sections must list up to three positive pair counts summing to "
                   r"head_dim / 2 = 8, got \[2, 3, 4\]"),
    ((2, 3, 3, 1), r"qwen2vl\.rope\.dimension_sections must list up to three"),
])
def test_bad_rope_sections(hf_qwen, smollm2_path, tmp_path, sections, match):
    path = tmp_path / "text.gguf"
    _write_text(path, hf_qwen[0], sections)
    with pytest.raises(ModelLoadError, match=rf"text\.gguf: {match}"):
        load_model(str(path))


@pytest.mark.parametrize("change, match", [
    ({"drop": {"v.blk.1.attn_k.bias"}}, r"missing vision tensor 'v\.blk\.1\.attn_k\.bias'"),
    ({"drop": {"v.patch_embd.weight.1"}}, r"missing vision tensor 'v\.patch_embd\.weight\.1'"),
    ({"extra": {"v.blk.0.attn_qkv.weight": np.zeros((96, 32), np.float32)}},
     r"tensor 'v\.blk\.0\.attn_qkv\.weight' is not applied by the qwen2\.5vl_merger vision tower"),
    ({"meta": {"clip.vision.n_wa_pattern": None}}, r"clip\.vision\.n_wa_pattern must be an integer >= 0, got None"),
    ({"meta": {"clip.vision.projection_dim": 48}}, r"clip\.vision\.projection_dim=48 must equal the text model's"),
    ({"meta": {"clip.projector_type": "qwen2vl_merger"}}, r"clip\.projector_type 'qwen2vl_merger' is not supported"),
])
def test_broken_mmproj_is_refused(gguf_pair, hf_qwen, tmp_path, change, match):
    bad = tmp_path / "mmproj-bad.gguf"
    _write_mmproj(bad, hf_qwen[0], hf_qwen[2], **change)
    with pytest.raises(ModelLoadError, match=rf"mmproj-bad\.gguf: {match}"):
        load_model(str(gguf_pair[0]), mmproj=str(bad))
