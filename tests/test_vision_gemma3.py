"""Gemma 3 with images against transformers: a random-weight Gemma3ForConditionalGeneration
folder. Its image tokens see each other both ways (on sliding layers within the window), so
greedy equality here checks the two-way spans through the engine, alone, batched and after
preemption, and that a chunk never splits an image."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import random_image
from llaisys.engine import LLMEngine, chat, generate
from llaisys.generation import GenerationConfig
from llaisys.generation.prompts import image_prompt
from llaisys.models import load_model

GREEDY = GenerationConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = "<start_of_turn>user\nLook <start_of_image> and tell me.<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def hf_gemma3(tiny_gemma3_vlm):
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    torch.set_num_threads(2)
    model = Gemma3ForConditionalGeneration.from_pretrained(tiny_gemma3_vlm).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3_vlm, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(tiny_gemma3_vlm),
                                tokenizer=tokenizer, image_seq_length=16)
    return model, processor


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_vlm):
    return load_model(str(tiny_gemma3_vlm))


def _reference(hf_gemma3, text: str, images: list, n: int = 8, bos: bool = True) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and greedy continuation (``bos``: the tokenizer adds BOS, as it
    does to a plain prompt; a rendered chat template writes its own)."""
    model, processor = hf_gemma3
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt",
                       add_special_tokens=bos)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


@pytest.mark.parametrize("size", [(64, 64), (37, 100), (200, 90)])
def test_tower_output_equals_transformers(gemma3, hf_gemma3, size):
    model, processor = hf_gemma3
    image = random_image(np.random.default_rng(sum(size)), *size)
    inputs = processor.image_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(inputs["pixel_values"]).pooler_output
    rows = gemma3.vision.embed(image).rows
    np.testing.assert_allclose(rows, want.reshape(-1, want.shape[-1]).numpy(), atol=3e-5, rtol=0)


def test_prompt_ids_equal_transformers(gemma3, hf_gemma3):
    image = random_image(np.random.default_rng(1), 50, 70)
    want, _ = _reference(hf_gemma3, PROMPT, [image], n=1)
    ids, placed = image_prompt(gemma3, PROMPT, [image], add_special_tokens=True)
    assert ids == want
    assert placed.spans == ((int(placed.positions[0]), int(placed.positions[-1]) + 1),)


def test_greedy_tokens_equal_transformers(gemma3, hf_gemma3):
    rng = np.random.default_rng(4)
    for size in ((64, 64), (120, 45)):
        image = random_image(rng, *size)
        want_prompt, want = _reference(hf_gemma3, PROMPT, [image])
        result = generate(gemma3, PROMPT, GREEDY, images=[image])
        assert result.prompt_tokens == len(want_prompt)
        assert result.token_ids == want


def test_image_past_the_window_and_two_images(gemma3, hf_gemma3):
    """Text before the image longer than the sliding window: its tokens' windows start before
    the image, yet they see all of it."""
    rng = np.random.default_rng(8)
    first, second = random_image(rng, 64, 64), random_image(rng, 90, 30)
    text = ("<start_of_turn>user\n" + "one two three four five six seven eight nine ten " * 3
            + "<start_of_image> then <start_of_image> which?<end_of_turn>\n<start_of_turn>model\n")
    want_prompt, want = _reference(hf_gemma3, text, [first, second])
    ids, placed = image_prompt(gemma3, text, [first, second])
    assert ids == want_prompt and placed.spans[0][0] > 24 and len(placed.spans) == 2
    assert generate(gemma3, text, GREEDY, images=[first, second]).token_ids == want


def test_chunks_never_split_an_image_and_batches_equal_alone(gemma3, hf_gemma3):
    rng = np.random.default_rng(9)
    a, b = random_image(rng, 70, 70), random_image(rng, 30, 80)
    jobs = [(PROMPT, [a]), (PROMPT, [b]), ("<start_of_turn>user\nHello there.<end_of_turn>\n<start_of_turn>model\n", [])]
    alone = [generate(gemma3, text, GREEDY, images=images).token_ids for text, images in jobs]
    prompts = [image_prompt(gemma3, text, images) for text, images in jobs]
    longest = max(len(ids) for ids, _ in prompts) + GREEDY.max_new_tokens
    # chunks of 8 tokens: the 16 image tokens still run in one pass; then a pool that preempts
    for budget, blocks in ((8, 64), (48, -(-longest // 16))):
        engine = LLMEngine(gemma3, kv_cache_tokens=blocks * 16, block_size=16, max_batched_tokens=budget)
        ids = [engine.add_request(None, prompt, GREEDY, placed) for prompt, placed in prompts]
        got = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.token_ids
        assert [got[i] for i in ids] == alone, (budget, blocks)


def test_chat_with_an_image(gemma3, hf_gemma3):
    image = random_image(np.random.default_rng(12), 64, 48)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                             {"type": "image", "image": image}, {"type": "text", "text": "?"}]}]
    text = gemma3.tokenizer.apply_chat_template(messages, parts=True)
    want_prompt, want = _reference(hf_gemma3, text, [image], bos=False)
    result = chat(gemma3, messages, GREEDY)
    assert result.prompt_tokens == len(want_prompt) and result.token_ids == want
