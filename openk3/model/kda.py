"""Kimi Delta Attention layer (K3_SPEC §1.2; Kimi Linear variant in §2)."""

from __future__ import annotations

import math

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.model.branch import Fork
from openk3.model.cache import KDAState
from openk3.model.fuse import fuse_weights, is_fused
from openk3.ops.conv import causal_conv1d, causal_conv1d_pooled, causal_conv1d_update_
from openk3.ops.gemv import linear, norm_linear
from openk3.ops.kda import kda, kda_decode_, kda_verify_pooled


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
        # set by ``fuse()`` (inference): the weights of ``input_projections()`` and of
        # ``short_convs()``, each group concatenated along dim 0 (the modules' weights view them)
        self.fused_proj: torch.Tensor | None = None
        self.fused_conv: torch.Tensor | None = None

    def input_projections(self) -> list[nn.Linear]:
        """The projections of x, in the row order of ``fused_proj``: q, k, v (side by side, as
        the fused short convolution reads them), the gate's first projection, f_a, b."""
        gate = self.g_proj if self.cfg.is_k3 else self.g_a_proj
        return [self.q_proj, self.k_proj, self.v_proj, gate, self.f_a_proj, self.b_proj]

    def short_convs(self) -> list[nn.Conv1d]:
        return [self.q_conv1d, self.k_conv1d, self.v_conv1d]

    def fuse(self) -> None:
        """One GEMM for ``input_projections()`` and one short convolution for q|k|v from now on
        (``openk3.model.fuse.fuse_projections``)."""
        self.fused_proj = fuse_weights(self.input_projections(), self.fused_proj)
        self.fused_conv = fuse_weights(self.short_convs(), self.fused_conv)

    def forward(self, x: torch.Tensor, state: KDAState | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, d]. With ``state``, continues from it and updates it in place. With
        ``residual`` ([B, T, d]), returns ``residual`` + the layer's output (a new tensor; when
        decoding, the add is ``o_proj``'s GEMV's).

        ``state`` is anything with ``recurrent``, ``conv_q/k/v``, ``conv_qkv`` (the three side
        by side), ``cu_seqlens`` and ``cu_seqlens_cpu`` attributes: the generate path's
        ``KDAState`` or the serving engine's view onto its state pool.

        A state with a ``decode_pools`` method (the serving engine's decode step) may run a
        fused layer's one-token step in place: ``decode_pools()`` gives the layer's recurrent
        pool ``[n, H, K, V]``, its conv pool ``[n, 3*H*K, W-1]`` and the rows' slots ``[B]``
        (or None), and the step reads and writes those rows directly (``_pooled_decode``).

        A state with a ``verify_pools`` method (the serving engine's speculative verify step,
        ``openk3/serve/verify.py``: T = K + 1 positions per row, of which only the first few
        will be kept) is read and not written: ``verify_pools()`` gives the layer's recurrent
        pool, its conv pool, the rows' slots and ``keep``, and the segment runs from the rows'
        states (``_pooled_verify``); ``keep(self, q, k, v, f, beta_logits, conv_inputs)``
        receives what writing the states after the kept positions needs
        (``rollback_recompute_``, ``conv_state_rollback``): q, k, v ``[B, T, H, K]`` after the
        short convolution, f ``[B, T, H, K]``, beta's logits ``[B, T, H]`` and the
        convolution's inputs ``[B, T, 3*H*K]``. It needs a fused layer (``openk3.model.fuse``)."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        fused = (is_fused(self.fused_proj, self.input_projections())
                 and is_fused(self.fused_conv, self.short_convs()))
        verify_pools = getattr(state, "verify_pools", None)
        if verify_pools is not None:
            if not fused:
                raise ValueError("KDA verify pass: the layer's projections are not fused "
                                 "(openk3.model.fuse.fuse_projections)")
            return self._pooled_verify(x, *verify_pools(), residual=residual)
        decode_pools = getattr(state, "decode_pools", None)
        if decode_pools is not None and T == 1 and fused:
            pools = decode_pools()
            if pools is not None:
                return self._pooled_decode(x, *pools, residual=residual)
        st = state or KDAState()
        (q, k, v), conv_state, (gate, f, b) = self._convolved_projections(x, st)
        q, k, v = (t.view(B, T, H, K) for t in (q, k, v))
        f = self.f_b_proj(f).view(B, T, H, K)
        beta = torch.sigmoid(b.float())  # [B, T, H]
        o, final = kda(
            q, k, v, f, beta, self.A_log, self.dt_bias, lower_bound=self.cfg.kda_gate_lower_bound,
            initial_state=st.recurrent, output_final_state=state is not None,
            cu_seqlens=st.cu_seqlens, cu_seqlens_cpu=st.cu_seqlens_cpu,
            static_varlen=getattr(st, "static_varlen", False),
        )
        if state is not None:
            state.recurrent = final
            if isinstance(conv_state, torch.Tensor):
                state.conv_qkv = conv_state
            else:
                state.conv_q, state.conv_k, state.conv_v = conv_state
        return self._output(o, gate, residual)

    def _output(self, o: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The gated output norm and ``o_proj`` (plus ``residual``): o [B, T, H, V], gate the
        gate's first projection [B, T, ...]; returns [B, T, d]."""
        B, T, H, K = o.shape
        if not self.cfg.is_k3:
            gate = self.g_b_proj(gate)
        # a GEMV whose prologue is the gated norm over the heads when decoding
        return norm_linear(o.reshape(B, T, H * K), self.o_proj.weight, self.o_norm.weight,
                           self.cfg.rms_norm_eps, gate=gate.reshape(B, T, H * K), add=residual)

    def _pooled_decode(self, x: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor,
                       slots: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row (x [B, 1, d]) of a fused layer, the states of rows ``slots`` of the
        pools (recurrent ``[n, H, K, V]``, conv ``[n, 3*H*K, W-1]``) read and written in place:
        one GEMM, one convolution kernel, ``f_b_proj``, one KDA kernel, the output. The same
        math as ``forward``'s other path (on the CPU the same reference ops, in the same order)."""
        B = x.shape[0]
        H, K = self.num_heads, self.head_dim
        qkv_in, gate, f, b = self._fused_inputs(x)
        fork = Fork(x)  # in a captured graph, the decay's projection beside the convolution
        with fork.side():
            f = linear(f, self.f_b_proj.weight).view(B, 1, H, K)
        q, k, v = (t.view(B, 1, H, K) for t in
                   causal_conv1d_update_(qkv_in[:, 0], self.fused_conv, conv, slots, parts=3))
        fork.join()
        o = kda_decode_(q, k, v, f, b, self.A_log, self.dt_bias, recurrent, slots,
                        lower_bound=self.cfg.kda_gate_lower_bound)
        return self._output(o, gate, residual)

    def _pooled_verify(self, x: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                       keep, residual: torch.Tensor | None = None) -> torch.Tensor:
        """T tokens per row (x [B, T, d]) of a fused layer from the states of rows ``slots`` of
        the pools (recurrent ``[n, H, K, V]``, conv ``[n, 3*H*K, W-1]``), which are read and not
        written; ``keep`` receives the segment (``forward``'s docstring). The same math as
        ``forward``'s other path from the gathered states."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        qkv_in, gate, f, b = self._fused_inputs(x)
        fork = Fork(x)  # in a captured graph, the decay's projection beside the convolution
        with fork.side():
            f = linear(f, self.f_b_proj.weight).view(B, T, H, K)
        q, k, v = (t.view(B, T, H, K) for t in causal_conv1d_pooled(qkv_in, self.fused_conv, conv, slots, parts=3))
        fork.join()
        o = kda_verify_pooled(q, k, v, f, b, self.A_log, self.dt_bias, recurrent, slots,
                              lower_bound=self.cfg.kda_gate_lower_bound)
        keep(self, q, k, v, f, b, qkv_in)
        return self._output(o, gate, residual)

    def _fused_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The one GEMM of a fused layer: q|k|v before the convolution [B, T, 3*H*K], then the
        gate's first projection, f_a and beta's logits (``input_projections()[3:]``)."""
        HK = self.num_heads * self.head_dim
        return linear(x, self.fused_proj).split(
            [3 * HK] + [m.out_features for m in self.input_projections()[3:]], dim=-1)

    def _convolved_projections(self, x: torch.Tensor, st: KDAState) -> tuple[tuple, tuple, tuple]:
        """The projections of x [B, T, d] and the short convolutions of q, k, v: returns
        ``(q, k, v)`` [B, T, H*K] after the convolutions, their new conv states (fused: one
        tensor [B, 3*H*K, W-1], for ``conv_qkv``; else a tuple of three [B, H*K, W-1]; ``N``
        rows for a packed batch) and the first projections of the gate, f and beta.

        Fused: one GEMM, then one convolution over the q|k|v columns with the three conv states
        side by side (the convolution is depthwise: the same result as one call per part)."""
        cu, cu_cpu = st.cu_seqlens, st.cu_seqlens_cpu  # packed varlen batch (serving prefill)
        projections, convs = self.input_projections(), self.short_convs()
        if is_fused(self.fused_proj, projections) and is_fused(self.fused_conv, convs):
            qkv_in, *rest = self._fused_inputs(x)
            # [B, 3*H*K, W-1] read once: the serving view gathers per read
            qkv, state = causal_conv1d(qkv_in, self.fused_conv, st.conv_qkv, cu, cu_cpu, parts=3)
            return qkv, state, tuple(rest)
        states = (st.conv_q, st.conv_k, st.conv_v)  # read once: the serving view gathers per read
        q, k, v, *rest = (m(x) for m in projections)
        outs = [causal_conv1d(t, conv.weight, state, cu, cu_cpu)
                for t, conv, state in zip((q, k, v), convs, states)]
        return tuple(y for y, _ in outs), tuple(state for _, state in outs), tuple(rest)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Decay parameters as fla initialises them: A in [1, 16], dt in [1e-3, 1e-1]."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        nn.init.ones_(self.o_norm.weight)
