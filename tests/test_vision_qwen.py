"""The Qwen2.5-VL vision encoder and merger against transformers' on a tiny random model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from llaisys.models.errors import ModelLoadError
from llaisys.models.multimodal.qwen_vision import (QwenVisionConfig, QwenVisionEncoder, patch_positions,
                                                   qwen_vision_shapes, window_order)
from llaisys.vision.preprocess import Qwen2VLProcessor

transformers = pytest.importorskip("transformers")

VISION = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3], out_hidden_size=64)
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, bos_token_id=0, eos_token_id=1,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
PROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64}
ATOL, RTOL = 2e-5, 1e-5  # float32 rounding; outputs reach about 15


@pytest.fixture(scope="module")
def visual():
    """transformers' vision model of a tiny Qwen2.5-VL, every weight random (norms around 1)."""
    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    visual = model.model.visual
    with torch.no_grad():
        for name, p in visual.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name or "ln_q" in name else 0.2 * torch.randn_like(p))
    return visual


@pytest.fixture(scope="module")
def encoder(visual):
    weights = {k: v.detach().numpy() for k, v in visual.state_dict().items()}
    return QwenVisionEncoder(VISION, weights.__getitem__, "tiny")


def picture(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def reference(visual, pixels: np.ndarray, grids: list[tuple[int, int, int]]) -> np.ndarray:
    with torch.no_grad():
        out = visual(torch.from_numpy(pixels), grid_thw=torch.tensor(grids))
    return out.pooler_output.numpy()


def test_weight_names_are_transformers(visual):
    shapes = qwen_vision_shapes(QwenVisionConfig.from_hf(VISION))
    assert shapes == {k: tuple(v.shape) for k, v in visual.state_dict().items()}


# (w, h) pixels: square, wide, tall, grids whose merge units are and are not multiples of the 2 x 2 windows
SIZES = [(56, 56), (200, 90), (70, 300), (131, 177), (250, 250), (112, 168), (29, 400)]


@pytest.mark.parametrize("size", SIZES)
def test_encode_matches_transformers(visual, encoder, size):
    image = Qwen2VLProcessor.from_config(PROCESSOR)(picture(*size, seed=sum(size)))
    ours = encoder.encode_image(image)
    expected = reference(visual, image.pixels, [image.grid_thw])
    assert ours.shape == (image.num_image_tokens, VISION["out_hidden_size"]) == expected.shape
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, atol=ATOL, rtol=RTOL)


def test_batch_of_images_matches_transformers(visual, encoder):
    processor = Qwen2VLProcessor.from_config(PROCESSOR)
    images = [processor(picture(150, 100, seed=1)), processor(picture(90, 260, seed=2))]
    pixels = np.concatenate([i.pixels for i in images])
    grids = [i.grid_thw for i in images]
    expected = reference(visual, pixels, grids)
    np.testing.assert_allclose(encoder.encode(pixels, grids), expected, atol=ATOL, rtol=RTOL)
    first = images[0].num_image_tokens
    np.testing.assert_allclose(encoder.encode_image(images[0]), expected[:first], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(encoder.encode_image(images[1]), expected[first:], atol=ATOL, rtol=RTOL)


def test_frames_match_transformers(visual, encoder):
    """A grid of t = 2 frames (a video's): windows and full attention stay within a frame."""
    grid = (2, 6, 10)
    pixels = np.random.default_rng(3).standard_normal((120, 3 * 2 * 14 * 14)).astype(np.float32)
    np.testing.assert_allclose(encoder.encode(pixels, grid), reference(visual, pixels, [grid]), atol=ATOL, rtol=RTOL)


def test_index_helpers_match_transformers():
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index
    for grid in [(1, 6, 10), (2, 8, 4), (1, 2, 2), (1, 14, 6)]:
        rows, cols = patch_positions(*grid, 2)
        np.testing.assert_array_equal(np.stack([rows, cols], 1), get_vision_position_ids(torch.tensor([grid]), 2))
        order, counts = window_order(*grid, 2, 2)
        index, cu = get_vision_window_index(torch.tensor([grid]), 2, 56, 14)
        np.testing.assert_array_equal(order, index.numpy())
        np.testing.assert_array_equal(np.concatenate([[0], np.cumsum(counts * 4)]), cu.numpy())


def test_bad_input_and_config(encoder, visual):
    with pytest.raises(ValueError, match="grid_thw"):
        encoder.encode(np.zeros((24, 1176), np.float32), (1, 4, 5))
    with pytest.raises(ValueError, match="pixels have shape"):
        encoder.encode(np.zeros((24, 1176), np.float32), (1, 4, 4))
    with pytest.raises(ModelLoadError, match="num_heads"):
        QwenVisionConfig.from_hf({**VISION, "num_heads": 16})
    with pytest.raises(ModelLoadError, match="hidden_act"):
        QwenVisionConfig.from_hf({**VISION, "hidden_act": "quick_gelu"})
    weights = {k: v.detach().numpy() for k, v in visual.state_dict().items()}
    del weights["merger.ln_q.weight"]
    with pytest.raises(ModelLoadError, match="merger.ln_q.weight"):
        QwenVisionEncoder(VISION, weights.__getitem__, "tiny")
