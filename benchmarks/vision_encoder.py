"""The vision tower's time per image tile, llaisys against transformers, on a random-weight
model of SmolVLM-256M's vision shape (SigLIP-B/16 at 512 px: 12 layers of 768, 1024 patches a
tile; pixel shuffle by 4 to 64 rows of the text width 576).

    python3 benchmarks/vision_encoder.py                 # 1 and 5 tiles, 2 threads, median of 3
    python3 benchmarks/vision_encoder.py --tiles 1 2 --threads 1 --repeats 5

Both run the same float32 pixels (N, 3, 512, 512) through encoder and projector: llaisys's
``VisionEncoder.encode`` + ``PixelShuffleProjector.project``, transformers'
``Idefics3Model.get_image_features``; the outputs are checked to agree first. The model folder
(vision weights and a 2-layer text model, float32) is built once under
``~/.cache/llaisys/bench-models/``. The multiply-adds per tile are printed beside the times, so
a time reads against the machine's f32 FMA rate.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

CACHE = Path(os.environ.get("LLAISYS_BENCH_MODELS", Path.home() / ".cache" / "llaisys" / "bench-models"))
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512,
              patch_size=16)
TEXT = dict(model_type="llama", vocab_size=49280, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5)


def build(folder: Path) -> Path:
    """The model folder (made once: config, float32 safetensors, preprocessor_config.json)."""
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    torch.manual_seed(0)
    config = Idefics3Config(text_config=TEXT, vision_config=VISION, scale_factor=4, image_token_id=49190)
    part = folder.with_name(folder.name + f".{os.getpid()}.part")
    Idefics3ForConditionalGeneration(config).eval().save_pretrained(part)
    Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}).save_pretrained(part)
    os.replace(part, folder)
    return folder


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", type=int, nargs="+", default=[1, 5], help="tiles per image (default 1 5)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch
    from transformers import Idefics3ForConditionalGeneration

    from llaisys.cli.main import apply_threads
    from llaisys.models import load_model

    apply_threads(args.threads)
    torch.set_num_threads(args.threads)
    folder = build(CACHE / "smolvlm-256m-vision-f32")
    ours = load_model(str(folder)).vision
    theirs = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    d, f, layers, p = VISION["hidden_size"], VISION["intermediate_size"], VISION["num_hidden_layers"], 1024
    macs = layers * (p * (4 * d * d + 2 * d * f) + 2 * p * p * d) + p * 3 * 16 * 16 * d + (p // 16) * 16 * d * 576
    print(f"{folder.name}: {layers} layers of {d}, {p} patches a tile; {macs / 1e9:.1f} G multiply-adds a tile; "
          f"{args.threads} threads, median of {args.repeats}")
    rng = np.random.default_rng(0)
    for n in args.tiles:
        pixels = rng.standard_normal((n, 3, 512, 512)).astype(np.float32)
        tensor = torch.from_numpy(pixels)

        def run_ours():
            return ours.projector.project(ours.encoder.encode(pixels))

        def run_theirs():
            with torch.no_grad():
                return theirs.model.get_image_features(tensor[None]).pooler_output[0].numpy()

        gap = float(np.abs(run_ours() - run_theirs()).max())
        a, b = timed(run_ours, args.repeats), timed(run_theirs, args.repeats)
        print(f"{n} tile(s): llaisys {a * 1000:.0f} ms ({a / n * 1000:.0f} ms a tile, "
              f"{macs * n / a / 1e9:.0f} GMAC/s), transformers {b * 1000:.0f} ms; ratio {b / a:.2f}x "
              f"(max |diff| {gap:.1e})")


if __name__ == "__main__":
    main()
