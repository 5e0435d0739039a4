"""HF ``config.json`` <-> ``ModelConfig``, for ``model_type`` ``kimi_k3`` and ``kimi_linear``.

Beside ``hf.py`` (tensor names): the checkpoint package is the only code that knows external
names, of tensors and of config keys.
"""

from __future__ import annotations

import json
import os
from typing import Any

from openk3.config import ModelConfig

# Kimi Linear's config.json stores the layer pattern in ``linear_attn_config``; transformers'
# own ``save_pretrained`` writes ``layer_types`` / ``mlp_layer_types`` instead and renames a few
# keys (``attribute_map``). Both spellings are read; ours is written.

_HF_ALIASES = {  # alias -> our field
    "num_local_experts": "num_experts",
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "model_max_length": "max_position_embeddings",
}

_HF_SCALAR_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings",
    "max_position_embeddings", "initializer_range", "num_attention_heads", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
    "first_k_dense_replace", "num_experts", "num_experts_per_token", "moe_intermediate_size",
    "num_shared_experts", "routed_scaling_factor", "moe_renormalize", "num_expert_group",
    "topk_group", "hidden_act", "num_nextn_predict_layers", "bos_token_id", "eos_token_id",
    "pad_token_id",
)

# K3-only fields: our name -> the name in the official ``text_config``.
_K3_FIELDS = {
    "moe_latent_size": "routed_expert_hidden_size",
    "attn_res_block_size": "attn_res_block_size",
    "situ_beta1": "activation_situ_beta",
    "situ_beta2": "activation_situ_linear_beta",
}


def _first_int(x: Any) -> int | None:
    if isinstance(x, list):
        return int(x[0]) if x else None
    return None if x is None else int(x)


def from_hf(path_or_dict: str | os.PathLike | dict) -> ModelConfig:
    """Build a ``ModelConfig`` from a HF ``config.json`` (path, directory or parsed dict).

    Accepts ``model_type`` ``kimi_k3`` (text part nested under ``text_config``) and
    ``kimi_linear`` (flat), with either ``linear_attn_config`` or transformers' ``layer_types``.
    """
    if isinstance(path_or_dict, dict):
        raw, where = path_or_dict, "config dict"
    else:
        p = os.fspath(path_or_dict)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        try:
            with open(p) as fh:
                raw = json.load(fh)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read HF config {p}: {e}") from e
        where = p
    model_type = raw.get("model_type")
    if model_type == "kimi_k3":
        text = dict(raw.get("text_config") or {})
        if not text:
            raise ValueError(f"{where}: model_type kimi_k3 needs a 'text_config' section")
    elif model_type == "kimi_linear":
        text = dict(raw)
    else:
        raise ValueError(f"{where}: model_type {model_type!r} is not 'kimi_k3' or 'kimi_linear'")
    # K3's text_config itself says kimi_linear; its K3 features are what tell it apart.
    arch = "kimi_k3" if model_type == "kimi_k3" or "attn_res_block_size" in text else "kimi_linear"

    kw: dict[str, Any] = {"arch": arch}
    for alias, ours in _HF_ALIASES.items():
        if alias in text and ours not in text:
            text[ours] = text[alias]
    for name in _HF_SCALAR_FIELDS:
        if name in text and (text[name] is not None or name == "q_lora_rank"):
            kw[name] = text[name]
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if name in kw:
            kw[name] = _first_int(kw[name])
    if text.get("hidden_act") in ("silu", "swiglu"):
        kw["hidden_act"] = "silu"
    elif text.get("hidden_act") is not None and text["hidden_act"] != "situ":
        raise ValueError(f"{where}: hidden_act {text['hidden_act']!r} is not 'situ' or 'silu'")

    lac = text.get("linear_attn_config") or {}
    n_layers = int(text["num_hidden_layers"])
    if "full_attn_layers" in lac:
        kw["full_attn_layers"] = tuple(int(i) for i in lac["full_attn_layers"])
        if "kda_layers" in lac:
            expect = sorted(set(range(1, n_layers + 1)) - set(kw["full_attn_layers"]))
            if sorted(int(i) for i in lac["kda_layers"]) != expect:
                raise ValueError(f"{where}: linear_attn_config.kda_layers is not the complement "
                                 "of full_attn_layers")
    elif "layer_types" in text:
        kw["full_attn_layers"] = tuple(i + 1 for i, t in enumerate(text["layer_types"])
                                       if t == "full_attention")
    else:
        raise ValueError(f"{where}: no layer pattern (linear_attn_config.full_attn_layers "
                         "or layer_types)")
    kw["linear_num_heads"] = int(lac.get("num_heads", text.get("linear_num_heads", 32)))
    kw["linear_head_dim"] = int(lac.get("head_dim", text.get("linear_head_dim", 128)))
    kw["linear_conv_kernel_size"] = int(lac.get("short_conv_kernel_size",
                                                text.get("linear_conv_kernel_dim", 4)))
    if "mlp_layer_types" in text and "first_k_dense_replace" not in text:
        kw["first_k_dense_replace"] = sum(1 for t in text["mlp_layer_types"] if t == "dense")

    if arch == "kimi_k3":
        for ours, theirs in _K3_FIELDS.items():
            if theirs in text:
                kw[ours] = text[theirs]
        if "gate_lower_bound" in lac:
            kw["kda_gate_lower_bound"] = lac["gate_lower_bound"]
        for key, want in (("mla_use_output_gate", True), ("latent_moe_use_norm", True),
                          ("mla_use_nope", True)):
            if text.get(key, want) != want:
                raise ValueError(f"{where}: {key}={text[key]!r} is not supported (K3 uses {want})")
        if lac.get("use_full_rank_gate", True) is not True:
            raise ValueError(f"{where}: linear_attn_config.use_full_rank_gate must be true for K3")
    else:
        kw.update(kda_gate_lower_bound=None, moe_latent_size=None, attn_res_block_size=None)
        kw.setdefault("routed_scaling_factor", 2.446)
        kw.setdefault("num_shared_experts", 1)
    return ModelConfig(**kw)


def to_hf(cfg: ModelConfig, quantization_config: dict | None = None) -> dict[str, Any]:
    """The HF ``config.json`` dict for ``cfg`` (nested for ``kimi_k3``, flat for ``kimi_linear``)."""
    text: dict[str, Any] = {name: getattr(cfg, name) for name in _HF_SCALAR_FIELDS}
    text["model_type"] = "kimi_linear"
    text["architectures"] = ["KimiLinearForCausalLM"]
    text["linear_attn_config"] = {
        "full_attn_layers": list(cfg.full_attn_layers),
        "kda_layers": list(cfg.kda_layers),
        "num_heads": cfg.linear_num_heads,
        "head_dim": cfg.linear_head_dim,
        "short_conv_kernel_size": cfg.linear_conv_kernel_size,
    }
    text["mla_use_nope"] = True
    text["moe_router_activation_func"] = "sigmoid"
    text["use_grouped_topk"] = True
    text["moe_layer_freq"] = 1
    if cfg.arch == "kimi_linear":
        if quantization_config is not None:
            text["quantization_config"] = quantization_config
        return text
    for ours, theirs in _K3_FIELDS.items():
        text[theirs] = getattr(cfg, ours)
    text["hidden_act"] = "situ"
    text["mla_use_output_gate"] = True
    text["latent_moe_use_norm"] = True
    text["linear_attn_config"]["gate_lower_bound"] = cfg.kda_gate_lower_bound
    text["linear_attn_config"]["use_full_rank_gate"] = True
    if quantization_config is not None:  # the official release keeps it inside text_config
        text["quantization_config"] = quantization_config
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
