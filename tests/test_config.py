"""ModelConfig: presets, layer patterns, validation (HF config.json I/O: tests/checkpoint/test_hf_config.py)."""

import pytest

from openk3.config import PRESETS, ModelConfig, preset


def test_k3_layer_kinds_from_one_indexed_list():
    cfg = preset("k3")
    kinds = ["MLA" if cfg.is_mla_layer(i) else "KDA" for i in range(93)]
    assert kinds[0] == "KDA" and kinds[3] == "MLA" and kinds[91] == "MLA" and kinds[92] == "MLA"
    assert kinds.count("MLA") == 24 and kinds.count("KDA") == 69
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_dense_mlp_layers_anywhere():
    cfg = preset("debug").replace(dense_mlp_layers=(2, 5))
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)] == [
        True, False, True, True, False, True, True, True]


@pytest.mark.parametrize("field,value,msg", [
    ("full_attn_layers", (0, 4), "1-indexed"),
    ("dense_mlp_layers", (9,), "1-indexed"),
    ("dense_mlp_layers", (1, 1), "duplicates"),
    ("num_experts_per_token", 99, "num_experts_per_token"),
    ("hidden_act", "gelu", "hidden_act"),
    ("kda_gate_lower_bound", 1.0, "kda_gate_lower_bound"),
    ("hidden_size", 0, "hidden_size"),
])
def test_invalid_config_names_field(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        preset("debug").replace(**{field: value})


@pytest.mark.parametrize("field,value", [
    ("num_attention_heads", "eight"), ("rms_norm_eps", "1e-5"), ("tie_word_embeddings", 0),
    ("full_attn_layers", (4, "8")), ("q_lora_rank", 1.5), ("moe_latent_size", True),
])
def test_wrong_types_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}=.*expected"):
        preset("debug").replace(**{field: value})


def test_ints_are_valid_floats_and_lists_become_tuples():
    cfg = preset("debug").replace(rms_norm_eps=1, full_attn_layers=[4, 8])
    assert cfg.full_attn_layers == (4, 8) and cfg.rms_norm_eps == 1


def test_unknown_fields_rejected():
    with pytest.raises(ValueError, match="unknown fields"):
        ModelConfig.from_dict({"hidden_sise": 3})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_round_trip(name):
    cfg = preset(name)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
