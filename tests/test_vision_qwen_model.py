"""Qwen2.5-VL with images against transformers: a random-weight folder. Its text model rotates
each head's sections by the three position streams of multimodal rope (an image's tokens take
their grid's rows and columns, the text after it moves on by the image's larger side), so
greedy equality here checks those positions through the engine, alone and batched."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import random_image, run_with_oracle_drafts
from llaisys.engine import LLMEngine, generate
from llaisys.generation import GenerationConfig
from llaisys.generation.prompts import image_prompt
from llaisys.models import load_model

GREEDY = GenerationConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{IMAGE}Describe it.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def hf_qwen(tiny_qwen25_vl):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.set_num_threads(2)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen25_vl).eval()
    return model, AutoTokenizer.from_pretrained(tiny_qwen25_vl), Qwen2VLImageProcessorPil.from_pretrained(tiny_qwen25_vl)


@pytest.fixture(scope="module")
def qwen(tiny_qwen25_vl):
    return load_model(str(tiny_qwen25_vl))


def _reference(hf_qwen, text: str, images: list, n: int = 8) -> tuple[list[int], list[int]]:
    """transformers' prompt ids (each image's pad token repeated for its rows, as its processor
    writes them) and greedy continuation."""
    model, tok, processor = hf_qwen
    pixels = processor(images=images, return_tensors="pt") if images else None
    merge = model.config.vision_config.spatial_merge_size
    for grid in (pixels["image_grid_thw"] if images else []):
        text = text.replace("<|image_pad|>", "<|placeholder|>" * int(grid.prod() // merge ** 2), 1)
    ids = tok(text.replace("<|placeholder|>", "<|image_pad|>"), return_tensors="pt")["input_ids"]
    extra = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]} if images else {}
    types = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                             max_new_tokens=n, do_sample=False, **extra)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("size", [(56, 56), (90, 61), (200, 40)])
def test_tower_output_equals_transformers(qwen, hf_qwen, size):
    model, _, processor = hf_qwen
    image = random_image(np.random.default_rng(sum(size)), *size)
    pixels = processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"]).pooler_output
    want = torch.cat(list(want)) if isinstance(want, (list, tuple)) else want
    np.testing.assert_allclose(qwen.vision.embed(image).rows, want.numpy(), atol=3e-5, rtol=0)


def test_text_alone_equals_transformers(qwen, hf_qwen):
    text = "<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n"
    want_prompt, want = _reference(hf_qwen, text, [])
    result = generate(qwen, text, GREEDY)
    assert result.prompt_tokens == len(want_prompt) and result.token_ids == want


@pytest.mark.parametrize("size", [(56, 56), (120, 70)])
def test_greedy_tokens_equal_transformers(qwen, hf_qwen, size):
    image = random_image(np.random.default_rng(size[1]), *size)
    want_prompt, want = _reference(hf_qwen, PROMPT, [image])
    ids, placed = image_prompt(qwen, PROMPT, [image])
    assert ids == want_prompt and placed.rope_delta < 0
    assert generate(qwen, PROMPT, GREEDY, images=[image]).token_ids == want


def test_two_images_batched_with_text_equal_alone(qwen, hf_qwen):
    rng = np.random.default_rng(2)
    a, b = random_image(rng, 100, 60), random_image(rng, 50, 90)
    two = f"<|im_start|>user\n{IMAGE} and {IMAGE}?<|im_end|>\n<|im_start|>assistant\n"
    want_prompt, want = _reference(hf_qwen, two, [a, b])
    assert generate(qwen, two, GREEDY, images=[a, b]).token_ids == want
    jobs = [(two, [a, b]), (PROMPT, [b]), ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", [])]
    alone = [generate(qwen, text, GREEDY, images=images).token_ids for text, images in jobs]
    engine = LLMEngine(qwen, kv_cache_tokens=4096, block_size=16, max_batched_tokens=40)
    ids = [engine.add_request(None, *image_prompt(qwen, text, images)[:1], GREEDY,
                              image_prompt(qwen, text, images)[1]) for text, images in jobs]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert [got[i] for i in ids] == alone


def test_speculative_decoding_with_an_image_equals_plain(qwen, monkeypatch):
    """Drafted tokens after an image take the prompt's rope delta too. A random model repeats
    nothing for prompt lookup to find, so the drafts here are the plain output's next tokens
    with every third one wrong: some accepted, some rejected, the same tokens as plain greedy
    decoding."""
    image = random_image(np.random.default_rng(23), 70, 70)
    config = GenerationConfig(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    plain = generate(qwen, PROMPT, config, images=[image]).token_ids
    prompt, placed = image_prompt(qwen, PROMPT, [image])
    got, engine = run_with_oracle_drafts(qwen, prompt, placed, config, plain, monkeypatch)
    assert got == plain
    assert 0 < engine.accepted_tokens < engine.drafted_tokens
