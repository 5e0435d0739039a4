"""Model configuration: one dataclass and its named presets.

``ModelConfig`` is the single source of truth for every size and switch of the model.
Two architectures share it:

* ``kimi_k3``     — Kimi K3: bounded KDA gate, full-rank KDA and MLA output gates, SiTU-GLU,
  Stable LatentMoE, Block Attention Residuals.
* ``kimi_linear`` — Kimi Linear (the predecessor): softplus KDA gate, low-rank KDA output gate,
  no MLA output gate, SiLU SwiGLU, full-width MoE, plain residuals.

HF ``config.json`` conversion (``from_hf`` / ``to_hf``) lives beside the checkpoint code that
owns every external name (``openk3/checkpoint/hf_config.py``); training runs have their own
config (``openk3/train/config.py``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
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


def _has_type(value: Any, want: Any) -> bool:
    """``isinstance`` for the annotations config fields use: plain types, ``X | None``,
    ``tuple[int, ...]`` and ``dict``."""
    origin = typing.get_origin(want)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, t) for t in typing.get_args(want))
    if origin is tuple:
        item = typing.get_args(want)[0]
        return isinstance(value, (tuple, list)) and all(_has_type(v, item) for v in value)
    if want is type(None):
        return value is None
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or want)


def _type_name(want: Any) -> str:
    return str(want).replace("typing.", "") if typing.get_args(want) else want.__name__


def _check_field_types(obj: Any) -> None:
    """Every field's value has its annotated type (an int is a valid float; bool is not an
    int), so a config.json with ``"num_attention_heads": "eight"`` fails here, naming it."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, want = getattr(obj, f.name), hints[f.name]
        if not _has_type(value, want):
            raise ValueError(f"{type(obj).__name__}.{f.name}={value!r}: expected {_type_name(want)}")


@dataclass
class VisionConfig(_DictIO):
    """The MoonViT-V2 vision tower and its projector (K3_SPEC §6; docs/vision.md gives the
    source of every value). The defaults are the K3 release's ``vision_config``.

    An image is cut into ``patch_size`` x ``patch_size`` patches at its native resolution (a
    grid of h x w patches); each patch is embedded (``patch_embed.proj``, no bias), a learned
    ``[init_pos_emb_height, init_pos_emb_width, vt_hidden_size]`` position table resampled to
    the grid (``pos_emb_interpolation_mode``) is added, and ``vt_num_hidden_layers`` pre-norm
    blocks (RMSNorm, attention with 2D RoPE inside each image, GELU-tanh MLP) run over all
    images packed into one variable-length batch. ``merge_kernel_size`` neighbours are then
    concatenated (2 x 2 -> 4 * vt_hidden_size) and the projector (Linear, GELU, Linear,
    RMSNorm) maps each merged token to the language model's ``hidden_size``. Those tokens
    replace the ``media_placeholder_token_id`` positions of the prompt.
    """

    vt_hidden_size: int = 1024  # the residual stream of the tower
    vt_num_hidden_layers: int = 27
    vt_num_attention_heads: int = 12
    qkv_hidden_size: int = 1536  # heads x head_dim (12 x 128): wider than the residual stream
    vt_intermediate_size: int = 4096  # MLP width
    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    pos_emb_interpolation_mode: str = "bilinear"  # or "bicubic" (Kimi-VL / K2.5's choice)
    merge_kernel_size: tuple[int, ...] = (2, 2)  # (rows, columns) of patches per LM token
    rope_theta: float = 10000.0
    rope_max_grid: int = 512  # the largest grid side the 2D RoPE (and the preprocessor) allow
    # the tower's RMSNorm eps; None: torch.finfo(dtype).eps, torch.nn.RMSNorm's default, which
    # the release's reference code uses (so it depends on the compute dtype)
    norm_eps: float | None = None
    projector_ln_eps: float = 1e-5  # the projector's post_norm (an RMSNorm despite the name)
    media_placeholder_token_id: int = 163605  # <|media_pad|>

    def __post_init__(self) -> None:
        _check_field_types(self)
        self.merge_kernel_size = tuple(self.merge_kernel_size)
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"VisionConfig.{name}={getattr(self, name)!r}: {why}")

        for name in ("vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads",
                     "qkv_hidden_size", "vt_intermediate_size", "patch_size", "init_pos_emb_height",
                     "init_pos_emb_width", "rope_max_grid", "media_placeholder_token_id"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be positive")
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            raise bad("qkv_hidden_size", f"must be divisible by vt_num_attention_heads="
                      f"{self.vt_num_attention_heads}")
        if self.head_dim % 4:
            raise bad("qkv_hidden_size", f"gives a head_dim of {self.head_dim}; the 2D RoPE needs a "
                      "multiple of 4 (a rotated pair per axis per frequency)")
        if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) <= 0:
            raise bad("merge_kernel_size", "must be two positive integers (rows, columns)")
        if self.pos_emb_interpolation_mode not in ("bilinear", "bicubic"):
            raise bad("pos_emb_interpolation_mode", "must be 'bilinear' or 'bicubic'")
        if self.norm_eps is not None and self.norm_eps < 0:
            raise bad("norm_eps", "must be >= 0 or None")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merged_size(self) -> int:
        """Width of a merged token: the projector's input."""
        return self.vt_hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]


@dataclass
class ModelConfig(_DictIO):
    """Every field of the K3 / Kimi Linear text backbone (K3_SPEC §1, §2).

    Layer kinds are per-layer patterns, both 1-indexed: ``full_attn_layers`` lists the MLA
    layers, exactly as the official ``linear_attn_config.full_attn_layers`` gives it (every
    other layer is KDA); ``dense_mlp_layers`` lists the layers with a dense MLP (every other
    layer is MoE; the official ``first_k_dense_replace = k`` is ``(1, ..., k)``).

    ``hf_passthrough`` holds the ``config.json`` keys openk3 does not interpret (e.g. the
    release's ``media_placeholder_token_id``, ``vision_config``), in the file's nesting, so an
    export writes them back unchanged; it takes no part in equality.
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
    intermediate_size: int = 33792  # width of the dense MLPs
    dense_mlp_layers: tuple[int, ...] = (1,)
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

    # multi-token prediction depths (openk3/model/mtp.py): 0 or 1; the K3 release ships 0
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839

    # the vision tower and projector (openk3/vision); None: a text-only model
    vision_config: VisionConfig | None = None

    hf_passthrough: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.vision_config, dict):  # from_dict / JSON: the nested section
            self.vision_config = VisionConfig.from_dict(self.vision_config)
        self._check_types()
        self.full_attn_layers = tuple(self.full_attn_layers)
        self.dense_mlp_layers = tuple(self.dense_mlp_layers)
        self.validate()

    def _check_types(self) -> None:
        _check_field_types(self)

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
        for name in ("full_attn_layers", "dense_mlp_layers"):
            layers = getattr(self, name)
            outside = [i for i in layers if not 1 <= i <= self.num_hidden_layers]
            if outside:
                raise bad(name, f"entries {outside} are outside 1..num_hidden_layers "
                          f"({self.num_hidden_layers}); the list is 1-indexed")
            if len(set(layers)) != len(layers):
                raise bad(name, "has duplicates")
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
        if not 0 <= self.num_nextn_predict_layers <= 1:
            raise bad("num_nextn_predict_layers", "must be 0 or 1: openk3 builds at most one "
                      "multi-token-prediction layer (the K3 report pre-trains one)")
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            raise bad("attn_res_block_size", "must be positive or None")
        if self.moe_latent_size is not None and self.moe_latent_size <= 0:
            raise bad("moe_latent_size", "must be positive or None")
        if self.arch == "kimi_linear" and (self.attn_res_block_size is not None
                                           or self.moe_latent_size is not None
                                           or self.kda_gate_lower_bound is not None):
            raise ValueError("ModelConfig: arch='kimi_linear' has no AttnRes, no latent MoE and an "
                             "unbounded KDA gate (its HF format cannot say otherwise); set "
                             "attn_res_block_size=None, moe_latent_size=None and "
                             "kda_gate_lower_bound=None")
        if self.vision_config is not None:
            if self.arch != "kimi_k3":
                raise bad("arch", "a vision_config needs arch='kimi_k3' (Kimi Linear's HF format "
                          "has no vision part)")
            if not 0 <= self.vision_config.media_placeholder_token_id < self.vocab_size:
                raise ValueError(f"VisionConfig.media_placeholder_token_id="
                                 f"{self.vision_config.media_placeholder_token_id} is outside the "
                                 f"vocabulary (vocab_size={self.vocab_size})")

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
        """0-indexed layer ``i`` has a routed MoE (else a dense MLP of ``intermediate_size``)."""
        return (i + 1) not in self.dense_mlp_layers

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """1-indexed KDA layers, the complement of ``full_attn_layers``."""
        return tuple(i for i in range(1, self.num_hidden_layers + 1) if i not in self.full_attn_layers)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# ---- presets ---------------------------------------------------------------------------

def _k3() -> ModelConfig:
    return ModelConfig(vision_config=VisionConfig())  # the release is natively multimodal


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


def _debug_vl() -> ModelConfig:
    # `debug` with a tiny tower: learns the synthetic image-text corpus on a CPU in minutes
    # (openk3/vision/synthetic.py). 56-112 pixel images: 4x4 to 8x8 patches, 4 to 16 LM tokens.
    return _debug().replace(
        vocab_size=64, num_hidden_layers=4, full_attn_layers=(4,), attn_res_block_size=2,
        max_position_embeddings=512, vision_config=VisionConfig(
            vt_hidden_size=64, vt_num_hidden_layers=2, vt_num_attention_heads=2, qkv_hidden_size=64,
            vt_intermediate_size=256, init_pos_emb_height=8, init_pos_emb_width=8,
            media_placeholder_token_id=3))


def _small() -> ModelConfig:
    # ~0.92B total / ~0.37B active: the single-GPU preset.
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


def _medium() -> ModelConfig:
    # ~9.4B total / ~1.8B active, K3's ratios at a width of 2048: 3:1 KDA:MLA, a latent MoE at half
    # the width with 128 experts of which 8 are active (6%), two shared experts. The preset to
    # train on one node (FSDP2 over 2-8 GPUs; its memory and MFU are not measured yet: docs/benchmarks.md).
    return ModelConfig(
        vocab_size=65536, hidden_size=2048, num_hidden_layers=28,
        full_attn_layers=tuple(range(4, 29, 4)),
        linear_num_heads=16, linear_head_dim=128,
        num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=8192, num_experts=128, num_experts_per_token=8, moe_intermediate_size=768,
        num_shared_experts=2, moe_latent_size=1024, attn_res_block_size=7,
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
    "debug-vl": _debug_vl,
    "small": _small,
    "medium": _medium,
    "k3": _k3,
    "kimi-linear-48b": _kimi_linear_48b,
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
