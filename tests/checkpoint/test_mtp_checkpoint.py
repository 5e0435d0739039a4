"""The MTP layer in HF checkpoints: K3 names under layer ``num_hidden_layers``, exact round trips
(bf16 and MXFP4 experts), and configs that disagree with the tensors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import openk3
from openk3 import build_model, preset
from openk3.checkpoint import CheckpointError
from openk3.ops.mx import fake_quant_mxfp4
from tests.model.test_mtp import TINY, _batch, _mtp_model

L = TINY["num_hidden_layers"]  # the MTP layer's index in the checkpoint
PRE = "language_model.model."


def _names(path) -> set[str]:
    return set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])


def _assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_mtp_round_trip_with_k3_names(tmp_path):
    model = _mtp_model().eval()
    openk3.save_pretrained(model, tmp_path / "ck")
    text = json.loads((tmp_path / "ck" / "config.json").read_text())["text_config"]
    assert text["num_nextn_predict_layers"] == 1
    names = _names(tmp_path / "ck")
    layer = f"{PRE}layers.{L}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_a_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.g_proj.weight",
                 "block_sparse_moe.gate.weight", "block_sparse_moe.gate.e_score_correction_bias",
                 "block_sparse_moe.routed_expert_down_proj.weight",
                 "block_sparse_moe.shared_experts.up_proj.weight",
                 "block_sparse_moe.experts.7.w2.weight"):
        assert layer + name in names, name
    mtp_names = {n for n in names if n.startswith(layer)}
    # no AttnRes in the block, and the head and embedding are the main ones (not stored again)
    assert not any("_res_" in n or "shared_head.head" in n or "embed_tokens" in n for n in mtp_names)
    assert not any(n.startswith("mtp") for n in names)

    loaded = openk3.load_pretrained(tmp_path / "ck")
    _assert_same_model(model, loaded)
    ids, labels = _batch()
    with torch.no_grad():
        want, got = model(ids, labels=labels), loaded(ids, labels=labels)
        assert torch.equal(got.loss, want.loss) and torch.equal(got.mtp_loss, want.mtp_loss)
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_mtp_experts_pack_to_mxfp4(tmp_path):
    cfg = preset("debug").replace(**{**TINY, "moe_latent_size": 64}, num_nextn_predict_layers=1)
    model = build_model(cfg).eval()  # MX blocks of 32 along the expert inputs
    openk3.save_pretrained(model, tmp_path / "mx", experts="mxfp4")
    names = _names(tmp_path / "mx")
    assert f"{PRE}layers.{L}.block_sparse_moe.experts.3.w1.weight_packed" in names
    loaded = openk3.load_pretrained(tmp_path / "mx")
    w = model.mtp[0].mlp.experts.w1.detach()
    assert torch.equal(loaded.mtp[0].mlp.experts.w1, fake_quant_mxfp4(w))


def _set_nextn(path, n: int) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["num_nextn_predict_layers"] = n
    (path / "config.json").write_text(json.dumps(cfg))


def test_a_checkpoint_without_mtp_loads_as_before(tmp_path):
    """The release's format (num_nextn_predict_layers 0, no layer L): no MTP layer is built;
    the config written back still says 0."""
    model = build_model(preset("debug").replace(**TINY), seed=0).eval()
    openk3.save_pretrained(model, tmp_path / "ck")
    assert not any(f"layers.{L}." in n for n in _names(tmp_path / "ck"))
    loaded = openk3.load_pretrained(tmp_path / "ck")
    assert len(loaded.mtp) == 0 and loaded.cfg.num_nextn_predict_layers == 0
    _assert_same_model(model, loaded)
    text = json.loads((tmp_path / "ck" / "config.json").read_text())["text_config"]
    assert text["num_nextn_predict_layers"] == 0


def test_mtp_tensors_without_the_config_key_are_refused(tmp_path):
    openk3.save_pretrained(_mtp_model(), tmp_path / "ck")
    _set_nextn(tmp_path / "ck", 0)
    with pytest.raises(CheckpointError, match=rf"unexpected tensor {PRE}layers\.{L}\..*num_nextn_predict_layers"):
        openk3.load_pretrained(tmp_path / "ck")


def test_config_asking_for_mtp_without_its_tensors_names_them(tmp_path):
    openk3.save_pretrained(build_model(preset("debug").replace(**TINY)), tmp_path / "ck")
    _set_nextn(tmp_path / "ck", 1)
    with pytest.raises(CheckpointError, match=rf"lacks tensors .*{PRE}layers\.{L}\.enorm\.weight"):
        openk3.load_pretrained(tmp_path / "ck")


def test_a_copy_of_the_head_under_the_mtp_layer_is_refused(tmp_path):
    """DeepSeek-V3 stores the MTP head as ``shared_head.head``; openk3 ties it to lm_head, so
    a stored copy (which could differ) is an unexpected tensor, not silently dropped."""
    model = _mtp_model()
    openk3.save_pretrained(model, tmp_path / "ck")
    (f,) = (tmp_path / "ck").glob("*.safetensors")
    tensors = load_file(str(f))
    head = f"{PRE}layers.{L}.shared_head.head.weight"
    tensors[head] = tensors["language_model.lm_head.weight"].clone()
    save_file(tensors, str(f))
    idx_path = tmp_path / "ck" / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["weight_map"][head] = f.name
    idx_path.write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"unexpected tensor .*shared_head\.head\.weight"):
        openk3.load_pretrained(tmp_path / "ck")
