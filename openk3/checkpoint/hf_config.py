"""HF ``config.json`` <-> ``ModelConfig``, for ``model_type`` ``kimi_k3`` and ``kimi_linear``.

Beside ``hf.py`` (tensor names): the checkpoint package is the only code that knows external
names, of tensors and of config keys.

Spellings read: the K3 release (``kimi_k3`` with the text model under ``text_config``, layer
kinds in ``linear_attn_config``, ``first_k_dense_replace``), Kimi Linear's release (flat), and
what transformers' ``save_pretrained`` writes (``layer_types`` / ``mlp_layer_types`` per layer
and a few renamed keys, ``attribute_map``).

Written: the release's own key set, so engines that serve the release serve an export
unchanged. Keys openk3 does not interpret are kept in ``ModelConfig.hf_passthrough`` and written
back as they were; keys it derives (sizes, layer patterns, ``quantization_config``, ``dtype``)
are always written from the model itself.
"""

from __future__ import annotations

import json
import os
from typing import Any

from openk3.config import ModelConfig, VisionConfig

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
    "num_experts", "num_experts_per_token", "moe_intermediate_size",
    "num_shared_experts", "routed_scaling_factor", "moe_renormalize", "num_expert_group",
    "topk_group", "hidden_act", "num_nextn_predict_layers", "bos_token_id", "eos_token_id",
    "pad_token_id",
)

# K3-only fields: our name -> the name in the official ``text_config``.
_SITU_FIELDS = {"situ_beta1": "activation_situ_beta", "situ_beta2": "activation_situ_linear_beta"}
_K3_FIELDS = {
    "moe_latent_size": "routed_expert_hidden_size",
    "attn_res_block_size": "attn_res_block_size",
    **_SITU_FIELDS,
}
# Fields the release leaves at a value of its own: written (openk3's key) only when they differ
MLA_NORM_EPS = "mla_norm_eps"
# Scalar fields an explicit JSON null sets to None (absent: the default)
_NULLABLE = {"q_lora_rank", "bos_token_id", "eos_token_id", "pad_token_id"}

# Keys that describe what openk3 models (read here, or derived and written by ``to_hf``): never
# passed through, so a stale copy can never contradict the model.
_TEXT_KEYS = set(_HF_SCALAR_FIELDS) | set(_HF_ALIASES) | set(_K3_FIELDS.values()) | {MLA_NORM_EPS} | {
    "model_type", "architectures", "linear_attn_config", "layer_types", "mlp_layer_types",
    "first_k_dense_replace", "moe_layer_freq", "linear_num_heads", "linear_head_dim",
    "linear_conv_kernel_dim", "mla_use_output_gate", "latent_moe_use_norm", "mla_use_nope",
    "quantization_config", "dtype", "torch_dtype", "num_key_value_heads", "topk_method",
    "moe_router_activation_func", "use_grouped_topk",
}
_K3_TOP_KEYS = {"model_type", "architectures", "text_config", "bos_token_id", "eos_token_id",
                "pad_token_id", "tie_word_embeddings"}

_DTYPE_NAMES = ("float32", "bfloat16", "float16")

# Keys of choices openk3 has one implementation of: a config asking for another is refused, not
# loaded as openk3's choice (``num_key_value_heads``, MLA's, must equal ``num_attention_heads``)
_FIXED_CHOICES = {"moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
                  "mla_use_nope": True}

# ``vision_config``: the keys that are VisionConfig fields of the same name ...
_VISION_FIELDS = ("vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads",
                  "qkv_hidden_size", "vt_intermediate_size", "patch_size", "init_pos_emb_height",
                  "init_pos_emb_width", "pos_emb_interpolation_mode", "merge_kernel_size",
                  "projector_ln_eps")
# ... fields the release does not write: written only when they differ from the default ...
_VISION_OPTIONAL = ("rope_theta", "rope_max_grid", "norm_eps")
# ... and the release's fixed choices, which are the only ones openk3 implements
_VISION_FIXED = {
    "activation_func": "gelu_pytorch_tanh", "attn_bias": False, "linear_bias": False,
    "patch_embed_proj_bias": False, "merge_type": "sd2_tpool", "mlp_type": "mlp2",
    "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm", "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu", "video_attn_type": "spatial_temporal",
}


def _first_int(x: Any) -> Any:
    """transformers allows a list of eos ids; the first is the model's own."""
    if isinstance(x, list):
        return x[0] if x else None
    return x


def _read_json(path_or_dict: str | os.PathLike | dict) -> tuple[dict, str]:
    if isinstance(path_or_dict, dict):
        return path_or_dict, "config dict"
    p = os.fspath(path_or_dict)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    try:
        with open(p) as fh:
            raw = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read HF config {p}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: a config.json must hold a JSON object")
    return raw, p


def _dense_mlp_layers(text: dict, n_layers: int, where: str) -> tuple[int, ...]:
    """1-indexed dense layers from ``mlp_layer_types`` (per layer) or ``first_k_dense_replace``
    with ``moe_layer_freq`` (DeepSeek's rule: MoE where ``i >= k and i % freq == 0``)."""
    if "mlp_layer_types" in text:
        kinds = text["mlp_layer_types"]
        if (not isinstance(kinds, list) or len(kinds) != n_layers
                or any(t not in ("dense", "sparse") for t in kinds)):
            raise ValueError(f"{where}: mlp_layer_types must list 'dense' or 'sparse' for each of "
                             f"the {n_layers} layers, got {kinds!r}")
        return tuple(i + 1 for i, t in enumerate(kinds) if t == "dense")
    k = text.get("first_k_dense_replace", 1)
    freq = text.get("moe_layer_freq", 1)
    for name, value, least in (("first_k_dense_replace", k, 0), ("moe_layer_freq", freq, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{where}: {name}={value!r} must be an integer >= {least}")
    return tuple(i + 1 for i in range(n_layers) if i < k or i % freq)


def _full_attn_layers(text: dict, lac: dict, n_layers: int, where: str) -> tuple[int, ...]:
    if "full_attn_layers" in lac:
        full = tuple(lac["full_attn_layers"])
        if "kda_layers" in lac:
            expect = sorted(set(range(1, n_layers + 1)) - set(full))
            if sorted(lac["kda_layers"]) != expect:
                raise ValueError(f"{where}: linear_attn_config.kda_layers is not the complement "
                                 "of full_attn_layers")
        return full
    if "layer_types" in text:
        kinds = text["layer_types"]
        if (not isinstance(kinds, list) or len(kinds) != n_layers
                or any(t not in ("full_attention", "linear_attention") for t in kinds)):
            raise ValueError(f"{where}: layer_types must list 'full_attention' or "
                             f"'linear_attention' for each of the {n_layers} layers")
        return tuple(i + 1 for i, t in enumerate(kinds) if t == "full_attention")
    raise ValueError(f"{where}: no layer pattern (linear_attn_config.full_attn_layers or layer_types)")


def _vision_from_hf(raw: dict, hidden_size: int, where: str) -> VisionConfig | None:
    """The top-level ``vision_config`` (and ``media_placeholder_token_id``) -> VisionConfig."""
    vc = raw.get("vision_config")
    if vc is None:
        return None
    if not isinstance(vc, dict):
        raise ValueError(f"{where}: vision_config must be an object")
    for key, want in _VISION_FIXED.items():
        if vc.get(key, want) != want:
            raise ValueError(f"{where}: vision_config.{key}={vc[key]!r} is not supported (K3's "
                             f"MoonViT-V2 uses {want!r}; docs/vision.md)")
    for key, want, source in (("text_hidden_size", hidden_size, "text_config.hidden_size"),
                              ("mm_hidden_size", vc.get("vt_hidden_size"), "vt_hidden_size")):
        if key in vc and want is not None and vc[key] != want:
            raise ValueError(f"{where}: vision_config.{key}={vc[key]!r} must equal {want} ({source})")
    kw = {k: vc[k] for k in _VISION_FIELDS + _VISION_OPTIONAL if k in vc}
    if "media_placeholder_token_id" in raw:
        kw["media_placeholder_token_id"] = raw["media_placeholder_token_id"]
    try:
        return VisionConfig(**kw)
    except ValueError as e:
        raise ValueError(f"{where}: vision_config: {e}") from e


def _vision_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The release's top-level vision keys for ``cfg.vision_config``."""
    v = cfg.vision_config
    section: dict[str, Any] = {k: getattr(v, k) for k in _VISION_FIELDS}
    section["merge_kernel_size"] = list(v.merge_kernel_size)
    section.update(_VISION_FIXED, mm_hidden_size=v.vt_hidden_size, text_hidden_size=cfg.hidden_size)
    default = VisionConfig()
    section.update({k: getattr(v, k) for k in _VISION_OPTIONAL if getattr(v, k) != getattr(default, k)})
    return {"vision_config": section, "media_placeholder_token_id": v.media_placeholder_token_id}


def from_hf(path_or_dict: str | os.PathLike | dict) -> ModelConfig:
    """Build a ``ModelConfig`` from a HF ``config.json`` (path, directory or parsed dict).

    Accepts ``model_type`` ``kimi_k3`` (text part nested under ``text_config``) and
    ``kimi_linear`` (flat), with either ``linear_attn_config`` or transformers' ``layer_types``,
    and either ``first_k_dense_replace`` or transformers' ``mlp_layer_types``. A value of the
    wrong type or out of range is an error naming its key.
    """
    raw, where = _read_json(path_or_dict)
    model_type = raw.get("model_type")
    if model_type == "kimi_k3":
        text = raw.get("text_config")
        if not isinstance(text, dict) or not text:
            raise ValueError(f"{where}: model_type kimi_k3 needs a 'text_config' section")
        text = dict(text)
        for key in _K3_TOP_KEYS - {"model_type", "architectures", "text_config"}:
            if key not in raw:
                continue
            if key not in text:  # stated only at the top level: it holds for the text model
                text[key] = raw[key]
            elif text[key] != raw[key]:
                raise ValueError(f"{where}: {key} is {raw[key]!r} at the top level but "
                                 f"{text[key]!r} in text_config")
    elif model_type == "kimi_linear":
        text = dict(raw)
    else:
        raise ValueError(f"{where}: model_type {model_type!r} is not 'kimi_k3' or 'kimi_linear'")
    for key, want in _FIXED_CHOICES.items():
        if text.get(key, want) != want:
            raise ValueError(f"{where}: {key}={text[key]!r} is not supported (openk3 implements {want!r})")
    # K3's text_config itself says kimi_linear; its K3 features are what tell it apart.
    arch = "kimi_k3" if model_type == "kimi_k3" or "attn_res_block_size" in text else "kimi_linear"

    kw: dict[str, Any] = {"arch": arch}
    for alias, ours in _HF_ALIASES.items():
        if alias in text and ours not in text:
            text[ours] = text[alias]
    for name in _HF_SCALAR_FIELDS:  # an explicit null is None where the field allows it
        if name in text and (text[name] is not None or name in _NULLABLE):
            kw[name] = text[name]
    if MLA_NORM_EPS in text:
        kw["mla_norm_eps"] = text[MLA_NORM_EPS]
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if kw.get(name) is not None:
            kw[name] = _first_int(kw[name])
    if text.get("hidden_act") in ("silu", "swiglu"):
        kw["hidden_act"] = "silu"
    elif text.get("hidden_act") is not None and text["hidden_act"] != "situ":
        raise ValueError(f"{where}: hidden_act {text['hidden_act']!r} is not 'situ' or 'silu'")

    n_layers = text.get("num_hidden_layers")
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers <= 0:
        raise ValueError(f"{where}: num_hidden_layers={n_layers!r} must be a positive integer")
    lac = text.get("linear_attn_config") or {}
    kw["full_attn_layers"] = _full_attn_layers(text, lac, n_layers, where)
    kw["dense_mlp_layers"] = _dense_mlp_layers(text, n_layers, where)
    kw["linear_num_heads"] = lac.get("num_heads", text.get("linear_num_heads", 32))
    kw["linear_head_dim"] = lac.get("head_dim", text.get("linear_head_dim", 128))
    kw["linear_conv_kernel_size"] = lac.get("short_conv_kernel_size",
                                            text.get("linear_conv_kernel_dim", 4))

    for ours, theirs in _SITU_FIELDS.items():  # kimi_linear's too, when it runs SiTU (openk3's)
        if theirs in text:
            kw[ours] = text[theirs]
    if arch == "kimi_k3":
        for ours, theirs in _K3_FIELDS.items():
            if theirs in text:
                kw[ours] = text[theirs]
        if "gate_lower_bound" in lac:
            kw["kda_gate_lower_bound"] = lac["gate_lower_bound"]
        for key, want in (("mla_use_output_gate", True), ("latent_moe_use_norm", True)):
            if text.get(key, want) != want:
                raise ValueError(f"{where}: {key}={text[key]!r} is not supported (K3 uses {want})")
        if lac.get("use_full_rank_gate", True) is not True:
            raise ValueError(f"{where}: linear_attn_config.use_full_rank_gate must be true for K3")
    else:
        kw.update(kda_gate_lower_bound=None, moe_latent_size=None, attn_res_block_size=None)
        kw.setdefault("routed_scaling_factor", 2.446)
        kw.setdefault("num_shared_experts", 1)

    passthrough = {k: v for k, v in text.items() if k not in _TEXT_KEYS}
    if isinstance(text.get("eos_token_id"), list) and len(text["eos_token_id"]) > 1:
        passthrough["eos_token_id"] = text["eos_token_id"]  # the model's is the first; written back whole
    if model_type == "kimi_k3":
        passthrough = {**{k: v for k, v in raw.items() if k not in _K3_TOP_KEYS},
                       "text_config": passthrough}
    try:
        cfg = ModelConfig(**kw, hf_passthrough=passthrough)
        if text.get("num_key_value_heads", cfg.num_attention_heads) != cfg.num_attention_heads:
            raise ValueError(f"num_key_value_heads={text['num_key_value_heads']!r} must equal "
                             f"num_attention_heads={cfg.num_attention_heads} (MLA: one latent for all heads)")
        if text.get("use_grouped_topk", True) is False and cfg.num_expert_group != 1:
            raise ValueError(f"use_grouped_topk=false with num_expert_group={cfg.num_expert_group}: "
                             "openk3 routes by groups whenever there are several")
        if model_type == "kimi_k3":
            # the vision keys are parsed *and* passed through: a text-only load (vision_config
            # None) writes the release's back unchanged; a model with vision overwrites them
            cfg = cfg.replace(vision_config=_vision_from_hf(raw, cfg.hidden_size, where))
        return cfg
    except ValueError as e:
        raise ValueError(e if str(e).startswith(where) else f"{where}: {e}") from e


def _layer_patterns(cfg: ModelConfig) -> dict[str, Any]:
    """The layer-kind keys: ``linear_attn_config`` lists for attention; ``first_k_dense_replace``
    when the dense layers are a prefix (the release's spelling), else ``mlp_layer_types``, which
    transformers reads per layer (an engine that only knows ``first_k_dense_replace`` cannot
    express such a model)."""
    out: dict[str, Any] = {
        "linear_attn_config": {
            "full_attn_layers": list(cfg.full_attn_layers),
            "kda_layers": list(cfg.kda_layers),
            "num_heads": cfg.linear_num_heads,
            "head_dim": cfg.linear_head_dim,
            "short_conv_kernel_size": cfg.linear_conv_kernel_size,
        },
        "moe_layer_freq": 1,
    }
    k = len(cfg.dense_mlp_layers)
    if sorted(cfg.dense_mlp_layers) == list(range(1, k + 1)):
        out["first_k_dense_replace"] = k
    else:
        out["mlp_layer_types"] = ["sparse" if cfg.is_moe_layer(i) else "dense"
                                  for i in range(cfg.num_hidden_layers)]
    return out


def _with_passthrough(written: dict, passthrough: dict) -> dict:
    """``written`` plus the keys of ``passthrough`` it lacks, recursively (written wins)."""
    out = dict(written)
    for key, value in passthrough.items():
        if key not in out:
            out[key] = value
        elif isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = _with_passthrough(out[key], value)
    return out


def _eos_ids(cfg: ModelConfig, text_passthrough: dict) -> Any:
    """``eos_token_id`` as written: a list read from the config when it still starts with the
    model's id (transformers stops at any of them), else the model's id."""
    listed = text_passthrough.get("eos_token_id")
    return listed if isinstance(listed, list) and listed[:1] == [cfg.eos_token_id] else cfg.eos_token_id


def to_hf(cfg: ModelConfig, quantization_config: dict | None = None,
          dtype: str = "bfloat16") -> dict[str, Any]:
    """The HF ``config.json`` dict for ``cfg`` (nested for ``kimi_k3``, flat for ``kimi_linear``).

    ``dtype``: the name of the saved tensors' floating dtype (``"bfloat16"``, ``"float32"``...).
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"to_hf: dtype={dtype!r} must be one of {_DTYPE_NAMES}")
    text: dict[str, Any] = {name: getattr(cfg, name) for name in _HF_SCALAR_FIELDS}
    text.update(_layer_patterns(cfg))
    text_passthrough = cfg.hf_passthrough.get("text_config", {}) if cfg.is_k3 else cfg.hf_passthrough
    text["eos_token_id"] = _eos_ids(cfg, text_passthrough)
    text.update(model_type="kimi_linear", dtype=dtype, num_key_value_heads=cfg.num_attention_heads,
                mla_use_nope=_FIXED_CHOICES["mla_use_nope"], use_grouped_topk=True,
                moe_router_activation_func=_FIXED_CHOICES["moe_router_activation_func"])
    if quantization_config is not None:  # the K3 release keeps it inside text_config
        text["quantization_config"] = quantization_config
    if cfg.mla_norm_eps != ModelConfig.mla_norm_eps:
        text[MLA_NORM_EPS] = cfg.mla_norm_eps
    if cfg.arch == "kimi_linear":
        text["architectures"] = ["KimiLinearForCausalLM"]
        if cfg.hidden_act == "situ":
            text.update({theirs: getattr(cfg, ours) for ours, theirs in _SITU_FIELDS.items()})
        return _with_passthrough(text, cfg.hf_passthrough)
    for ours, theirs in _K3_FIELDS.items():
        text[theirs] = getattr(cfg, ours)
    text.update(mla_use_output_gate=True, latent_moe_use_norm=True, topk_method=_FIXED_CHOICES["topk_method"])
    text["linear_attn_config"].update(gate_lower_bound=cfg.kda_gate_lower_bound,
                                      use_full_rank_gate=True)
    top = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    if cfg.vision_config is not None:
        top.update(_vision_to_hf(cfg))
    # a top-level dtype key is the release's business (passed through), but its value is ours,
    # and so is a top-level quantization_config (where transformers looks for a composite model's)
    top.update({k: dtype for k in ("dtype", "torch_dtype") if k in cfg.hf_passthrough})
    passthrough = dict(cfg.hf_passthrough)
    if "quantization_config" in passthrough:
        del passthrough["quantization_config"]
        if quantization_config is not None:
            top["quantization_config"] = quantization_config
    return _with_passthrough(top, passthrough)
