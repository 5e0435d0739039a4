"""KDA's fast path: fla-core's Triton kernels (``chunk_kda``, ``fused_recurrent_kda``) with the
gate fused in, called with the layouts and flags openk3's arguments map to.

Under ``torch.compile`` the kernels are opaque: dynamo calls them as they are, with a graph
break around the call, instead of tracing fla's Python and Triton launchers."""

from __future__ import annotations

import torch

from openk3.ops.fast import compile_disabled, importable
from openk3.ops.kda.gate import SAFE_LOWER_BOUND, a_log_heads


def fla_available() -> bool:
    """Whether fla-core's KDA kernels import (needs triton; the import takes ~10 s, once)."""
    return importable("fla.ops.kda")


@compile_disabled("fla-core's Triton KDA kernels run as they are")
def kda_fla(q, k, v, f, beta, A_log, dt_bias, lower_bound, scale, initial_state,
            output_final_state, use_qk_l2norm, cu_seqlens=None, cu_seqlens_cpu=None, static_varlen=False):
    """``kda`` on fla's kernels; arguments as ``kda``'s, already validated, ``f`` [B, T, H, K]."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    B, T, H, K = q.shape
    gate_args = dict(
        A_log=a_log_heads(A_log, H),                  # [H]: the kernels index A_log[h]
        dt_bias=dt_bias.reshape(H * K),               # [H*K]: the kernels index dt_bias[h*K + c]
        use_gate_in_kernel=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        lower_bound=lower_bound,
    )
    if initial_state is not None:
        initial_state = initial_state.float()         # chunk_kda asserts an fp32 state
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (q, k, v, f, beta, A_log, dt_bias, initial_state))
    # fused_recurrent_kda is forward-only (no autograd), so training steps of T == 1 go
    # through chunk_kda.
    if T == 1 and not needs_grad and cu_seqlens is None:
        return fused_recurrent_kda(q, k, v, f, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, **gate_args)
    graph = (dict(use_graph=True, max_num_seqs=cu_seqlens.numel() - 1)
             if static_varlen and cu_seqlens is not None else {})
    return chunk_kda(q, k, v, f, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     cu_seqlens_cpu=None if static_varlen else cu_seqlens_cpu, **graph,
                     # fla's dense tensor-core path exists only for bounds in [-5, 0)
                     safe_gate=lower_bound is not None and lower_bound >= SAFE_LOWER_BOUND,
                     **gate_args)
