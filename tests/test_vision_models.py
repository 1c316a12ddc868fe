"""Vision-language models against transformers: a random-weight SmolVLM (Idefics3) folder.

The vision tower's output for our pixels equals transformers' for its processor's; greedy
continuations of an image + text prompt equal transformers' token for token, alone and batched
with other requests in one engine, across preemption; prefix-cache blocks are keyed by the
image, so two images never share them while the same image does.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import random_image, run_with_oracle_drafts
from llaisys.engine import LLMEngine, chat, generate
from llaisys.generation import GenerationConfig
from llaisys.generation.prompts import image_prompt
from llaisys.models import ModelLoadError, load_model

PROMPT = "User:<image>Describe this.<end_of_utterance>\nAssistant:"
GREEDY = GenerationConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_smolvlm(tiny_smolvlm):
    """transformers' model and processor of the folder (the reference)."""
    from transformers import AutoTokenizer, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    torch.set_num_threads(2)
    model = Idefics3ForConditionalGeneration.from_pretrained(tiny_smolvlm).eval()
    processor = Idefics3Processor(image_processor=Idefics3ImageProcessorPil.from_pretrained(tiny_smolvlm),
                                  tokenizer=AutoTokenizer.from_pretrained(tiny_smolvlm), image_seq_len=16)
    return model, processor


@pytest.fixture(scope="module")
def smolvlm(tiny_smolvlm):
    return load_model(str(tiny_smolvlm))


def _reference(hf_smolvlm, text: str, images: list, n: int = 8) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and greedy continuation of ``text`` with ``images``."""
    model, processor = hf_smolvlm
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


SIZES = [(37, 100), (90, 53), (200, 200), (1, 1), (300, 17)]


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_tower_output_equals_transformers(smolvlm, hf_smolvlm, size):
    model, processor = hf_smolvlm
    image = random_image(np.random.default_rng(sum(size)), *size)
    inputs = processor.image_processor(images=[[image]], return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output[0]
    rows = smolvlm.vision.embed(image).rows  # (M, D)
    assert rows.shape == tuple(want.shape)
    np.testing.assert_allclose(rows, want.numpy(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("size", SIZES[:3], ids=[f"{w}x{h}" for w, h in SIZES[:3]])
def test_greedy_tokens_equal_transformers(smolvlm, hf_smolvlm, size):
    image = random_image(np.random.default_rng(size[0]), *size)
    want_prompt, want = _reference(hf_smolvlm, PROMPT, [image])
    ids, _ = image_prompt(smolvlm, PROMPT, [image])
    assert ids == want_prompt
    assert generate(smolvlm, PROMPT, GREEDY, images=[image]).token_ids == want


def test_two_images_and_chat_messages(smolvlm, hf_smolvlm):
    rng = np.random.default_rng(5)
    first, second = random_image(rng, 150, 70), random_image(rng, 40, 60)
    messages = [{"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": "And"},
                                             {"type": "image", "image": second}, {"type": "text", "text": "?"}]}]
    text = smolvlm.tokenizer.apply_chat_template(messages, parts=True)
    assert text.count("<image>") == 2 and text.endswith("Assistant:")
    want_prompt, want = _reference(hf_smolvlm, text, [first, second])
    result = chat(smolvlm, messages, GREEDY)
    assert result.prompt_tokens == len(want_prompt)
    assert result.token_ids == want


def _alone(model, text, images, config=GREEDY):
    return generate(model, text, config, images=images).token_ids


def test_batched_with_others_and_preempted_equals_alone(smolvlm):
    rng = np.random.default_rng(11)
    a, b = random_image(rng, 120, 90), random_image(rng, 64, 64)
    jobs = [(PROMPT, [b]), ("User: no picture here.<end_of_utterance>\nAssistant:", []), (PROMPT, [a])]
    alone = [_alone(smolvlm, text, images) for text, images in jobs]
    prompts = [image_prompt(smolvlm, text, images) for text, images in jobs]
    longest = max(len(ids) for ids, _ in prompts) + GREEDY.max_new_tokens
    # the second pool holds the longest request alone: the others are preempted and recomputed
    for blocks in (64, -(-longest // 16)):
        engine = LLMEngine(smolvlm, kv_cache_tokens=blocks * 16, block_size=16, max_batched_tokens=48)
        ids = [engine.add_request(None, prompt, GREEDY, placed) for prompt, placed in prompts]
        got = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.token_ids
        assert [got[i] for i in ids] == alone, f"{blocks} blocks"
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_is_keyed_by_the_image(smolvlm):
    rng = np.random.default_rng(3)
    a, b = random_image(rng, 100, 100), random_image(rng, 100, 100)
    text = "User: a long shared preamble " + "word " * 40 + "<image>What is it?<end_of_utterance>\nAssistant:"
    engine = LLMEngine(smolvlm, kv_cache_tokens=4096, block_size=16)

    def run(image):
        prompt, placed = image_prompt(smolvlm, text, [image])
        rid = engine.add_request(None, prompt, GREEDY, placed)
        tokens, cached = [], None
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    tokens += out.token_ids
                    cached = out.cached_tokens
        return tokens, cached, int(placed.positions[0]), len(prompt)

    first, _, image_at, length = run(a)
    other, cached, _, _ = run(b)
    assert cached <= image_at, "blocks holding another image's tokens were reused"
    assert other == _alone(smolvlm, text, [b])
    again, cached, _, _ = run(a)
    assert cached > image_at + 16, "the same image's blocks were not reused"
    assert again == first == _alone(smolvlm, text, [a])


def test_an_image_is_encoded_once(smolvlm, monkeypatch):
    calls = []
    encode = smolvlm.vision.encoder.encode
    monkeypatch.setattr(smolvlm.vision.encoder, "encode", lambda pixels: calls.append(1) or encode(pixels))
    image = random_image(np.random.default_rng(99), 77, 33)
    first = smolvlm.vision.embed(image)
    second = smolvlm.vision.embed(image.copy())
    assert len(calls) == 1 and second is first


def test_text_model_refuses_images(smollm2_model):
    image = random_image(np.random.default_rng(0), 8, 8)
    with pytest.raises(ValueError, match="no vision encoder"):
        generate(smollm2_model, "Describe <image>", GREEDY, images=[image])
    with pytest.raises(ValueError, match="no vision encoder"):
        chat(smollm2_model, [{"role": "user", "content": [{"type": "image", "image": image}]}], GREEDY)


def test_placeholders_must_match_images(smolvlm):
    image = random_image(np.random.default_rng(0), 8, 8)
    with pytest.raises(ValueError, match="2 image placeholders"):
        generate(smolvlm, "<image><image>Hi", GREEDY, images=[image])


def _copy(folder, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(folder, out)
    return out


def test_bad_folders_are_named(tiny_smolvlm, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = _copy(tiny_smolvlm, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    with pytest.raises(ModelLoadError, match="vision-language model_type 'llava' is not supported"):
        load_model(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "scale_factor": 3}))
    with pytest.raises(ModelLoadError, match="scale_factor"):
        load_model(str(folder))
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(folder / "model.safetensors")
    extra = dict(weights, **{"model.vision_model.head.weight": np.zeros((4, 4), np.float32)})
    save_file(extra, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="'model.vision_model.head.weight' is not applied"):
        load_model(str(folder))
    del weights["model.vision_model.encoder.layers.1.mlp.fc2.bias"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing vision weight 'model.vision_model.encoder.layers.1.mlp.fc2.bias'"):
        load_model(str(folder))


def test_speculative_decoding_with_an_image_equals_plain(smolvlm, monkeypatch):
    """Drafts after an image prompt change nothing. A random model need not repeat anything for
    prompt lookup to find, so the drafts here are the plain output's next tokens with every
    third one wrong: some accepted, some rejected, the same tokens as plain greedy decoding."""
    image = random_image(np.random.default_rng(17), 80, 80)
    config = GenerationConfig(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    plain = generate(smolvlm, PROMPT, config, images=[image]).token_ids
    prompt, placed = image_prompt(smolvlm, PROMPT, [image])
    got, engine = run_with_oracle_drafts(smolvlm, prompt, placed, config, plain, monkeypatch)
    assert got == plain
    assert 0 < engine.accepted_tokens < engine.drafted_tokens
