"""Gated Multi-head Latent Attention with no positional encoding (K3_SPEC §1.3).

Two equivalent forms:

* **expanded** (training, prefill; ``attend_expanded``): ``kv_b_proj`` expands the latent into per-head keys and
  values and ``scaled_dot_product_attention`` runs causal softmax attention;
* **absorbed** (decode; ``attend_absorbed``): ``kv_b_proj``'s key half is folded into the query and its value half
  into the output, so attention reads the 576-wide latent cache directly — a multi-query
  attention with head dim ``kv_lora_rank + qk_rope_head_dim``.

NoPE: the ``qk_rope_head_dim`` part of q and k exists (checkpoint shapes) but is never rotated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk3.config import ModelConfig
from openk3.model.branch import Fork
from openk3.model.cache import MLAState
from openk3.model.fuse import fuse_weights, project
from openk3.ops.gemv import linear
from openk3.ops.norm import rms_norm
from openk3.ops.situ import sigmoid_gate


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
        # set by ``fuse()`` (inference): the weights of ``input_projections()`` concatenated
        # along dim 0 (the modules' weights view it)
        self.fused_proj: torch.Tensor | None = None

    def input_projections(self) -> list[nn.Linear]:
        """The projections of x, in the row order of ``fused_proj``: the query's first
        (``q_a_proj``, or ``q_proj`` without a query LoRA), ``kv_a_proj_with_mqa``, and K3's
        output gate ``g_proj``."""
        q = self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj
        return [q, self.kv_a_proj_with_mqa] + ([self.g_proj] if self.cfg.is_k3 else [])

    def fuse(self) -> None:
        """One GEMM for ``input_projections()`` from now on (``openk3.model.fuse``)."""
        self.fused_proj = fuse_weights(self.input_projections(), self.fused_proj)

    def _query(self, q: torch.Tensor) -> torch.Tensor:
        """The first query projection's output [B, T, q_lora_rank] (or [B, T, H*192] without a
        query LoRA) -> the queries [B, T, H, 192]."""
        B, T, _ = q.shape
        if self.cfg.q_lora_rank is not None:
            q = linear(self.q_a_layernorm(q), self.q_b_proj.weight)  # a GEMV when decoding
        return q.view(B, T, self.num_heads, self.nope + self.rope)

    def _latent(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_a_proj_with_mqa``'s output [B, T, 576] -> c [B, T, 512] (normalised), k_r [B, T, 64]."""
        c, k_r = kv.split([self.rank, self.rope], dim=-1)
        return self.kv_a_layernorm(c), k_r

    def forward(self, x: torch.Tensor, state: MLAState | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, d]. With ``state``, attends over the cached latents too and appends to them.
        With ``residual`` ([B, T, d]), returns ``residual`` + the layer's output (a new tensor;
        when decoding, the add is ``o_proj``'s GEMV's).

        ``state.attend(self, q, c, k_r)`` stores the new latents and picks the form: the
        generate path's ``MLAState`` or the serving engine's paged views."""
        B, T, _ = x.shape
        q, kv, *gate = project(x, self.input_projections(), self.fused_proj)  # gate: K3 only
        fork = Fork(x)  # in a captured decode graph, the queries beside the latents
        with fork.side():
            q = self._query(q)
        c, k_r = self._latent(kv)
        fork.join()
        if state is None:
            o = self.attend_expanded(q, c, k_r, 0)
        else:
            o = state.attend(self, q, c, k_r)
        o = o.reshape(B, T, self.num_heads * self.v_dim)
        if gate:
            o = sigmoid_gate(o, gate[0])  # one kernel on CUDA
        return linear(o, self.o_proj.weight, residual)

    def attend_expanded(self, q: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor,
                        past: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of ``Tq`` new queries over ``Tk = past + Tq`` latents, with keys and
        values expanded per head by ``kv_b_proj`` (training, prefill).

        Args:
            q: queries ``[B, Tq, H, qk_nope_head_dim + qk_rope_head_dim]`` ([B, Tq, H, 192]).
            c: normalised latents ``[B, Tk, kv_lora_rank]`` ([B, Tk, 512]), the cached ones first.
            k_r: the shared key part ``[B, Tk, qk_rope_head_dim]`` ([B, Tk, 64]).
            past: how many of the Tk positions precede the queries: query i sits at ``past + i``.
            mask: ``[Tq, Tk]`` bool, True where query i may read key j; replaces the causal
                mask (the draft's training-time test, ``openk3/model/draft.py``).

        Returns:
            ``[B, Tq, H, v_head_dim]`` ([B, Tq, H, 128]).
        """
        B, Tq, H, _ = q.shape
        Tk = c.shape[1]
        kv = self.kv_b_proj(c).view(B, Tk, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_r.unsqueeze(2).expand(B, Tk, H, self.rope)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, dim]
        if mask is not None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        elif past == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:  # query i sits at absolute position past + i
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=past)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o.transpose(1, 2)  # [B, Tq, H, v_dim]

    def attend_absorbed(self, q: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one decode token per row over its latent cache, with ``kv_b_proj``
        folded into the query and the output (a multi-query attention of head dim 576).

        Args:
            q: queries ``[B, 1, H, qk_nope_head_dim + qk_rope_head_dim]`` ([B, 1, H, 192]).
            c: normalised latents ``[B, Tk, kv_lora_rank]`` ([B, Tk, 512]), the new token's included.
            k_r: the shared key part ``[B, Tk, qk_rope_head_dim]`` ([B, Tk, 64]).
            mask: ``[B, Tk]`` bool, True at real cache entries (rows of different lengths,
                padded); None: every entry is real.

        Returns:
            ``[B, 1, H, v_head_dim]`` ([B, 1, H, 128]), equal to ``attend_expanded`` of the last
            position.
        """
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
