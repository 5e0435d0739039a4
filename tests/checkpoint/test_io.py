"""K3-format checkpoints: round trips, MXFP4 experts, A_log padding, and every error path."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import openk3
from openk3 import build_model, preset
from openk3.checkpoint import CheckpointError
from openk3.ops.mx import fake_quant_mxfp4, mxfp4_dequantize


@pytest.fixture(scope="module")
def k3_model():
    model = build_model(preset("debug"), seed=1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        for b in model.buffers():
            b.copy_(0.01 * torch.randn_like(b))
    return model.eval()


def _state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def test_k3_roundtrip_exact_and_names(tmp_path, k3_model):
    openk3.save_pretrained(k3_model, tmp_path / "ck", max_shard_bytes=2_000_000)
    files = sorted(p.name for p in (tmp_path / "ck").glob("*.safetensors"))
    assert len(files) > 1  # sharded, with an index
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())["weight_map"]
    names = set(index)
    pre = "language_model.model."
    assert "language_model.lm_head.weight" in names
    assert pre + "output_attn_res_proj.weight" in names and pre + "layers.1.mlp_res_norm.weight" in names
    assert pre + "layers.1.block_sparse_moe.experts.7.w2.weight" in names
    assert pre + "layers.0.mlp.gate_proj.weight" in names
    assert pre + "layers.1.block_sparse_moe.gate.e_score_correction_bias" in names
    with safe_open(str(tmp_path / "ck" / index[pre + "layers.0.self_attn.A_log"]), "pt") as f:
        a_log = f.get_tensor(pre + "layers.0.self_attn.A_log")
    assert a_log.shape == (128,) and torch.all(a_log[preset("debug").linear_num_heads:] == 0)
    loaded = openk3.load_pretrained(tmp_path / "ck")
    _state_equal(k3_model, loaded)
    ids = torch.randint(0, 4096, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, k3_model(ids).logits)


def test_tied_embeddings_roundtrip(tmp_path):
    """A model whose head is its embedding (``tie_word_embeddings``) loads with the two tied and
    filled: loading builds on the meta device, and ``to_empty`` gave the head a tensor of its own
    that nothing filled (the loaded model's logits were garbage)."""
    model = build_model(preset("debug").replace(tie_word_embeddings=True), seed=2).eval()
    openk3.save_pretrained(model, tmp_path / "ck")
    loaded = openk3.load_pretrained(tmp_path / "ck")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 4096, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_mxfp4_experts_roundtrip(tmp_path, k3_model):
    openk3.save_pretrained(k3_model, tmp_path / "mx", experts="mxfp4")
    cfg_json = json.loads((tmp_path / "mx" / "config.json").read_text())
    assert cfg_json["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    tensors = {}
    for f in (tmp_path / "mx").glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    stem = "language_model.model.layers.2.block_sparse_moe.experts.5.w1"
    assert tensors[stem + ".weight_packed"].dtype == torch.uint8
    assert stem + ".weight" not in tensors
    loaded = openk3.load_pretrained(tmp_path / "mx")
    w = loaded.model.layers[2].mlp.experts.w1[5]
    # bit-exact decode of what is stored ...
    want = mxfp4_dequantize(tensors[stem + ".weight_packed"], tensors[stem + ".weight_scale"], torch.float32)
    assert torch.equal(w, want)
    # ... which is the MXFP4 fake-quantisation of the original expert
    assert torch.equal(w, fake_quant_mxfp4(k3_model.model.layers[2].mlp.experts.w1[5].detach()))
    # once on the grid, packing again is lossless
    openk3.save_pretrained(loaded, tmp_path / "mx2", experts="mxfp4")
    _state_equal(loaded, openk3.load_pretrained(tmp_path / "mx2"))


def test_vision_tensors_are_skipped_with_a_note(tmp_path, k3_model, capsys):
    openk3.save_pretrained(k3_model, tmp_path / "ck")
    save_file({"vision_tower.patch_embed.weight": torch.zeros(2, 2),
               "mm_projector.proj.0.weight": torch.zeros(2)}, str(tmp_path / "ck" / "vision.safetensors"))
    idx_path = tmp_path / "ck" / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["weight_map"].update({"vision_tower.patch_embed.weight": "vision.safetensors",
                              "mm_projector.proj.0.weight": "vision.safetensors"})
    idx_path.write_text(json.dumps(idx))
    _state_equal(k3_model, openk3.load_pretrained(tmp_path / "ck"))
    assert "skipped 2 vision tensors" in capsys.readouterr().err


def _rewrite(tmp_path, k3_model, edit):
    ck = tmp_path / "ck"
    openk3.save_pretrained(k3_model, ck)
    (f,) = list(ck.glob("*.safetensors"))
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))
    idx_path = ck / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["weight_map"] = {k: f.name for k in tensors}
    idx_path.write_text(json.dumps(idx))
    return ck


PRE = "language_model.model."


def test_missing_tensor_is_named(tmp_path, k3_model):
    ck = _rewrite(tmp_path, k3_model, lambda t: t.pop(PRE + "layers.3.post_attention_layernorm.weight"))
    with pytest.raises(CheckpointError, match=r"layers\.3\.post_attention_layernorm\.weight"):
        openk3.load_pretrained(ck)


def test_missing_expert_is_named(tmp_path, k3_model):
    ck = _rewrite(tmp_path, k3_model, lambda t: t.pop(PRE + "layers.2.block_sparse_moe.experts.6.w3.weight"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.w3 \(experts \[6\]\)"):
        openk3.load_pretrained(ck)


def test_unexpected_tensor_is_named(tmp_path, k3_model):
    ck = _rewrite(tmp_path, k3_model, lambda t: t.update({PRE + "layers.1.bogus.weight": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor .*layers\.1\.bogus\.weight"):
        openk3.load_pretrained(ck)


def test_misshaped_tensor_names_both_shapes(tmp_path, k3_model):
    name = PRE + "layers.1.self_attn.q_proj.weight"
    ck = _rewrite(tmp_path, k3_model, lambda t: t.update({name: torch.zeros(3, 5)}))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight has shape \(3, 5\), the model expects \(64, 128\)"):
        openk3.load_pretrained(ck)


def test_nonzero_a_log_padding_rejected(tmp_path, k3_model):
    name = PRE + "layers.0.self_attn.A_log"
    ck = _rewrite(tmp_path, k3_model, lambda t: t[name].__setitem__(100, 1.0))
    with pytest.raises(CheckpointError, match="A_log"):
        openk3.load_pretrained(ck)


def test_truncated_file_names_the_file(tmp_path, k3_model):
    ck = tmp_path / "ck"
    openk3.save_pretrained(k3_model, ck)
    (f,) = list(ck.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f.name):
        openk3.load_pretrained(ck)
    f.write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match=f.name):
        openk3.load_pretrained(ck)


def test_index_naming_absent_shard(tmp_path, k3_model):
    ck = tmp_path / "ck"
    openk3.save_pretrained(k3_model, ck)
    (f,) = list(ck.glob("*.safetensors"))
    f.unlink()
    with pytest.raises(CheckpointError, match=f.name):
        openk3.load_pretrained(ck)


def test_save_is_atomic_on_failure(tmp_path, k3_model, monkeypatch):
    ck = tmp_path / "ck"
    openk3.save_pretrained(k3_model, ck)
    before = sorted(p.name for p in ck.iterdir())
    import openk3.checkpoint.hf as hf

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf, "save_file", boom)
    with pytest.raises(OSError):
        openk3.save_pretrained(k3_model, ck)
    assert sorted(p.name for p in ck.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary left behind
    _state_equal(k3_model, openk3.load_pretrained(ck))


def test_load_streams_into_meta_model(tmp_path, k3_model, monkeypatch):
    """Loading never builds a second, initialised copy: the model is made on meta first."""
    openk3.save_pretrained(k3_model, tmp_path / "ck")
    import openk3.checkpoint.hf as hf

    devices = []
    real = hf.build_model
    monkeypatch.setattr(hf, "build_model", lambda cfg, device=None, **k: devices.append(device) or real(cfg, device=device, **k))
    openk3.load_pretrained(tmp_path / "ck")
    assert devices == ["meta"]


def test_release_format_checkpoint_saves_back_unchanged(tmp_path, k3_model):
    """A checkpoint in the release's format (its config keys, MXFP4 experts, vision tensors)
    loads, and saving it writes the same config keys and values and the same text tensors
    (names, shapes, dtypes); the vision tensors are not carried by a text-only load."""
    from tests.checkpoint.test_hf_config import official_k3_config

    release = tmp_path / "release"
    openk3.save_pretrained(k3_model.to(torch.bfloat16), release, experts="mxfp4")
    k3_model.float()
    config = official_k3_config()
    text = json.loads((release / "config.json").read_text())["text_config"]
    config["text_config"].update({k: v for k, v in text.items() if k != "dtype"})
    config.update({k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    config.update(media_placeholder_token_id=3)
    config["vision_config"]["text_hidden_size"] = text["hidden_size"]
    (release / "config.json").write_text(json.dumps(config))
    save_file({"vision_tower.patch_embed.proj.weight": torch.zeros(4, 3, 14, 14)},
              str(release / "vision.safetensors"))
    idx_path = release / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["weight_map"]["vision_tower.patch_embed.proj.weight"] = "vision.safetensors"
    idx_path.write_text(json.dumps(idx))

    openk3.save_pretrained(openk3.load_pretrained(release, vision=False), tmp_path / "again",
                           experts="mxfp4")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config

    def tensors(path):
        out = {}
        for f in path.glob("*.safetensors"):
            with safe_open(str(f), "pt") as fh:
                out.update({k: (tuple(fh.get_slice(k).get_shape()), fh.get_slice(k).get_dtype())
                            for k in fh.keys()})
        return out

    want = {k: v for k, v in tensors(release).items() if not k.startswith("vision_tower.")}
    assert tensors(tmp_path / "again") == want


def test_partial_writes_are_removed_and_permissions_are_ordinary(tmp_path, k3_model):
    """A killed save leaves `.ck.tmp-*` behind: the next save of `ck` removes it. The result is
    readable by group and others (umask 022), unlike mkdtemp's private 0o700."""
    import os

    (tmp_path / ".ck.tmp-dead").mkdir()
    (tmp_path / ".ck.tmp-dead" / "model-00001-of-00001.safetensors").write_bytes(b"partial")
    (tmp_path / ".ck.old-dead").mkdir()
    old = os.umask(0o022)
    try:
        openk3.save_pretrained(k3_model, tmp_path / "ck")
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in (tmp_path / "ck").iterdir())
