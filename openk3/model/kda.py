"""Kimi Delta Attention layer (K3_SPEC §1.2; Kimi Linear variant in §2)."""

from __future__ import annotations

import math

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.model.cache import KDAState
from openk3.ops.conv import causal_conv1d
from openk3.ops.kda import kda
from openk3.ops.norm import gated_rms_norm


class KDAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, H, K, W = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_size
        self.num_heads, self.head_dim = H, K
        self.q_proj = nn.Linear(d, H * K, bias=False)
        self.k_proj = nn.Linear(d, H * K, bias=False)
        self.v_proj = nn.Linear(d, H * K, bias=False)
        self.q_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.k_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.v_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))  # one scalar per head
        self.dt_bias = nn.Parameter(torch.zeros(H * K, dtype=torch.float32))  # per channel
        if cfg.is_k3:
            self.g_proj = nn.Linear(d, H * K, bias=False)  # full-rank output gate
        else:
            self.g_a_proj = nn.Linear(d, K, bias=False)  # Kimi Linear: low-rank output gate
            self.g_b_proj = nn.Linear(K, H * K, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K))
        self.o_proj = nn.Linear(H * K, d, bias=False)

    def forward(self, x: torch.Tensor, state: KDAState | None = None) -> torch.Tensor:
        """x: [B, T, d]. With ``state``, continues from it and updates it in place.

        ``state`` is anything with ``recurrent``, ``conv_q/k/v``, ``cu_seqlens`` and
        ``cu_seqlens_cpu`` attributes:
        the generate path's ``KDAState`` or the serving engine's view onto its state pool."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        st = state or KDAState()
        cu, cu_cpu = st.cu_seqlens, st.cu_seqlens_cpu  # packed varlen batch (serving prefill)
        q, conv_q = causal_conv1d(self.q_proj(x), self.q_conv1d.weight, st.conv_q, cu, cu_cpu)
        k, conv_k = causal_conv1d(self.k_proj(x), self.k_conv1d.weight, st.conv_k, cu, cu_cpu)
        v, conv_v = causal_conv1d(self.v_proj(x), self.v_conv1d.weight, st.conv_v, cu, cu_cpu)
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        beta = torch.sigmoid(self.b_proj(x).float())  # [B, T, H]
        o, final = kda(
            q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, K), f, beta,
            self.A_log, self.dt_bias, lower_bound=self.cfg.kda_gate_lower_bound,
            initial_state=st.recurrent, output_final_state=state is not None, cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )
        if state is not None:
            state.recurrent, state.conv_q, state.conv_k, state.conv_v = final, conv_q, conv_k, conv_v
        gate = self.g_proj(x) if self.cfg.is_k3 else self.g_b_proj(self.g_a_proj(x))
        o = gated_rms_norm(o, self.o_norm.weight, gate.view(B, T, H, K), self.cfg.rms_norm_eps)
        return self.o_proj(o.reshape(B, T, H * K))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Decay parameters as fla initialises them: A in [1, 16], dt in [1e-3, 1e-1]."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        nn.init.ones_(self.o_norm.weight)
