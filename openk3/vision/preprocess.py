"""Images -> the tower's packed input, and prompts with one placeholder per image token.

The K3 release's image processor (``preprocessor_config.json``'s ``media_proc_cfg``; values
and sources in docs/vision.md), for still images:

0. (openk3's) an image Pillow cannot resample bicubically or convert to RGB without loss made
   8-bit first: palette and 1-bit images to RGB(A) (Pillow resizes a palette image by its
   nearest neighbour), 16-bit greyscale scaled to 0..255 (``convert("RGB")`` clips it at 255);
   float images are refused (no fixed range);
1. transparency composited onto an 8-pixel chessboard (white 255 at the top left, grey 180);
2. the image scaled down (bicubic), never up, so that it holds at most ``in_patch_limit``
   patches and at most ``patch_limit_on_one_side`` patches per side (fewer if the model's
   ``rope_max_grid`` is smaller);
3. zero pixels padded at the bottom and the right up to a multiple of ``patch_size`` x
   ``merge_kernel_size`` (28 pixels), so the patch grid merges 2 x 2 exactly;
4. ``(pixel / 255 - 0.5) / 0.5`` per channel;
5. cut into ``patch_size`` patches in row-major order: ``[h * w, 3, p, p]`` and the grid (h, w).

The prompt holds one ``media_placeholder_token_id`` per merged token,
``(h / 2) * (w / 2)`` per image, in image order (``expand_placeholders``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from openk3.config import VisionConfig

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
IN_PATCH_LIMIT = 65536  # patches per image
PATCH_LIMIT_ON_ONE_SIDE = 512
CHESSBOARD = (8, 255, 180)  # square size, the top-left (white) value, the other (grey) value


@dataclass
class PackedImages:
    """Several images in the tower's packed layout.

    pixel_values: [L, 3, p, p] fp32 normalised patches, image after image, each in row-major
        patch order; L = sum of h * w.
    grid_hws: each image's patch grid (rows, columns).
    """

    pixel_values: torch.Tensor
    grid_hws: tuple[tuple[int, int], ...]

    def tokens_per_image(self, cfg: VisionConfig) -> list[int]:
        kh, kw = cfg.merge_kernel_size
        return [(h // kh) * (w // kw) for h, w in self.grid_hws]

    @classmethod
    def cat(cls, packs: list[PackedImages]) -> PackedImages:
        """Several packs as one, in order."""
        return cls(torch.cat([p.pixel_values for p in packs]), tuple(g for p in packs for g in p.grid_hws))

    def to(self, device: torch.device | str) -> PackedImages:
        return PackedImages(self.pixel_values.to(device), self.grid_hws)

    def content_hashes(self) -> list[bytes]:
        """One digest per image of its patches and grid: equal images give equal digests (the
        serving prefix cache keys image positions by them)."""
        out, start = [], 0
        for h, w in self.grid_hws:
            patches = self.pixel_values[start:start + h * w].detach().cpu().contiguous()
            digest = hashlib.sha256(f"{h}x{w}".encode())
            digest.update(patches.numpy().tobytes())
            out.append(digest.digest())
            start += h * w
        return out


def side_limit_of(cfg: VisionConfig) -> int:
    """Patches per side at most: the release's 512, or fewer where the model's RoPE table
    (``rope_max_grid``) is smaller, rounded down to whole merge kernels (padding then stays
    inside it)."""
    step = math.lcm(*cfg.merge_kernel_size)
    return min(PATCH_LIMIT_ON_ONE_SIDE, max(step, cfg.rope_max_grid // step * step))


def resized_size(width: int, height: int, cfg: VisionConfig, in_patch_limit: int = IN_PATCH_LIMIT,
                 side_limit: int | None = None) -> tuple[int, int]:
    """(width, height) after step 2: scaled by the largest factor <= 1 within both limits
    (``side_limit``: ``side_limit_of(cfg)`` when None)."""
    side_limit = side_limit_of(cfg) if side_limit is None else side_limit
    p = cfg.patch_size
    scale = min(1.0, math.sqrt(in_patch_limit / (max(1, width // p) * max(1, height // p))),
                side_limit * p / width, side_limit * p / height)
    new_w = min(max(1, int(width * scale)), side_limit * p)
    new_h = min(max(1, int(height * scale)), side_limit * p)
    return new_w, new_h


def _eight_bit(image: Image.Image) -> Image.Image:
    """Step 0: ``image`` in a mode Pillow resizes bicubically and converts to RGB as it is."""
    mode = image.mode
    if mode == "F":
        raise ValueError("a 32-bit float image has no fixed range of values: convert it to 8 bits first")
    if mode.startswith("I"):  # I;16 / I;16B / ...: 16-bit; I: 16-bit data when above 255
        values = np.asarray(image, dtype=np.float64)
        if mode.startswith("I;16") or values.max(initial=0) > 255:
            values = values * (255 / 65535)
        return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), mode="L")
    if mode == "La":  # premultiplied: Pillow converts it to LA only
        return image.convert("LA")
    if mode in ("RGB", "RGBA", "L", "LA"):
        return image
    keeps_alpha = {"A", "a"} & set(image.getbands()) or "transparency" in image.info
    return image.convert("RGBA" if keeps_alpha else "RGB")


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if "A" not in image.getbands() and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = np.asarray(image.convert("RGBA"), dtype=np.float32)
    size, white, grey = CHESSBOARD
    ys = np.arange(rgba.shape[0])[:, None] // size
    xs = np.arange(rgba.shape[1])[None, :] // size
    board = np.where(((xs + ys) % 2 == 1)[..., None], grey, white).astype(np.float32)
    alpha = rgba[..., 3:] / 255.0
    return Image.fromarray((alpha * rgba[..., :3] + (1 - alpha) * board).astype(np.uint8))


def preprocess_image(image: Image.Image, cfg: VisionConfig, in_patch_limit: int = IN_PATCH_LIMIT,
                     side_limit: int | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
    """One PIL image -> (patches [h * w, 3, p, p] fp32, its grid (h, w)): steps 0-5 above.
    Raises ``ValueError`` for a float image."""
    p = cfg.patch_size
    image = _eight_bit(image)
    width, height = image.size
    new_size = resized_size(width, height, cfg, in_patch_limit, side_limit)
    # transparency is composited after the resize (the release's "after_resize")
    if new_size != (width, height):
        image = image.resize(new_size, resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(_to_rgb(image), dtype=np.float32)  # [H, W, 3]
    factor_h, factor_w = p * cfg.merge_kernel_size[0], p * cfg.merge_kernel_size[1]
    pad_h, pad_w = -pixels.shape[0] % factor_h, -pixels.shape[1] % factor_w
    pixels = np.pad(pixels, ((0, pad_h), (0, pad_w), (0, 0)))
    pixels = (pixels / 255.0 - np.array(IMAGE_MEAN, np.float32)) / np.array(IMAGE_STD, np.float32)
    H, W = pixels.shape[:2]
    h, w = H // p, W // p
    patches = torch.from_numpy(np.ascontiguousarray(
        pixels.reshape(h, p, w, p, 3).transpose(0, 2, 4, 1, 3))).reshape(h * w, 3, p, p)
    return patches.float(), (h, w)


def pack_images(images: list[Image.Image], cfg: VisionConfig, **limits: int) -> PackedImages:
    """Preprocess each image and pack them (``limits``: ``in_patch_limit``, ``side_limit``).
    Raises ``ValueError`` naming ``images[k]``."""
    done = []
    for k, im in enumerate(images):
        try:
            done.append(preprocess_image(im, cfg, **limits))
        except ValueError as e:
            raise ValueError(f"images[{k}]: {e}") from e
    return PackedImages(torch.cat([d[0] for d in done]), tuple(d[1] for d in done))


def load_image(path: str) -> Image.Image:
    """Open an image file fully (decoding errors surface here, naming the file)."""
    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"{path}: cannot read the image ({e})") from e


def expand_placeholders(ids: list[int], tokens_per_image: list[int], placeholder_id: int) -> list[int]:
    """Replace the k-th ``placeholder_id`` of ``ids`` (one per image, as a chat template writes
    it) by ``tokens_per_image[k]`` copies. Raises ``ValueError`` when the counts differ."""
    slots = [i for i, t in enumerate(ids) if t == placeholder_id]
    if len(slots) != len(tokens_per_image):
        raise ValueError(f"the prompt holds {len(slots)} image placeholders (id {placeholder_id}) "
                         f"for {len(tokens_per_image)} images")
    out, prev = [], 0
    for slot, n in zip(slots, tokens_per_image):
        out += ids[prev:slot] + [placeholder_id] * n
        prev = slot + 1
    return out + ids[prev:]


def image_prompt_ids(token_id: Callable[[str], int | None], encode: Callable[[str], list[int]],
                     sizes: list[tuple[int, int]], tokens_per_image: list[int],
                     placeholder_id: int) -> list[int]:
    """The tokens of the images' blocks, before the text. Per image, the release's chat format
    ``<|media_begin|>image {W}x{H}<|media_content|>`` + placeholders + ``<|media_end|>`` when
    the tokenizer knows ``<|media_content|>``; the debug-vl corpus's ``<|media_begin|>`` +
    placeholders + ``<|media_end|>`` otherwise; bare placeholders without either.

    token_id: the id of a special token or None; encode: plain text -> ids; sizes: each image's
    (width, height) as given."""
    begin, content, end = (token_id(t) for t in ("<|media_begin|>", "<|media_content|>", "<|media_end|>"))
    out: list[int] = []
    for (w, h), n in zip(sizes, tokens_per_image):
        head = ([begin] if begin is not None else []) + (
            encode(f"image {w}x{h}") + [content] if content is not None else [])
        out += head + [placeholder_id] * n + ([end] if end is not None else [])
    return out
