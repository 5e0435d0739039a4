"""Vision: the MoonViT-V2 tower, the projector and image preprocessing (docs/vision.md)."""

from openk3.vision.preprocess import PackedImages, expand_placeholders, load_image, pack_images
from openk3.vision.tower import MoonViT, Projector, splice_image_features

__all__ = ["MoonViT", "PackedImages", "Projector", "expand_placeholders", "load_image",
           "pack_images", "splice_image_features"]
