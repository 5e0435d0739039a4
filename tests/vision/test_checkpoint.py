"""Vision tensors in K3-format checkpoints: exact names and shapes, save -> load round trip,
text-only loads, errors naming the tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import openk3
from openk3.checkpoint.hf import CheckpointError, _hf_tensors
from openk3.checkpoint.hf_config import from_hf, to_hf
from openk3.config import VisionConfig, preset
from openk3.model import build_model
from tests.vision.test_tower import TINY, random_images, tiny_model


def test_release_vision_tensor_names_and_shapes():
    """The K3 release's vision tensors, as save_pretrained names and shapes them (meta device)."""
    cfg = preset("debug").replace(vision_config=VisionConfig(media_placeholder_token_id=3))
    got = {name: tuple(t.shape) for name, t in _hf_tensors(build_model(cfg, device="meta"), "bf16")
           if name.startswith(("vision_tower.", "mm_projector."))}
    want = {"vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
            "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
            "vision_tower.encoder.final_layernorm.weight": (1024,),
            "mm_projector.proj.0.weight": (4096, 4096),
            "mm_projector.proj.2.weight": (cfg.hidden_size, 4096),
            "mm_projector.post_norm.weight": (cfg.hidden_size,)}
    for i in range(27):
        b = f"vision_tower.encoder.blocks.{i}."
        want.update({b + "norm0.weight": (1024,), b + "norm1.weight": (1024,),
                     b + "wqkv.weight": (3 * 1536, 1024), b + "wo.weight": (1024, 1536),
                     b + "mlp.fc0.weight": (4096, 1024), b + "mlp.fc1.weight": (1024, 4096)})
    assert got == want
    tower = sum(n for k, s in want.items() if k.startswith("vision_tower.")
                for n in [torch.Size(s).numel()])
    assert round(tower / 1e6) == 401  # the report's "MoonViT-V2 (401M)"


def test_release_vision_config_is_written_like_the_release():
    from tests.checkpoint.test_hf_config import official_k3_config

    written = to_hf(preset("k3"))
    release = official_k3_config()
    assert written["media_placeholder_token_id"] == 163605
    # a fresh export writes every key of the release's vision_config except the video-only
    # temporal table size and the attention backend, which openk3 does not model
    assert written["vision_config"] == {k: v for k, v in release["vision_config"].items()
                                        if k not in ("_attn_implementation", "init_pos_emb_time")}
    assert from_hf(release).vision_config == VisionConfig()


def test_unsupported_vision_choices_name_the_key():
    from tests.checkpoint.test_hf_config import official_k3_config

    release = official_k3_config()
    release["vision_config"]["norm_type"] = "layernorm"
    with pytest.raises(ValueError, match="vision_config.norm_type='layernorm' is not supported"):
        from_hf(release)


def _state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_save_load_round_trip_with_images(tmp_path):
    model = tiny_model()
    openk3.save_pretrained(model, tmp_path / "ck")
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert config["vision_config"]["vt_hidden_size"] == TINY.vt_hidden_size
    assert config["media_placeholder_token_id"] == TINY.media_placeholder_token_id
    stored = {}
    for f in (tmp_path / "ck").glob("*.safetensors"):
        stored.update(load_file(str(f)))
    assert torch.equal(stored["vision_tower.encoder.blocks.1.wqkv.weight"],
                       model.vision_tower.encoder.blocks[1].wqkv.weight)
    assert torch.equal(stored["mm_projector.proj.2.weight"], model.mm_projector.proj[2].weight)

    loaded = openk3.load_pretrained(tmp_path / "ck")
    assert loaded.cfg == model.cfg
    _state_equal(model, loaded)
    images = random_images([(2, 4), (4, 4)], TINY.patch_size)
    ids = torch.tensor([[1] + [5] * 2 + [7] + [5] * 4 + [8]])
    with torch.no_grad():
        assert torch.equal(model(ids, images=images).logits, loaded(ids, images=images).logits)


def test_text_only_load_skips_the_vision_tensors(tmp_path, capsys):
    model = tiny_model()
    openk3.save_pretrained(model, tmp_path / "ck")
    text = openk3.load_pretrained(tmp_path / "ck", vision=False)
    assert text.cfg.vision_config is None and not hasattr(text, "vision_tower")
    n_vision = sum(1 for n, _ in model.named_parameters() if n.startswith(("vision_", "mm_")))
    assert f"skipped {n_vision} vision tensors" in capsys.readouterr().err
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, text(ids).logits)
    # its export still describes the release's vision part, and, lacking the tensors, loads text-only
    openk3.save_pretrained(text, tmp_path / "text")
    assert "vision_config" in json.loads((tmp_path / "text" / "config.json").read_text())
    assert openk3.load_pretrained(tmp_path / "text").cfg.vision_config is None
    with pytest.raises(CheckpointError, match="vision=True but config.json has no vision_config"):
        openk3.load_pretrained(_text_ckpt(tmp_path), vision=True)


def _text_ckpt(tmp_path):
    openk3.save_pretrained(build_model(preset("debug").replace(num_hidden_layers=1, full_attn_layers=(1,),
                                                               attn_res_block_size=None)), tmp_path / "t")
    return tmp_path / "t"


def test_missing_vision_tensor_is_named(tmp_path):
    openk3.save_pretrained(tiny_model(), tmp_path / "ck")
    (f,) = list((tmp_path / "ck").glob("*.safetensors"))
    tensors = load_file(str(f))
    del tensors["vision_tower.encoder.blocks.0.wo.weight"]
    save_file(tensors, str(f))
    with pytest.raises(CheckpointError, match=r"vision_tower\.encoder\.blocks\.0\.wo\.weight"):
        openk3.load_pretrained(tmp_path / "ck")
