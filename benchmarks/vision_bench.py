"""Vision tower throughput and the time an image adds to the first token (run on the device).

1. Images/s of the release-size MoonViT-V2 tower + projector (random weights, bf16) at
   448x448 (32x32 patches, 256 LM tokens) and 1024x1024 (padded to 1036: 74x74 patches, 1369
   LM tokens): ``packed`` = all images of a batch in one call (one FlashAttention varlen call
   per block), against the peer ``one-by-one`` = the same images one call each.
2. Added time to first token: prefill of a 64-token text prompt on the ``small`` language model
   with the release tower attached, without and with one image (its encoding plus its extra
   prompt tokens), batch 1, bf16.
3. The same through the serving engine (``LLMEngine``, request in to first token out: image
   preprocessing, the tower at prefill, the packed prefill, sampling), prefix cache off, against
   the text-only prompt; and the same image again with the prefix cache on (a hit past the
   image: the tower does not run).

    python benchmarks/vision_bench.py [--batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cuda_time, write_results  # noqa: E402
from openk3.config import VisionConfig, preset  # noqa: E402
from openk3.model import build_model  # noqa: E402
from openk3.serve.config import EngineConfig  # noqa: E402
from openk3.serve.engine import LLMEngine  # noqa: E402
from openk3.serve.sampler import SamplingParams  # noqa: E402
from openk3.tokenizer import ByteTokenizer  # noqa: E402
from openk3.vision import MoonViT, PackedImages, Projector  # noqa: E402
from openk3.vision.preprocess import expand_placeholders  # noqa: E402

SIZES = {"448x448": (32, 32), "1024x1024": (74, 74)}


def images_of(grid: tuple[int, int], n: int) -> PackedImages:
    h, w = grid
    return PackedImages(torch.randn(n * h * w, 3, 14, 14, device="cuda", dtype=torch.bfloat16),
                        (grid,) * n)


def tower_rows(batch: int) -> list[dict]:
    cfg = VisionConfig()
    tower = MoonViT(cfg).cuda().bfloat16().eval()
    proj = Projector(cfg, 7168).cuda().bfloat16().eval()
    with torch.no_grad():
        for p in list(tower.parameters()) + list(proj.parameters()):
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.02)
    rows = []
    for name, grid in SIZES.items():
        packed = images_of(grid, batch)
        one = images_of(grid, 1)

        @torch.no_grad()
        def run_packed():
            proj(tower(packed.pixel_values, packed.grid_hws))

        @torch.no_grad()
        def run_one_by_one():
            for _ in range(batch):
                proj(tower(one.pixel_values, one.grid_hws))

        t_packed = cuda_time(run_packed, warmup=2, iters=5)
        t_single = cuda_time(run_one_by_one, warmup=1, iters=3)
        rows.append({"size": name, "batch": batch, "patches_per_image": grid[0] * grid[1],
                     "packed_images_per_s": batch / t_packed,
                     "one_by_one_images_per_s": batch / t_single,
                     "speedup": t_single / t_packed})
        print(rows[-1], flush=True)
    return rows


def vl_model():
    cfg = preset("small").replace(vision_config=VisionConfig(media_placeholder_token_id=3))
    return build_model(cfg, device="cuda", dtype=torch.bfloat16).eval()


def ttft_rows(model) -> list[dict]:
    cfg = model.cfg
    rows = []
    text = list(range(10, 74))  # 64 text tokens
    with torch.no_grad():
        t_text = cuda_time(lambda: model(torch.tensor([text], device="cuda"), model.new_cache(),
                                         logits_to_keep=1), warmup=2, iters=5)
        for name, grid in SIZES.items():
            images = images_of(grid, 1)
            n = images.tokens_per_image(cfg.vision_config)[0]
            ids = torch.tensor([expand_placeholders([1, 3] + text, [n], 3)], device="cuda")
            t_img = cuda_time(lambda: model(ids, model.new_cache(), logits_to_keep=1, images=images),
                              warmup=2, iters=5)
            t_enc = cuda_time(lambda: model.encode_images(images), warmup=2, iters=5)
            rows.append({"size": name, "image_tokens": n, "ttft_text_ms": 1e3 * t_text,
                         "ttft_with_image_ms": 1e3 * t_img, "added_ms": 1e3 * (t_img - t_text),
                         "of_which_tower_ms": 1e3 * t_enc})
            print(rows[-1], flush=True)
    return rows


def engine_ttft(engine: LLMEngine, prompt: list[int], images: list[Image.Image] | None,
                repeats: int = 5) -> float:
    """Median seconds from request to first token through ``engine`` (the first call warms up)."""
    params = SamplingParams(temperature=0, max_tokens=1)
    request = {"prompt": prompt, "images": images} if images else prompt
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate([request], params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def engine_ttft_rows(model) -> list[dict]:
    def engine(prefix_caching: bool) -> LLMEngine:
        return LLMEngine(model, ByteTokenizer(), EngineConfig(
            max_num_seqs=1, max_model_len=4096, physical_block_size=256, hash_block_size=16,
            kda_checkpoint_interval=1024, enable_prefix_caching=prefix_caching), eos_token_ids=())

    cold, warm = engine(False), engine(True)
    text = list(range(10, 74))  # 64 text tokens; the image prompt: bos, its placeholder, the text
    t_text = engine_ttft(cold, [1] + text, None)
    rng = np.random.default_rng(0)
    rows = []
    for name in SIZES:
        w, h = map(int, name.split("x"))
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        t0 = time.perf_counter()
        _, mm = cold.prepare_images([1, 3] + text, [image])
        t_prep = time.perf_counter() - t0
        t_cold = engine_ttft(cold, [1, 3] + text, [image])
        encoded = warm.runner.num_images_encoded
        t_hit = engine_ttft(warm, [1, 3] + text, [image])
        rows.append({"size": name, "image_tokens": mm.spans[0].length, "engine_ttft_text_ms": 1e3 * t_text,
                     "engine_ttft_image_ms": 1e3 * t_cold, "added_ms": 1e3 * (t_cold - t_text),
                     "of_which_preprocess_ms": 1e3 * t_prep, "engine_ttft_image_cached_ms": 1e3 * t_hit,
                     "tower_runs_when_cached": warm.runner.num_images_encoded - encoded - 1})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("vision_bench needs CUDA")
    write_results("vision_tower", tower_rows(args.batch))
    model = vl_model()
    write_results("vision_ttft", ttft_rows(model))
    write_results("vision_engine_ttft", engine_ttft_rows(model))  # fuses the model's projections


if __name__ == "__main__":
    main()
