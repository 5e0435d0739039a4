"""Model configuration: one dataclass, named presets, and HF ``config.json`` I/O.

``ModelConfig`` is the single source of truth for every size and switch of the model.
Two architectures share it:

* ``kimi_k3``     — Kimi K3: bounded KDA gate, full-rank KDA and MLA output gates, SiTU-GLU,
  Stable LatentMoE, Block Attention Residuals.
* ``kimi_linear`` — Kimi Linear (the predecessor): softplus KDA gate, low-rank KDA output gate,
  no MLA output gate, SiLU SwiGLU, full-width MoE, plain residuals.

HF conversion (``from_hf`` / ``to_hf``) lives here too so that field names are defined once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

ARCHS = ("kimi_k3", "kimi_linear")


class _DictIO:
    """JSON-friendly ``to_dict`` / ``from_dict`` for the config dataclasses (tuples -> lists;
    unknown keys are an error naming them)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {unknown}")
        return cls(**d)


@dataclass
class ModelConfig(_DictIO):
    """Every field of the K3 / Kimi Linear text backbone (K3_SPEC §1, §2).

    Layer kinds come from ``full_attn_layers``: a 1-indexed list of MLA layers, exactly as the
    official ``linear_attn_config.full_attn_layers`` gives it; every other layer is KDA.
    """

    arch: str = "kimi_k3"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    full_attn_layers: tuple[int, ...] = tuple(range(4, 93, 4)) + (93,)
    rms_norm_eps: float = 1e-5
    mla_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm only
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1_048_576
    initializer_range: float = 0.02

    # Kimi Delta Attention
    linear_num_heads: int = 96
    linear_head_dim: int = 128
    linear_conv_kernel_size: int = 4
    kda_gate_lower_bound: float | None = -5.0  # None: Kimi Linear's unbounded softplus gate

    # Gated MLA (NoPE: the "rope" dims exist but are never rotated)
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    # MLPs and MoE
    intermediate_size: int = 33792  # the dense MLP of the first layers
    first_k_dense_replace: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    moe_intermediate_size: int = 3072
    num_shared_experts: int = 2  # shared expert width = moe_intermediate_size * num_shared_experts
    moe_latent_size: int | None = 3584  # None: experts run at full width (Kimi Linear)
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    hidden_act: str = "situ"  # "situ" (SiTU-GLU) or "silu" (SwiGLU)
    situ_beta1: float = 4.0
    situ_beta2: float = 25.0

    # Block Attention Residuals; None means plain residual connections
    attn_res_block_size: int | None = 12

    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839

    def __post_init__(self) -> None:
        self.full_attn_layers = tuple(int(i) for i in self.full_attn_layers)
        self.validate()

    # ---- validation -----------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field; runs before any allocation."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: {why}")

        if self.arch not in ARCHS:
            raise bad("arch", f"must be one of {ARCHS}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "linear_num_heads",
                     "linear_head_dim", "linear_conv_kernel_size", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
                     "num_experts", "num_experts_per_token", "moe_intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise bad(name, "must be a positive integer")
        if self.qk_rope_head_dim < 0:
            raise bad("qk_rope_head_dim", "must be >= 0")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise bad("q_lora_rank", "must be positive or None")
        bad_layers = [i for i in self.full_attn_layers if not 1 <= i <= self.num_hidden_layers]
        if bad_layers:
            raise bad("full_attn_layers", f"entries {bad_layers} are outside 1..num_hidden_layers "
                      f"({self.num_hidden_layers}); the list is 1-indexed")
        if len(set(self.full_attn_layers)) != len(self.full_attn_layers):
            raise bad("full_attn_layers", "has duplicates")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise bad("first_k_dense_replace", "must be in 0..num_hidden_layers")
        if self.num_experts_per_token > self.num_experts:
            raise bad("num_experts_per_token", f"exceeds num_experts={self.num_experts}")
        if self.num_experts % self.num_expert_group:
            raise bad("num_expert_group", f"must divide num_experts={self.num_experts}")
        if not 1 <= self.topk_group <= self.num_expert_group:
            raise bad("topk_group", f"must be in 1..num_expert_group={self.num_expert_group}")
        if self.hidden_act not in ("situ", "silu"):
            raise bad("hidden_act", "must be 'situ' or 'silu'")
        if self.kda_gate_lower_bound is not None and self.kda_gate_lower_bound >= 0:
            raise bad("kda_gate_lower_bound", "must be negative (a log-decay) or None")
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            raise bad("attn_res_block_size", "must be positive or None")
        if self.moe_latent_size is not None and self.moe_latent_size <= 0:
            raise bad("moe_latent_size", "must be positive or None")
        if self.arch == "kimi_linear" and (self.attn_res_block_size is not None
                                           or self.moe_latent_size is not None):
            raise ValueError("ModelConfig: arch='kimi_linear' has no AttnRes and no latent MoE; "
                             "set attn_res_block_size=None and moe_latent_size=None")

    # ---- derived ----------------------------------------------------------------------
    @property
    def is_k3(self) -> bool:
        return self.arch == "kimi_k3"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_mla_layer(self, i: int) -> bool:
        """0-indexed layer ``i`` is MLA (global attention) or KDA."""
        return (i + 1) in self.full_attn_layers

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """1-indexed KDA layers, the complement of ``full_attn_layers``."""
        return tuple(i for i in range(1, self.num_hidden_layers + 1) if i not in self.full_attn_layers)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# ---- presets ---------------------------------------------------------------------------

def _k3() -> ModelConfig:
    return ModelConfig()


def _debug() -> ModelConfig:
    # A few M parameters; every K3 mechanism is present (AttnRes seals a block inside 8 layers).
    return ModelConfig(
        vocab_size=4096, hidden_size=128, num_hidden_layers=8, full_attn_layers=(4, 8),
        linear_num_heads=2, linear_head_dim=32,
        num_attention_heads=2, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32,
        intermediate_size=384, num_experts=8, num_experts_per_token=2, moe_intermediate_size=64,
        num_shared_experts=1, moe_latent_size=96, attn_res_block_size=4,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


def _small() -> ModelConfig:
    # ~0.95B total / ~0.4B active: the single-GPU preset.
    return ModelConfig(
        vocab_size=65536, hidden_size=1024, num_hidden_layers=24,
        full_attn_layers=tuple(range(4, 24, 4)) + (24,),
        linear_num_heads=8, linear_head_dim=128,
        num_attention_heads=8, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=4096, num_experts=64, num_experts_per_token=4, moe_intermediate_size=256,
        num_shared_experts=2, moe_latent_size=512, attn_res_block_size=6,
        max_position_embeddings=65536, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


def _kimi_linear_48b() -> ModelConfig:
    return ModelConfig(
        arch="kimi_linear", vocab_size=163840, hidden_size=2304, num_hidden_layers=27,
        full_attn_layers=(4, 8, 12, 16, 20, 24, 27),
        linear_num_heads=32, linear_head_dim=128, kda_gate_lower_bound=None,
        num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=9216, num_experts=256, num_experts_per_token=8, moe_intermediate_size=1024,
        num_shared_experts=1, moe_latent_size=None, routed_scaling_factor=2.446,
        hidden_act="silu", attn_res_block_size=None,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    )


PRESETS = {
    "debug": _debug,
    "small": _small,
    "k3": _k3,
    "kimi-linear-48b": _kimi_linear_48b,
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


# ---- HF config.json I/O ----------------------------------------------------------------
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


# ---- training runs ---------------------------------------------------------------------

@dataclass
class RunConfig(_DictIO):
    """One training run. Every ``openk3 train`` flag is a field of the same name.

    ``preset`` names the ModelConfig preset; ``model_overrides`` (JSON on the command line)
    changes single ModelConfig fields, e.g. ``{"num_hidden_layers": 4}``.
    """

    preset: str = "debug"
    model_overrides: dict = dataclasses.field(default_factory=dict)
    out: str = "runs/debug"
    resume: bool = False
    # data
    data: tuple[str, ...] = ()  # files, directories or JSONL; empty = the embedded stdlib corpus
    tokenizer: str | None = None  # a tokenizer.json; None trains a byte-level BPE of vocab_size
    vocab_size: int | None = None  # None: the model preset's vocab_size
    seq_len: int = 256
    batch_size: int = 8  # sequences per rank per micro-step
    grad_accum: int = 1
    # optimisation
    max_steps: int = 400
    optimizer: str = "muon"  # "muon" (per-head Muon + AdamW) or "adamw"
    lr: float = 1e-2  # shared by Muon (RMS-matched) and AdamW; best of a sweep on debug, docs/muon.md
    weight_decay: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # "cosine" or "wsd"
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0
    balance: str = "qb"  # "qb", "sign", "aux" or "none"
    ep: int = 1  # expert parallelism (MoonEP): ranks per expert group; divides the process count
    aux_loss_coef: float = 1e-2
    # bookkeeping
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 4
    ckpt_interval: int = 100
    keep_last: int = 2
    seed: int = 0
    device: str = "auto"  # "auto", "cpu", "cuda"
    dtype: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU), "float32", "bfloat16"
    # samples printed at the end
    num_samples: int = 3
    sample_tokens: int = 80
    sample_temperature: float = 0.8

    def __post_init__(self) -> None:
        self.data = tuple(self.data)
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"RunConfig.{name}={getattr(self, name)!r}: {why}")

        if self.preset not in PRESETS:
            raise bad("preset", f"choose one of {sorted(PRESETS)}")
        for name in ("seq_len", "batch_size", "grad_accum", "max_steps", "log_interval", "ep",
                     "eval_interval", "eval_batches", "ckpt_interval", "keep_last"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be positive")
        for name in ("warmup_steps", "num_samples", "sample_tokens"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if self.warmup_steps >= self.max_steps:
            raise bad("warmup_steps", f"must be below max_steps={self.max_steps}")
        if self.vocab_size is not None and self.vocab_size < 260:
            raise bad("vocab_size", "must be at least 260 (256 bytes + special tokens)")
        if not self.lr > 0:
            raise bad("lr", "must be positive")
        if self.weight_decay < 0 or self.clip_grad < 0:
            raise bad("weight_decay" if self.weight_decay < 0 else "clip_grad", "must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise bad("min_lr_ratio", "must be in [0, 1]")
        choices = {"optimizer": ("muon", "adamw"), "schedule": ("cosine", "wsd"),
                   "balance": ("qb", "sign", "aux", "none"), "device": ("auto", "cpu", "cuda"),
                   "dtype": ("auto", "float32", "bfloat16")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise bad(name, f"choose one of {allowed}")
        self.model_config()  # model overrides are validated by ModelConfig itself

    def model_config(self) -> ModelConfig:
        cfg = preset(self.preset)
        changes = dict(self.model_overrides)
        if self.vocab_size is not None:
            changes["vocab_size"] = self.vocab_size
        try:
            return cfg.replace(**changes) if changes else cfg
        except TypeError as e:
            raise ValueError(f"RunConfig.model_overrides={self.model_overrides!r}: {e}") from e



RUN_PRESETS = {
    # the README's main job: CPU, a few minutes, loss clearly falling
    "debug": dict(),
    # one GPU, bf16
    "small": dict(preset="small", out="runs/small", seq_len=4096, batch_size=4, max_steps=2000,
                  lr=2e-3, warmup_steps=100, log_interval=20, eval_interval=250, ckpt_interval=500,
                  num_samples=2, sample_tokens=128),
}


def run_preset(name: str, **overrides: Any) -> RunConfig:
    """The run defaults for model preset ``name`` (run presets share the model presets' names)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    base = RUN_PRESETS.get(name, dict(preset=name, out=f"runs/{name}"))
    return RunConfig(**{**base, **overrides})
