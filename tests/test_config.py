import json

import pytest

from openk3.checkpoint.hf_config import from_hf, to_hf
from openk3.config import PRESETS, ModelConfig, preset


def official_k3_config() -> dict:
    """The official K3 config.json's text part, as released (key names and values)."""
    full = list(range(4, 93, 4)) + [93]
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "media_placeholder_token_id": 163605,
        "text_config": {
            "model_type": "kimi_linear", "hidden_act": "situ", "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12, "hidden_size": 7168,
            "intermediate_size": 33792, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-05,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
            "num_attention_heads": 96, "num_key_value_heads": 96, "first_k_dense_replace": 1,
            "moe_layer_freq": 1, "num_experts": 896, "num_experts_per_token": 16,
            "moe_intermediate_size": 3072, "num_shared_experts": 2, "routed_expert_hidden_size": 3584,
            "latent_moe_use_norm": True, "routed_scaling_factor": 1.0, "moe_renormalize": True,
            "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "vocab_size": 163840,
            "num_hidden_layers": 93, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
            "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
            "linear_attn_config": {
                "full_attn_layers": full,
                "kda_layers": [i for i in range(1, 94) if i not in full],
                "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                "gate_lower_bound": -5.0, "use_full_rank_gate": True,
            },
        },
    }


def test_official_k3_config_equals_k3_preset():
    assert from_hf(official_k3_config()) == preset("k3")


def test_k3_layer_kinds_from_one_indexed_list():
    cfg = preset("k3")
    kinds = ["MLA" if cfg.is_mla_layer(i) else "KDA" for i in range(93)]
    assert kinds[0] == "KDA" and kinds[3] == "MLA" and kinds[91] == "MLA" and kinds[92] == "MLA"
    assert kinds.count("MLA") == 24 and kinds.count("KDA") == 69


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_roundtrip(name, tmp_path):
    cfg = preset(name)
    (tmp_path / "config.json").write_text(json.dumps(to_hf(cfg)))
    assert from_hf(tmp_path) == cfg


def test_transformers_layer_types_spelling():
    d = {"model_type": "kimi_linear", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 100,
         "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
         "mlp_layer_types": ["dense", "dense", "sparse", "sparse"], "num_local_experts": 8,
         "num_experts_per_tok": 2, "linear_num_heads": 2, "linear_head_dim": 16,
         "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0}
    cfg = from_hf(d)
    assert cfg.full_attn_layers == (2, 4) and cfg.first_k_dense_replace == 2
    assert cfg.num_experts == 8 and cfg.num_experts_per_token == 2 and cfg.eos_token_id == 2
    assert cfg.arch == "kimi_linear" and cfg.kda_gate_lower_bound is None


@pytest.mark.parametrize("field,value,msg", [
    ("full_attn_layers", (0, 4), "1-indexed"),
    ("num_experts_per_token", 99, "num_experts_per_token"),
    ("hidden_act", "gelu", "hidden_act"),
    ("kda_gate_lower_bound", 1.0, "kda_gate_lower_bound"),
    ("hidden_size", 0, "hidden_size"),
])
def test_invalid_config_names_field(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        preset("debug").replace(**{field: value})


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


def test_unknown_fields_rejected():
    with pytest.raises(ValueError, match="unknown fields"):
        ModelConfig.from_dict({"hidden_sise": 3})
