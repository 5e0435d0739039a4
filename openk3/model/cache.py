"""Per-sequence decoding cache for the generate path (the serving engine has its own paged one).

KDA layers keep a fixed-size state: the recurrent state ``S`` [B, H, K, V] (fp32) and the last
``W-1`` conv inputs of q, k and v ([B, H*K, W-1] each). MLA layers keep the 576-wide latent
per token: the normalised ``c`` [B, T, kv_lora_rank] and the shared key part ``k_r``
[B, T, qk_rope_head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDAState:
    recurrent: torch.Tensor | None = None  # [B, H, K, V] fp32
    conv_q: torch.Tensor | None = None  # [B, H*K, W-1]
    conv_k: torch.Tensor | None = None
    conv_v: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None  # always None here: one sequence per batch row
    cu_seqlens_cpu: torch.Tensor | None = None

    @property
    def conv_qkv(self) -> torch.Tensor | None:
        """The three conv states side by side, [B, 3*H*K, W-1] (what one fused convolution over
        q|k|v reads), or None before the first step."""
        return None if self.conv_q is None else torch.cat([self.conv_q, self.conv_k, self.conv_v], dim=1)

    @conv_qkv.setter
    def conv_qkv(self, value: torch.Tensor) -> None:
        self.conv_q, self.conv_k, self.conv_v = value.chunk(3, dim=1)


@dataclass
class MLAState:
    latent: torch.Tensor | None = None  # [B, T, kv_lora_rank], after kv_a_layernorm
    k_rope: torch.Tensor | None = None  # [B, T, qk_rope_head_dim]

    @property
    def length(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def attend(self, layer, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """Append this step's latents, then attend over the whole cached sequence: absorbed
        form for a single decode token, expanded otherwise. Returns [B, T, H, v_dim]."""
        past = self.length
        latent, k_rope = self.append(latent, k_rope)
        if q.shape[1] == 1 and past > 0:
            return layer.attend_absorbed(q, latent, k_rope)
        return layer.attend_expanded(q, latent, k_rope, past)

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's latents; returns the whole cached sequence."""
        if self.latent is None:
            self.latent, self.k_rope = latent, k_rope
        else:
            self.latent = torch.cat([self.latent, latent], dim=1)
            self.k_rope = torch.cat([self.k_rope, k_rope], dim=1)
        return self.latent, self.k_rope


@dataclass
class ModelCache:
    """One entry per decoder layer."""

    layers: list[KDAState | MLAState] = field(default_factory=list)

    @classmethod
    def for_config(cls, cfg) -> "ModelCache":
        return cls([MLAState() if cfg.is_mla_layer(i) else KDAState()
                    for i in range(cfg.num_hidden_layers)])
