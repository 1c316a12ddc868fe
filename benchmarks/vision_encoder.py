"""The vision tower's time per image, llaisys against transformers, on random-weight models of
the real vision shapes (the text model shrunk to 2 layers: it takes no part):

- ``smolvlm``: SmolVLM-256M's SigLIP-B/16 at 512 px (12 layers of 768, 1024 patches a tile),
  pixel shuffle by 4 to 64 rows of 576; ``--tiles`` tiles an image (default 1 and 5);
- ``gemma3``: Gemma 3 4B's SigLIP-so400m/14 at 896 px (27 layers of 1152, 4096 patches),
  pooled to 256 rows of 2560;
- ``qwen``: Qwen2.5-VL-3B's ViT (32 layers of 1280, windows of 112 px, 14 px patches) on a
  448 x 448 image (1024 patches), merged to 256 rows of 2048.

    python3 benchmarks/vision_encoder.py                          # all three, 2 threads, median of 3
    python3 benchmarks/vision_encoder.py --family smolvlm --tiles 1 2 --threads 1 --repeats 5

Both engines run the same float32 pixels through encoder and projector (llaisys: the tower's
``rows_of``; transformers: the model's ``get_image_features``); the outputs are checked to agree
first. Each folder is built once under ``~/.cache/llaisys/bench-models/``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

CACHE = Path(os.environ.get("LLAISYS_BENCH_MODELS", Path.home() / ".cache" / "llaisys" / "bench-models"))
TEXT = dict(vocab_size=49280, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            max_position_embeddings=8192)


def _save(folder: Path, model, processor) -> Path:
    part = folder.with_name(folder.name + f".{os.getpid()}.part")
    model.save_pretrained(part)
    processor.save_pretrained(part)
    os.replace(part, folder)
    return folder


def build(family: str) -> Path:
    """The model folder of ``family`` (made once: config, float32 safetensors, preprocessor_config.json)."""
    folder = CACHE / f"{family}-vision-f32"
    if (folder / "model.safetensors").exists():
        return folder
    import torch

    torch.manual_seed(0)
    if family == "smolvlm":
        from transformers import Idefics3Config, Idefics3ForConditionalGeneration
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        config = Idefics3Config(text_config=dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                                                 rms_norm_eps=1e-5, **TEXT),
                                vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                                   num_attention_heads=12, image_size=512, patch_size=16),
                                scale_factor=4, image_token_id=49190)
        return _save(folder, Idefics3ForConditionalGeneration(config).eval(),
                     Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}))
    if family == "gemma3":
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        config = Gemma3Config(text_config=dict(hidden_size=2560, intermediate_size=256, head_dim=64, **TEXT),
                              vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                                 num_attention_heads=16, image_size=896, patch_size=14,
                                                 vision_use_head=False),
                              mm_tokens_per_image=256, image_token_index=49190)
        model = Gemma3ForConditionalGeneration(config).eval()
        with torch.no_grad():  # transformers starts the projection at zero: every image would give zeros
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
        return _save(folder, model, Gemma3ImageProcessorPil(size={"height": 896, "width": 896}))
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2_5_VLConfig(text_config=dict(hidden_size=2048, intermediate_size=256,
                                               **{**TEXT, "num_attention_heads": 16},  # head_dim 128
                                               rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                "mrope_section": [16, 24, 24]}),
                              vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                                 out_hidden_size=2048, window_size=112,
                                                 fullatt_block_indexes=[7, 15, 23, 31]),
                              image_token_id=49190, video_token_id=49191, vision_start_token_id=49188,
                              vision_end_token_id=49189)
    return _save(folder, Qwen2_5_VLForConditionalGeneration(config).eval(),
                 Qwen2VLImageProcessorPil(min_pixels=448 * 448, max_pixels=448 * 448))


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cases(family: str, tiles: list[int]):
    """(label, pixels, image) per case: SmolVLM's tiles as pixels both engines take as they
    are, or one image each engine preprocesses itself."""
    from PIL import Image

    rng = np.random.default_rng(0)
    if family == "smolvlm":
        for n in tiles:
            pixels = rng.standard_normal((n, 3, 512, 512)).astype(np.float32)
            yield f"{n} tile(s) of 512 px", pixels, None
        return
    side = 896 if family == "gemma3" else 448
    image = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
    yield f"a {side} x {side} image", None, image


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("smolvlm", "gemma3", "qwen"), nargs="+",
                    default=["smolvlm", "gemma3", "qwen"])
    ap.add_argument("--tiles", type=int, nargs="+", default=[1, 5], help="SmolVLM tiles per image (default 1 5)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch
    import transformers

    from llaisys.cli.main import apply_threads
    from llaisys.models import load_model

    apply_threads(args.threads)
    torch.set_num_threads(args.threads)
    for family in args.family:
        folder = build(family)
        tower = load_model(str(folder)).vision
        theirs = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        print(f"{family} ({folder.name}): {args.threads} threads, median of {args.repeats}")
        for label, pixels, image in cases(family, args.tiles):
            if image is not None:  # one real image through each engine's own preprocessing
                processed = tower.processor(image)
                inputs = transformers.AutoImageProcessor.from_pretrained(folder)(images=[image], return_tensors="pt")

                def run_ours():
                    return tower.rows_of(processed)

                def run_theirs():
                    with torch.no_grad():
                        extra = {"image_grid_thw": inputs["image_grid_thw"]} if "image_grid_thw" in inputs else {}
                        out = theirs.model.get_image_features(inputs["pixel_values"], **extra).pooler_output
                    return (torch.cat(list(out)) if isinstance(out, (list, tuple)) else out).reshape(
                        -1, out[0].shape[-1] if isinstance(out, (list, tuple)) else out.shape[-1]).numpy()
            else:
                tensor = torch.from_numpy(pixels)

                def run_ours():
                    return tower.projector.project(tower.encoder.encode(pixels))

                def run_theirs():
                    with torch.no_grad():
                        return theirs.model.get_image_features(tensor[None]).pooler_output[0].numpy()

            gap = float(np.abs(run_ours() - run_theirs()).max())
            a, b = timed(run_ours, args.repeats), timed(run_theirs, args.repeats)
            print(f"  {label}: llaisys {a * 1000:.0f} ms, transformers {b * 1000:.0f} ms; "
                  f"transformers / llaisys {b / a:.2f} (max |diff| {gap:.1e})")


if __name__ == "__main__":
    main()
