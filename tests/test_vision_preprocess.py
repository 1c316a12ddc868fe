"""llaisys.vision.preprocess against transformers' PIL image processors (the reference when
torchvision is absent): pixel arrays equal, grids equal, and prompt text equal to what the
transformers processor writes for the image."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.processing_gemma3 import Gemma3Processor as HFGemma3Processor
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.idefics3.processing_idefics3 import Idefics3Processor as HFIdefics3Processor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor as HFQwen2VLProcessor
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from llaisys.vision.images import ImageError
from llaisys.vision.preprocess import (
    Gemma3Processor,
    Idefics3Processor,
    ProcessedImage,
    Qwen2VLProcessor,
    idefics3_image_seq_len,
    processor_from_config,
)

# (height, width): odd sides, both orientations, a 1x1, a very wide and a very tall one
SIZES = [(37, 53), (641, 199), (1000, 1300), (17, 900), (1, 1), (40, 1500)]


def picture(height: int, width: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A seeded random picture of (height, width) in ``mode`` (RGB or RGBA)."""
    channels = len(mode)
    pixels = np.random.default_rng([seed, height, width]).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def tiny_tokenizer(**attributes: str | int) -> PreTrainedTokenizerFast:
    """A one-word tokenizer: enough for the transformers processors to build their prompt text."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                        unk_token="<unk>")
    for name, value in attributes.items():
        setattr(tokenizer, name, value)
    return tokenizer


def assert_pixels_equal(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.dtype == np.float32
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- Idefics3 / SmolVLM

IDEFICS3_CONFIGS = {
    "default": {},
    "smolvlm-512": {"size": {"longest_edge": 1024}, "max_image_size": {"longest_edge": 512}, "image_seq_len": 64},
    "no-split-364": {"do_image_splitting": False, "size": {"longest_edge": 364}},
    "tiny-bicubic": {"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32}, "resample": 3,
                     "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.3, 0.25], "image_seq_len": 4},
    "tiny-no-resize": {"do_resize": False, "max_image_size": {"longest_edge": 64}, "image_seq_len": 2},
    "tiny-height-width": {"size": {"height": 50, "width": 70}, "max_image_size": {"longest_edge": 32},
                          "do_normalize": False, "image_seq_len": 1},
}


def hf_idefics3(config: dict) -> HFIdefics3Processor:
    """transformers' processor (image processor + prompt writer) for one of our configs."""
    image_config = {k: v for k, v in config.items() if k != "image_seq_len"}
    return HFIdefics3Processor(image_processor=Idefics3ImageProcessorPil(**image_config), tokenizer=tiny_tokenizer(),
                               image_seq_len=config.get("image_seq_len", 169))


@pytest.mark.parametrize("name", IDEFICS3_CONFIGS)
@pytest.mark.parametrize("height,width", SIZES)
def test_idefics3_matches_transformers(name: str, height: int, width: int):
    config = IDEFICS3_CONFIGS[name]
    image = picture(height, width)
    ours = Idefics3Processor.from_config(config)(image)
    hf = hf_idefics3(config)
    reference, replacements = hf._process_images([image], return_row_col_info=True, return_tensors="np")
    assert_pixels_equal(ours.pixels, reference["pixel_values"][0])
    assert (ours.rows, ours.cols) == (reference["rows"][0][0], reference["cols"][0][0])
    text, _ = hf.get_text_with_replacements(["<image>"], images_replacements=replacements)
    assert ours.prompt == text[0]
    assert ours.num_image_tokens == ours.prompt.count("<image>") == hf.image_seq_len * ours.pixels.shape[0]


@pytest.mark.parametrize("height,width", SIZES)
def test_idefics3_tiles_match_transformers_count(height: int, width: int):
    """The tile grid agrees with transformers' own count from the size alone (used to plan tokens)."""
    config = IDEFICS3_CONFIGS["smolvlm-512"]
    ours = Idefics3Processor.from_config(config)(picture(height, width))
    image_config = {k: v for k, v in config.items() if k != "image_seq_len"}
    num_patches, rows, cols = Idefics3ImageProcessorPil(**image_config).get_number_of_image_patches(height, width)
    assert (ours.rows, ours.cols) == (rows, cols)
    assert ours.pixels.shape[0] == max(num_patches, 1)


def test_smolvlm_is_idefics3():
    config = {"size": {"longest_edge": 128}, "max_image_size": {"longest_edge": 64}}
    image = picture(91, 160)
    ours = processor_from_config({"image_processor_type": "SmolVLMImageProcessor", **config})(image)
    reference = SmolVLMImageProcessorPil(**config)(images=image, return_tensors="np", return_row_col_info=True)
    assert_pixels_equal(ours.pixels, reference["pixel_values"][0])
    assert ours.prompt == get_image_prompt_string(ours.rows, ours.cols, 169,
                                                  fake_token_around_image="<fake_token_around_image>",
                                                  image_token="<image>", global_image_token="<global-img>")


def test_idefics3_image_seq_len():
    assert idefics3_image_seq_len(364, 14, 2) == 169  # Idefics3-8B
    assert idefics3_image_seq_len(512, 16, 4) == 64  # SmolVLM-256M/500M
    assert idefics3_image_seq_len(384, 14, 3) == int(((384 // 14) ** 2) / 3**2)


# ---------------------------------------------------------------- Gemma 3

PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}
GEMMA3_CONFIGS = {
    "default": {},
    "64x64": {"size": {"height": 64, "width": 64}, "image_seq_length": 5},
    "pan-and-scan": {"size": {"height": 64, "width": 48}, **PAN_AND_SCAN, "image_seq_length": 3},
    "pan-and-scan-strict": {"size": {"height": 32, "width": 32}, **PAN_AND_SCAN, "pan_and_scan_min_crop_size": 200,
                            "pan_and_scan_max_num_crops": 2, "pan_and_scan_min_ratio_to_activate": 2.0},
    "bicubic-clip": {"size": {"height": 40, "width": 72}, "resample": 3, "image_mean": [0.48145466, 0.4578275,
                     0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711], "image_seq_length": 2},
    # the nulls of Gemma 3's preprocessor_config.json take the processor's defaults
    "nulls": {"size": {"height": 48, "width": 48}, "do_pan_and_scan": None, "pan_and_scan_min_crop_size": None,
              "do_convert_rgb": None, "image_seq_length": 4},
}


def hf_gemma3(config: dict) -> HFGemma3Processor:
    image_config = {k: v for k, v in config.items() if k != "image_seq_length"}
    tokenizer = tiny_tokenizer(boi_token="<start_of_image>", image_token="<image_soft_token>",
                               eoi_token="<end_of_image>", boi_token_id=0)
    return HFGemma3Processor(image_processor=Gemma3ImageProcessorPil(**image_config), tokenizer=tokenizer,
                             image_seq_length=config.get("image_seq_length", 256))


@pytest.mark.parametrize("name", GEMMA3_CONFIGS)
@pytest.mark.parametrize("height,width", SIZES)
def test_gemma3_matches_transformers(name: str, height: int, width: int):
    config = GEMMA3_CONFIGS[name]
    image = picture(height, width, seed=1)
    ours = Gemma3Processor.from_config(config)(image)
    hf = hf_gemma3(config)
    reference, replacements = hf._process_images([image], return_tensors="np")
    assert_pixels_equal(ours.pixels, reference["pixel_values"])
    assert ours.num_crops == reference["num_crops"][0]
    text, _ = hf.get_text_with_replacements(["<start_of_image>"], images_replacements=replacements)
    assert ours.prompt == text[0]
    tokens = hf.image_seq_length * (1 + ours.num_crops)
    assert ours.num_image_tokens == ours.prompt.count("<image_soft_token>") == tokens


def test_gemma3_real_size_and_pan_and_scan_crops():
    """Gemma 3's shipped size (896x896, bilinear) on a wide picture that pan-and-scan cuts in two."""
    config = {"size": {"height": 896, "width": 896}, "resample": 2, **PAN_AND_SCAN, "pan_and_scan_min_crop_size": 256}
    image = picture(300, 700, seed=2)
    ours = Gemma3Processor.from_config(config)(image)
    reference = Gemma3ImageProcessorPil(**config)(images=image, return_tensors="np")
    assert ours.num_crops == 2 and ours.pixels.shape == (3, 3, 896, 896)
    assert_pixels_equal(ours.pixels, reference["pixel_values"])


def test_rgba_input_is_converted_as_transformers_does():
    image = picture(33, 47, seed=3, mode="RGBA")
    ours = Gemma3Processor.from_config({"size": {"height": 16, "width": 16}})(image)
    reference = Gemma3ImageProcessorPil(size={"height": 16, "width": 16})(images=image, return_tensors="np")
    assert_pixels_equal(ours.pixels, reference["pixel_values"])


# ---------------------------------------------------------------- Qwen2-VL / Qwen2.5-VL / Qwen3-VL

QWEN_CONFIGS = {
    # Qwen2.5-VL's keys, with small bounds so the arrays stay small
    "min-max-pixels": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64},
    # Qwen3-VL's keys: size, patch 16, mean/std 0.5
    "qwen3-size": {"size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 30}, "patch_size": 16,
                   "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    "upscale-to-min": {"min_pixels": 28 * 28 * 40, "max_pixels": 28 * 28 * 80, "resample": 2},
    "merge-1-temporal-3": {"min_pixels": 8 * 8, "max_pixels": 8 * 8 * 50, "patch_size": 8, "merge_size": 1,
                           "temporal_patch_size": 3, "do_normalize": False},
}


def qwen_prompt_reference(grid_thw: np.ndarray, merge_size: int) -> str:
    """transformers' Qwen2-VL replacement of ``<|image_pad|>``, inside the chat template's
    vision markers."""
    owner = SimpleNamespace(image_processor=SimpleNamespace(merge_size=merge_size), image_token="<|image_pad|>")
    pads = HFQwen2VLProcessor.replace_image_token(owner, {"image_grid_thw": grid_thw}, 0)
    return f"<|vision_start|>{pads}<|vision_end|>"


@pytest.mark.parametrize("name", QWEN_CONFIGS)
@pytest.mark.parametrize("height,width", [s for s in SIZES if max(s) / min(s) <= 200])
def test_qwen2vl_matches_transformers(name: str, height: int, width: int):
    config = QWEN_CONFIGS[name]
    image = picture(height, width, seed=4)
    ours = Qwen2VLProcessor.from_config(config)(image)
    processor = Qwen2VLImageProcessorPil(**config)
    reference = processor(images=image, return_tensors="np")
    assert_pixels_equal(ours.pixels, reference["pixel_values"])
    assert ours.grid_thw == tuple(reference["image_grid_thw"][0])
    merge = config.get("merge_size", 2)
    assert ours.prompt == qwen_prompt_reference(reference["image_grid_thw"], merge)
    assert ours.num_image_tokens == processor.get_number_of_image_patches(height, width) // merge**2


def test_qwen2vl_default_config():
    image = picture(200, 330, seed=5)
    ours = Qwen2VLProcessor.from_config({})(image)
    reference = Qwen2VLImageProcessorPil()(images=image, return_tensors="np")
    assert_pixels_equal(ours.pixels, reference["pixel_values"])
    assert ours.grid_thw == tuple(reference["image_grid_thw"][0]) == (1, 14, 24)


def test_qwen2vl_without_resize():
    image = picture(56, 84, seed=6)
    ours = Qwen2VLProcessor.from_config({"do_resize": False})(image)
    reference = Qwen2VLImageProcessorPil(do_resize=False)(images=image, return_tensors="np")
    assert_pixels_equal(ours.pixels, reference["pixel_values"])
    with pytest.raises(ImageError, match="multiples of patch_size \\* merge_size = 28"):
        Qwen2VLProcessor.from_config({"do_resize": False})(picture(50, 84))


def test_qwen2vl_refuses_extreme_aspect_ratio():
    image = picture(2, 500)
    with pytest.raises(ValueError, match="aspect ratio"):
        Qwen2VLImageProcessorPil()(images=image, return_tensors="np")
    with pytest.raises(ImageError, match="500x2, an aspect ratio of 250.0; Qwen2-VL accepts at most 200"):
        Qwen2VLProcessor.from_config({})(image)


# ---------------------------------------------------------------- configs

def test_processor_from_config_by_type():
    for kind, cls in [("Idefics3ImageProcessor", Idefics3Processor), ("Idefics3ImageProcessorFast", Idefics3Processor),
                      ("Gemma3ImageProcessor", Gemma3Processor), ("Qwen2VLImageProcessorPil", Qwen2VLProcessor)]:
        assert type(processor_from_config({"image_processor_type": kind, "processor_class": "x"})) is cls
    with pytest.raises(ValueError, match="image_processor_type must be one of .*'Gemma3ImageProcessor'.*got 'Clip'"):
        processor_from_config({"image_processor_type": "Clip"})


def test_config_values_are_read_and_unknown_keys_ignored():
    qwen = Qwen2VLProcessor.from_config({"min_pixels": 100, "max_pixels": 5000, "size": None, "foo": 1})
    assert qwen.size == {"shortest_edge": 100, "longest_edge": 5000}
    assert Qwen2VLProcessor.from_config({"size": {"shortest_edge": 1, "longest_edge": 2}, "max_pixels": 9}).size == \
        {"shortest_edge": 1, "longest_edge": 9}
    gemma = Gemma3Processor.from_config({"size": 96, "image_mean": 0.25})
    assert gemma.size == {"height": 96, "width": 96} and gemma.image_mean == (0.25, 0.25, 0.25)
    idefics = Idefics3Processor.from_config({})
    assert idefics.size == {"longest_edge": 1456} and idefics.tile == 364 and idefics.resample == 1


@pytest.mark.parametrize("cls,config,message", [
    (Idefics3Processor, {"resample": 9}, "resample must be a PIL resampling filter"),
    (Idefics3Processor, {"do_resize": "yes"}, "do_resize must be true or false, got 'yes'"),
    (Idefics3Processor, {"image_mean": [0.5, 0.5]}, "image_mean must be a number or a list of 3 numbers"),
    (Idefics3Processor, {"image_std": [0.5, 0, 0.5]}, "image_std must be three non-zero numbers"),
    (Idefics3Processor, {"size": {"longest_edge": -1}}, "size.longest_edge must be a positive integer, got -1"),
    (Idefics3Processor, {"size": {"shortest_edge": 10}}, "size must be .*longest_edge"),
    (Idefics3Processor, {"max_image_size": {"height": 3}}, "max_image_size must be .*longest_edge"),
    (Idefics3Processor, {"image_seq_len": 0}, "image_seq_len must be a positive integer"),
    (Idefics3Processor, {"rescale_factor": -1}, "rescale_factor must be a positive number"),
    (Gemma3Processor, {"size": {"longest_edge": 5}}, "size must be .*height"),
    (Gemma3Processor, {"do_pan_and_scan": True, "do_resize": False}, "do_resize must be true when do_pan_and_scan"),
    (Gemma3Processor, {"pan_and_scan_max_num_crops": 1.5}, "pan_and_scan_max_num_crops must be a positive integer"),
    (Qwen2VLProcessor, {"size": {"shortest_edge": 100}}, "size must be .*shortest_edge.*longest_edge"),
    (Qwen2VLProcessor, {"min_pixels": 500, "max_pixels": 100}, "size.shortest_edge must be at most"),
    (Qwen2VLProcessor, {"patch_size": 0}, "patch_size must be a positive integer"),
    (Qwen2VLProcessor, {"size": 448}, "size must be .*shortest_edge"),
])
def test_bad_config_values_name_the_key(cls, config, message):
    with pytest.raises(ValueError, match=f"{cls.__name__} config: {message}"):
        cls.from_config(config)


def test_call_takes_a_pil_image():
    with pytest.raises(TypeError, match="takes a PIL image, got ndarray"):
        Gemma3Processor.from_config({})(np.zeros((4, 4, 3), np.uint8))
    result = Gemma3Processor.from_config({"size": {"height": 8, "width": 8}})(picture(5, 5))
    assert isinstance(result, ProcessedImage) and result.pixels.flags.c_contiguous
