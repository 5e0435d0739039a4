"""HF config.json <-> ModelConfig: the K3 release, Kimi Linear, transformers' spelling."""

import copy
import json

import pytest

from openk3.checkpoint.hf import mxfp4_quantization_config
from openk3.checkpoint.hf_config import from_hf, to_hf
from openk3.config import PRESETS, preset


def official_k3_config() -> dict:
    """The K3 release's config.json (its keys and values)."""
    full = list(range(4, 93, 4)) + [93]
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "media_placeholder_token_id": 163605,
        "model_type": "kimi_k3",
        "tie_word_embeddings": False,
        "text_config": {
            "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "attn_res_block_size": 12, "bos_token_id": 163584, "dtype": "bfloat16",
            "eos_token_id": 163586, "first_k_dense_replace": 1, "hidden_act": "situ",
            "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 33792,
            "kv_lora_rank": 512, "latent_moe_use_norm": True,
            "linear_attn_config": {
                "full_attn_layers": full, "gate_lower_bound": -5.0, "head_dim": 128,
                "kda_layers": [i for i in range(1, 94) if i not in full], "num_heads": 96,
                "short_conv_kernel_size": 4, "use_full_rank_gate": True,
            },
            "max_position_embeddings": 1048576, "mla_use_nope": True, "mla_use_output_gate": True,
            "model_type": "kimi_linear", "moe_intermediate_size": 3072, "moe_layer_freq": 1,
            "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
            "num_attention_heads": 96, "num_expert_group": 1, "num_experts": 896,
            "num_experts_per_token": 16, "num_hidden_layers": 93, "num_key_value_heads": 96,
            "num_nextn_predict_layers": 0, "num_shared_experts": 2, "pad_token_id": 163839,
            "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "quantization_config": mxfp4_quantization_config(), "rms_norm_eps": 1e-05,
            "routed_expert_hidden_size": 3584, "routed_scaling_factor": 1.0,
            "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
            "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840,
        },
        "image_placeholder": "<|kimi_image_placeholder|>",
        "vision_config": {
            "_attn_implementation": "flash_attention_2", "activation_func": "gelu_pytorch_tanh",
            "attn_bias": False, "init_pos_emb_height": 64, "init_pos_emb_time": 4,
            "init_pos_emb_width": 64, "linear_bias": False, "merge_kernel_size": [2, 2],
            "merge_type": "sd2_tpool", "mlp_type": "mlp2", "mm_hidden_size": 1024,
            "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm",
            "patch_embed_proj_bias": False, "patch_size": 14, "pos_emb_interpolation_mode": "bilinear",
            "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
            "qkv_hidden_size": 1536, "text_hidden_size": 7168, "video_attn_type": "spatial_temporal",
            "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "vt_num_attention_heads": 12,
            "vt_num_hidden_layers": 27,
        },
    }


def test_official_k3_config_equals_k3_preset():
    assert from_hf(official_k3_config()) == preset("k3")


def test_official_k3_config_is_written_back_unchanged():
    """Every key of the release (also those openk3 does not use) comes back with its value."""
    cfg = from_hf(official_k3_config())
    release = official_k3_config()
    assert cfg.hf_passthrough == {k: release[k] for k in ("media_placeholder_token_id",
                                                          "image_placeholder", "vision_config")
                                  } | {"text_config": {}}
    assert to_hf(cfg, quantization_config=mxfp4_quantization_config()) == official_k3_config()


def test_fresh_k3_export_has_the_release_text_keys():
    written = to_hf(preset("k3"), quantization_config=mxfp4_quantization_config())
    assert written["text_config"] == official_k3_config()["text_config"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_roundtrip(name, tmp_path):
    cfg = preset(name)
    (tmp_path / "config.json").write_text(json.dumps(to_hf(cfg)))
    assert from_hf(tmp_path) == cfg


@pytest.mark.parametrize("name,changes", [
    ("debug", {"mla_norm_eps": 1e-2}),  # not in the release's keys: openk3's own, when not the default
    ("debug", {"hidden_act": "silu"}),  # was written as "situ" for every kimi_k3 model
    ("debug", {"bos_token_id": None, "pad_token_id": None}),  # were read back as the release's ids
    ("kimi-linear-48b", {"hidden_act": "situ", "situ_beta1": 6.0, "situ_beta2": 30.0}),
    ("kimi-linear-48b", {"mla_norm_eps": 1e-5, "pad_token_id": None}),
    ("debug", {"eos_token_id": None}),  # was read back as the release's id
    ("kimi-linear-48b", {"eos_token_id": None}),
])
def test_hf_roundtrip_of_changed_fields(name, changes, tmp_path):
    cfg = preset(name).replace(**changes)
    (tmp_path / "config.json").write_text(json.dumps(to_hf(cfg)))
    assert from_hf(tmp_path) == cfg


def test_transformers_layer_types_spelling():
    d = {"model_type": "kimi_linear", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 100,
         "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
         "mlp_layer_types": ["dense", "dense", "sparse", "sparse"], "num_local_experts": 8,
         "num_experts_per_tok": 2, "linear_num_heads": 2, "linear_head_dim": 16,
         "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0, "use_cache": True}
    cfg = from_hf(d)
    assert cfg.full_attn_layers == (2, 4) and cfg.dense_mlp_layers == (1, 2)
    assert cfg.num_experts == 8 and cfg.num_experts_per_token == 2 and cfg.eos_token_id == 2
    assert cfg.arch == "kimi_linear" and cfg.kda_gate_lower_bound is None
    # transformers' aliases are read, not passed through; keys openk3 does not know are, and so
    # is a list of eos ids (the model's is the first; the list was cut to it on export)
    assert cfg.hf_passthrough == {"use_cache": True, "eos_token_id": [2, 3]}
    written = to_hf(cfg)
    assert written["first_k_dense_replace"] == 2 and "mlp_layer_types" not in written
    assert "num_local_experts" not in written and written["use_cache"] is True
    assert written["eos_token_id"] == [2, 3] and to_hf(cfg.replace(eos_token_id=5))["eos_token_id"] == 5


def test_dense_layers_anywhere_are_written_per_layer():
    d = {"model_type": "kimi_linear", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 100,
         "layer_types": ["linear_attention"] * 3 + ["full_attention"],
         "mlp_layer_types": ["sparse", "dense", "sparse", "dense"], "num_local_experts": 8,
         "num_experts_per_tok": 2, "linear_num_heads": 2, "linear_head_dim": 16}
    cfg = from_hf(d)
    assert cfg.dense_mlp_layers == (2, 4)
    written = to_hf(cfg)
    assert written["mlp_layer_types"] == d["mlp_layer_types"] and "first_k_dense_replace" not in written
    assert from_hf(written) == cfg


def test_moe_layer_freq_follows_deepseek_rule():
    d = official_k3_config()
    d["text_config"].update(num_hidden_layers=6, first_k_dense_replace=1, moe_layer_freq=2,
                            linear_attn_config={**d["text_config"]["linear_attn_config"],
                                                "full_attn_layers": [4], "kda_layers": [1, 2, 3, 5, 6]})
    assert from_hf(d).dense_mlp_layers == (1, 2, 4, 6)


@pytest.mark.parametrize("key,value,msg", [
    ("num_attention_heads", "eight", "num_attention_heads='eight'"),
    ("hidden_size", 7168.5, "hidden_size=7168.5"),
    ("first_k_dense_replace", -1, "first_k_dense_replace=-1"),
    ("moe_layer_freq", 0, "moe_layer_freq=0"),
    ("mlp_layer_types", ["dense"], "mlp_layer_types"),
    ("num_hidden_layers", "93", "num_hidden_layers='93'"),
])
def test_wrong_values_name_the_key(key, value, msg):
    d = official_k3_config()
    d["text_config"][key] = value
    with pytest.raises(ValueError, match=msg.replace("[", r"\[")):
        from_hf(d)


def test_bad_hf_configs(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        from_hf({"model_type": "llama"})
    bad = official_k3_config()
    bad["text_config"]["linear_attn_config"]["kda_layers"] = [1, 2]
    with pytest.raises(ValueError, match="kda_layers"):
        from_hf(bad)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        from_hf(tmp_path)


def test_passthrough_never_contradicts_the_model():
    d = official_k3_config()
    cfg = from_hf(d).replace(num_attention_heads=64)
    text = to_hf(cfg)["text_config"]
    assert text["num_attention_heads"] == 64 and text["num_key_value_heads"] == 64
    assert "quantization_config" not in text  # bf16 experts: the release's block is not kept
    assert to_hf(cfg, dtype="float32")["text_config"]["dtype"] == "float32"
    untouched = copy.deepcopy(d)
    to_hf(from_hf(d))
    assert d == untouched


def test_a_kimi_linear_model_with_a_bounded_gate_is_refused():
    """Kimi Linear's format has no gate bound: it was dropped on export, the model changed."""
    with pytest.raises(ValueError, match="kda_gate_lower_bound=None"):
        preset("kimi-linear-48b").replace(kda_gate_lower_bound=-3.0)


def test_k3_top_level_token_ids_and_tie_hold_for_the_text_model():
    d = official_k3_config()
    for key in ("eos_token_id", "tie_word_embeddings"):
        d["text_config"].pop(key, None)
    d.update(eos_token_id=7, tie_word_embeddings=True)
    cfg = from_hf(d)  # were read as the defaults (and written back so)
    assert (cfg.eos_token_id, cfg.tie_word_embeddings) == (7, True)
    assert to_hf(cfg)["eos_token_id"] == 7 and to_hf(cfg)["text_config"]["tie_word_embeddings"] is True
    d["text_config"]["eos_token_id"] = 8
    with pytest.raises(ValueError, match="eos_token_id is 7 at the top level but 8 in text_config"):
        from_hf(d)


@pytest.mark.parametrize("key,value", [("moe_router_activation_func", "softmax"),
                                       ("topk_method", "greedy"), ("mla_use_nope", False),
                                       ("num_key_value_heads", 1)])
@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_choices_openk3_does_not_implement_are_refused(arch, key, value):
    """They were loaded as openk3's choice and exported rewritten to it."""
    d = official_k3_config() if arch == "kimi_k3" else to_hf(preset("kimi-linear-48b"))
    (d["text_config"] if arch == "kimi_k3" else d)[key] = value
    with pytest.raises(ValueError, match=key):
        from_hf(d)


def test_a_stale_top_level_quantization_config_is_not_written_back():
    d = official_k3_config()
    d["quantization_config"] = mxfp4_quantization_config()
    cfg = from_hf(d)
    assert "quantization_config" not in to_hf(cfg)  # a bf16 export was labelled MXFP4
    assert to_hf(cfg, quantization_config={"x": 1})["quantization_config"] == {"x": 1}
