"""Gated Multi-head Latent Attention with no positional encoding (K3_SPEC §1.3).

Two equivalent forms:

* **expanded** (training, prefill): ``kv_b_proj`` expands the latent into per-head keys and
  values and ``scaled_dot_product_attention`` runs causal softmax attention;
* **absorbed** (decode): ``kv_b_proj``'s key half is folded into the query and its value half
  into the output, so attention reads the 576-wide latent cache directly — a multi-query
  attention with head dim ``kv_lora_rank + qk_rope_head_dim``.

NoPE: the ``qk_rope_head_dim`` part of q and k exists (checkpoint shapes) but is never rotated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk3.config import ModelConfig
from openk3.model.cache import MLAState
from openk3.ops.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, H = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = H
        self.nope, self.rope, self.v_dim, self.rank = (
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
        self.scale = cfg.qk_head_dim ** -0.5
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.mla_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        if cfg.is_k3:
            self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)  # elementwise output gate
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(B, T, self.num_heads, self.nope + self.rope)  # [B, T, H, 192]

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        return self.kv_a_layernorm(c), k_r  # [B, T, 512], [B, T, 64]

    def forward(self, x: torch.Tensor, state: MLAState | None = None) -> torch.Tensor:
        """x: [B, T, d]. With ``state``, attends over the cached latents too and appends to them.

        ``state.attend(self, q, c, k_r)`` stores the new latents and picks the form: the
        generate path's ``MLAState`` or the serving engine's paged views."""
        B, T, _ = x.shape
        q = self._query(x)
        c, k_r = self._latent(x)
        if state is None:
            o = self._attend_expanded(q, c, k_r, 0)
        else:
            o = state.attend(self, q, c, k_r)
        o = o.reshape(B, T, self.num_heads * self.v_dim)
        if self.cfg.is_k3:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _attend_expanded(self, q: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor,
                         past: int) -> torch.Tensor:
        """q: [B, Tq, H, 192]; c: [B, Tk, 512]; k_r: [B, Tk, 64]; Tk = past + Tq."""
        B, Tq, H, _ = q.shape
        Tk = c.shape[1]
        kv = self.kv_b_proj(c).view(B, Tk, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_r.unsqueeze(2).expand(B, Tk, H, self.rope)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, dim]
        if past == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:  # query i sits at absolute position past + i
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=past)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o.transpose(1, 2)  # [B, Tq, H, v_dim]

    def _attend_absorbed(self, q: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
        """Decode of one token over the latent cache. q: [B, 1, H, 192]; c: [B, Tk, 512];
        ``mask`` [B, Tk] bool marks real cache entries (rows of different lengths, padded)."""
        H = self.num_heads
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        w_k, w_v = w[:, : self.nope], w[:, self.nope:]  # [H, 128, 512], [H, 128, 512]
        q_nope, q_rope = q[:, 0].split([self.nope, self.rope], dim=-1)  # [B, H, 128], [B, H, 64]
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_k)  # [B, H, 512]
        scores = (torch.einsum("bhc,btc->bht", q_lat, c)
                  + torch.einsum("bhr,btr->bht", q_rope, k_r)).float() * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1).to(c.dtype)  # [B, H, Tk]
        o_lat = torch.einsum("bht,btc->bhc", p, c)  # [B, H, 512]
        return torch.einsum("bhc,hdc->bhd", o_lat, w_v).unsqueeze(1)  # [B, 1, H, 128]
