"""The vision tower against the plain reference, packing, merging, splicing, preprocessing."""

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from openk3.config import ModelConfig, VisionConfig, preset
from openk3.model import build_model
from openk3.vision import PackedImages, expand_placeholders, pack_images
from openk3.vision.preprocess import preprocess_image, resized_size
from openk3.vision.tower import merge_patches, splice_image_features
from tests.vision.reference import reference_features

# tiny: 2 blocks, 2 heads of 8 (qkv 16 != width 24), 4x4 position table
TINY = VisionConfig(vt_hidden_size=24, vt_num_hidden_layers=2, vt_num_attention_heads=2,
                    qkv_hidden_size=16, vt_intermediate_size=40, patch_size=4,
                    init_pos_emb_height=4, init_pos_emb_width=4, media_placeholder_token_id=5)


def tiny_model(vision: VisionConfig = TINY, seed: int = 0):
    cfg = preset("debug").replace(hidden_size=32, num_hidden_layers=2, full_attn_layers=(2,),
                                  attn_res_block_size=None, vocab_size=64, vision_config=vision)
    model = build_model(cfg, seed=seed)
    with torch.no_grad():  # non-trivial norms, so a wrong norm weight shows
        for name, p in model.named_parameters():
            if name.startswith(("vision_tower.", "mm_projector.")) and p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
            elif name.startswith(("vision_tower.", "mm_projector.")):
                p.mul_(5.0)  # the 0.02 init makes every block nearly the identity
    return model.eval()


def random_images(grids, p, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = sum(h * w for h, w in grids)
    return PackedImages(torch.randn(L, 3, p, p, generator=g), tuple(grids))


@pytest.mark.parametrize("vision", [TINY, dataclasses.replace(TINY, norm_eps=1e-3)])
def test_tower_matches_reference(vision):
    """Grids 4x4 (the table itself), 2x6 and 6x4 (resampled), packed in one call."""
    model = tiny_model(vision)
    images = random_images([(4, 4), (2, 6), (6, 4)], vision.patch_size)
    with torch.no_grad():
        got = model.encode_images(images)
        want = reference_features(dict(model.state_dict()), vision, images.pixel_values, images.grid_hws)
    assert got.shape == (4 + 3 + 6, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tower_gradients_match_reference():
    model = tiny_model()
    images = random_images([(2, 2), (4, 2)], TINY.patch_size, seed=1)
    names = [n for n, _ in model.named_parameters() if n.startswith(("vision_tower.", "mm_projector."))]
    params = dict(model.named_parameters())
    weights = torch.randn(1 + 2, 32, generator=torch.Generator().manual_seed(2))
    (model.encode_images(images) * weights).sum().backward()
    got = {n: params[n].grad.clone() for n in names}
    sd = {n: p.detach().clone().requires_grad_(True) for n, p in params.items() if n in names}
    (reference_features(sd, TINY, images.pixel_values, images.grid_hws) * weights).sum().backward()
    for n in names:
        torch.testing.assert_close(got[n], sd[n].grad, rtol=1e-4, atol=1e-5, msg=n)


def test_packed_batch_equals_images_one_by_one():
    model = tiny_model()
    grids = [(2, 4), (6, 6), (4, 2), (2, 2)]
    images = random_images(grids, TINY.patch_size, seed=3)
    with torch.no_grad():
        packed = model.encode_images(images)
        one_by_one, start = [], 0
        for h, w in grids:
            one = PackedImages(images.pixel_values[start:start + h * w], ((h, w),))
            one_by_one.append(model.encode_images(one))
            start += h * w
    torch.testing.assert_close(packed, torch.cat(one_by_one), rtol=1e-5, atol=1e-6)


def test_merge_takes_row_major_2x2_windows():
    x = torch.arange(4 * 6).float()[:, None]  # a 4x6 grid whose value is its patch index
    merged = merge_patches(x, [(4, 6)], (2, 2))
    assert merged.shape == (6, 4)
    assert merged[0].tolist() == [0, 1, 6, 7] and merged[1].tolist() == [2, 3, 8, 9]
    assert merged[3].tolist() == [12, 13, 18, 19]


def test_bad_grids_are_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="multiples of the merge kernel"):
        model.encode_images(random_images([(3, 4)], TINY.patch_size))
    with pytest.raises(ValueError, match="cover 16 patches, pixel_values holds 8"):
        model.encode_images(PackedImages(torch.zeros(8, 3, 4, 4), ((4, 4),)))
    with pytest.raises(ValueError, match=r"\[L, 3, 4, 4\]"):
        model.encode_images(PackedImages(torch.zeros(16, 3, 5, 5), ((4, 4),)))


def test_splice_places_features_at_placeholders_only():
    embeds = torch.zeros(2, 5, 3)
    ids = torch.tensor([[1, 9, 9, 2, 9], [9, 3, 4, 5, 6]])
    features = torch.arange(4 * 3).float().view(4, 3) + 1
    out = splice_image_features(embeds, ids, features, placeholder_id=9)
    assert out[0, 1].tolist() == features[0].tolist() and out[0, 2].tolist() == features[1].tolist()
    assert out[0, 4].tolist() == features[2].tolist() and out[1, 0].tolist() == features[3].tolist()
    keep = ids != 9
    assert torch.all(out[keep] == 0)
    with pytest.raises(ValueError, match="holds 4 image placeholder tokens .* give 3 features"):
        splice_image_features(embeds, ids, features[:3], placeholder_id=9)


def test_model_forward_with_images_uses_the_features():
    """Logits with an image equal logits computed from hand-spliced embeddings; text-only
    positions before the image are unaffected."""
    model = tiny_model()
    images = random_images([(2, 4)], TINY.patch_size)
    ids = torch.tensor([expand_placeholders([1, 7, 5, 8, 9], [2], placeholder_id=5)])
    with torch.no_grad():
        feats = model.encode_images(images)
        out = model(ids, images=images).logits
        embeds = model.model.embed_tokens(ids).clone()
        embeds[0, 2:4] = feats
        want = model.lm_head(model.model(ids, inputs_embeds=embeds))
        text_only = model(ids).logits
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(out[:, :2], text_only[:, :2])
    assert not torch.allclose(out[:, 2:], text_only[:, 2:])
    with pytest.raises(ValueError, match="images or image_embeds, not both"):
        model(ids, images=images, image_embeds=feats)


def test_text_model_refuses_images():
    model = build_model(ModelConfig(**{**preset("debug").to_dict(), "num_hidden_layers": 1,
                                       "full_attn_layers": (1,), "attn_res_block_size": None}))
    with pytest.raises(ValueError, match="no vision tower"):
        model.encode_images(random_images([(2, 2)], 14))


def test_expand_placeholders():
    assert expand_placeholders([1, 5, 2, 5], [2, 3], 5) == [1, 5, 5, 2, 5, 5, 5]
    with pytest.raises(ValueError, match="2 image placeholders .* for 1 images"):
        expand_placeholders([1, 5, 2, 5], [2], 5)


def test_preprocess_layout_padding_and_normalisation():
    cfg = VisionConfig(patch_size=2, merge_kernel_size=(2, 2))
    pixels = np.random.default_rng(0).integers(0, 256, size=(6, 10, 3), dtype=np.uint8)
    patches, grid = preprocess_image(Image.fromarray(pixels), cfg)
    assert grid == (4, 6)  # 6x10 pixels -> padded to 8x12 (multiples of 2 * 2) -> 4x6 patches
    assert patches.shape == (24, 3, 2, 2)
    norm = lambda v: (v / 255.0 - 0.5) / 0.5  # noqa: E731
    # patch (row 1, column 2) holds pixels rows 2-3, columns 4-5, channel-first
    want = norm(torch.from_numpy(pixels[2:4, 4:6].astype(np.float32))).permute(2, 0, 1)
    torch.testing.assert_close(patches[1 * 6 + 2], want)
    assert torch.all(patches[-1] == -1.0)  # padding: black pixels
    assert torch.all(patches[3 * 6 + 0, :, 1] == -1.0)  # the padded last pixel row


def test_resize_limits_and_packing():
    cfg = VisionConfig()
    assert resized_size(448, 448, cfg) == (448, 448)  # never scaled up, within both limits
    w, h = resized_size(14 * 1000, 14 * 100, cfg)  # 1000 patches wide: over 512 on one side
    assert w <= 14 * 512 and h == int(1400 * (512 * 14) / 14000)
    w, h = resized_size(4000, 4000, cfg, in_patch_limit=1024)
    assert (w // 14) * (h // 14) <= 1024
    packed = pack_images([Image.new("RGB", (56, 28)), Image.new("RGBA", (30, 30))], cfg)
    assert packed.grid_hws == ((2, 4), (4, 4))
    assert packed.pixel_values.shape == (8 + 16, 3, 14, 14)
    assert packed.tokens_per_image(cfg) == [2, 4]
    a, b = packed.content_hashes()
    assert a != b and pack_images([Image.new("RGB", (56, 28))], cfg).content_hashes() == [a]


def _stripes(mode: str) -> Image.Image:
    """1-pixel black and white columns, 2,000 wide: a bicubic resize greys them, a nearest
    neighbour one keeps two levels."""
    row = np.tile(np.array([0, 255], np.uint8), 1000)
    grey = Image.fromarray(np.repeat(row[None], 28, axis=0), mode="L")
    if mode == "La":  # Pillow makes La only from LA
        return grey.convert("LA").convert("La")
    return grey.convert(mode)


@pytest.mark.parametrize("mode", ["P", "PA", "1", "La"])
def test_every_mode_is_resized_bicubically_as_8_bit_rgb(mode):
    """A palette image was resized by its nearest neighbour (Pillow's rule for mode P), PA came
    out black, La raised; each now gives what its 8-bit RGB form gives."""
    cfg = VisionConfig()
    got, grid = preprocess_image(_stripes(mode), cfg, side_limit=28)
    reference = {"P": "RGB", "PA": "RGBA", "1": "RGB", "La": "LA"}[mode]
    want, want_grid = preprocess_image(_stripes(mode).convert(reference), cfg, side_limit=28)
    assert grid == want_grid and torch.equal(got, want)
    assert len(torch.unique(got[:, :, :, :])) > 4  # grey levels, not just black and white


def test_16_bit_images_are_scaled_and_float_ones_refused():
    """convert("RGB") clipped 16-bit values at 255: mid grey came out white."""
    cfg = VisionConfig()
    mid = Image.fromarray(np.full((28, 28), 32896, np.uint16))  # 128.0 of 255 (I;16)
    assert mid.mode == "I;16"
    patches, _ = preprocess_image(mid, cfg)
    torch.testing.assert_close(patches, torch.full_like(patches, (128 / 255 - 0.5) / 0.5))
    with pytest.raises(ValueError, match=r"images\[1\]: a 32-bit float image"):
        pack_images([mid, Image.fromarray(np.full((28, 28), 0.5, np.float32))], cfg)


def test_the_side_limit_follows_the_models_rope_table():
    """rope_max_grid was ignored: a 1000-patch-wide image passed the preprocessor and failed in
    the tower's RoPE."""
    cfg = VisionConfig(rope_max_grid=65)
    _, (h, w) = preprocess_image(Image.new("RGB", (14 * 1000, 28)), cfg)
    assert w == 64 and h == 2  # 65 rounded down to whole 2 x 2 merge kernels


def test_image_prompt_formats():
    from openk3.vision.preprocess import image_prompt_ids

    k3 = {"<|media_begin|>": 101, "<|media_content|>": 102, "<|media_end|>": 103}
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    ids = image_prompt_ids(k3.get, encode, [(28, 14)], [2], placeholder_id=105)
    assert ids == [101] + encode("image 28x14") + [102, 105, 105, 103]
    demo = {"<|media_begin|>": 4, "<|media_end|>": 5}
    assert image_prompt_ids(demo.get, encode, [(1, 1), (2, 2)], [1, 2], 3) == [4, 3, 5, 4, 3, 3, 5]
