"""Images in serving requests: raw images -> the packed tower input, prompt ids with their
placeholders, and the per-request descriptor the scheduler sees (``ImageSpan``: positions and a
content digest, no tensors).

Where each image goes in the prompt (``place_images``): the prompt's token ids hold either one
``media_placeholder_token_id`` per image (as a chat template writes it; each is expanded in place
to the image's token count) or none (each image's block, ``image_prompt_ids`` — the release's
``<|media_begin|>image {W}x{H}<|media_content|>`` pads ``<|media_end|>`` when the tokenizer knows
those tokens, bare pads otherwise — goes first, after a leading bos).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from PIL import Image

from openk3.serve.sequence import ImageSpan
from openk3.vision.preprocess import PackedImages, expand_placeholders, image_prompt_ids

ImageLike = Image.Image | str | os.PathLike | bytes
MAX_IMAGE_PIXELS = 1 << 26  # 64M pixels (8192 x 8192) before decoding; the tower sees <= 12.8M


@dataclass(frozen=True)
class MultiModalInput:
    """A request's images: ``images`` in the tower's packed layout (on the host) and where each
    one's features go in the (expanded) prompt."""

    images: PackedImages
    spans: tuple[ImageSpan, ...]


def open_image(image: ImageLike, where: str, max_bytes: int | None = None) -> Image.Image:
    """A PIL image, a file path or the encoded bytes of a file -> a decoded PIL image. Raises
    ``ValueError`` starting with ``where`` (e.g. ``images[1]``) for anything unreadable, an
    encoded size over ``max_bytes`` or more than ``MAX_IMAGE_PIXELS`` pixels (``TypeError`` for
    another type)."""
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, (str, os.PathLike)):
        source, name = image, os.fspath(image)
    elif isinstance(image, (bytes, bytearray)):
        source, name = io.BytesIO(image), "the data"
        if max_bytes is not None and len(image) > max_bytes:
            raise ValueError(f"{where}: the image is {len(image)} bytes, over the limit of {max_bytes}")
    else:
        raise TypeError(f"{where}: expected a PIL image, a file path or bytes, got {type(image).__name__}")
    try:
        with Image.open(source) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"{where}: {im.width}x{im.height} pixels is over the limit of "
                                 f"{MAX_IMAGE_PIXELS} pixels")
            im.load()
            return im.copy()
    except (OSError, Image.DecompressionBombError, SyntaxError) as e:
        raise ValueError(f"{where}: {name} is not a readable image ({e})") from e


def special_token_id(tokenizer, name: str) -> int | None:
    """The id of special token ``name`` (e.g. ``<|media_begin|>``), or None when the tokenizer
    has none (``token_id`` of openk3's tokenizers; a tokenizer without it knows none)."""
    token_id = getattr(tokenizer, "token_id", None)
    return None if token_id is None else token_id(name)


def place_images(ids: list[int], images: PackedImages, sizes: Sequence[tuple[int, int]],
                 tokens_per_image: list[int], placeholder_id: int, encode: Callable[[str], list[int]],
                 token_id: Callable[[str], int | None], bos_id: int | None,
                 ) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """The prompt ids with one placeholder per image token (the module's docstring says where)
    and each image's span. sizes: (width, height) as given; raises ``ValueError`` for a prompt
    holding another number of placeholders than 0 or one per image."""
    count = ids.count(placeholder_id)
    if count == 0:
        at = 1 if ids[:1] == [bos_id] and bos_id is not None else 0
        blocks = image_prompt_ids(token_id, encode, list(sizes), [1] * len(sizes), placeholder_id)
        ids = ids[:at] + blocks + ids[at:]
    elif count != len(tokens_per_image):
        raise ValueError(f"the prompt holds {count} image placeholder tokens (id {placeholder_id}) "
                         f"for {len(tokens_per_image)} images: give one per image, where it goes, "
                         "or none (the images then go first)")
    ids = expand_placeholders(ids, tokens_per_image, placeholder_id)
    slots = [i for i, t in enumerate(ids) if t == placeholder_id]
    spans, k = [], 0
    for n, digest in zip(tokens_per_image, images.content_hashes()):
        spans.append(ImageSpan(slots[k], n, digest))
        k += n
    return ids, tuple(spans)
