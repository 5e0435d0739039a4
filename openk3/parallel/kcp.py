"""KDA context parallelism (KCP, K3_SPEC §3): one KDA layer over a sequence split into P
contiguous shards, one per rank, equal to the one-process result. The derivation is in
``docs/long_context.md``; in short, with openk3's state layout (``S`` [K, V] per head,
``o_t = S_t^T q_t``):

    S_t = A_t S_{t-1} + b_t,   A_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)),   b_t = beta_t k_t v_t^T

so a shard maps its incoming state affinely, ``S_out = M S_in + S~`` with ``M = A_T ... A_1``
(later tokens on the left) and ``S~`` the shard's final state from zero. Every column of S
follows the recurrence on its own, so one KDA call on ``v_aug = [v | 0]`` ([..., V + K]) from
the initial state ``[0 | I]`` yields all of it at once:

* the final state ``[S~ | M]`` ([K, V + K]);
* the outputs ``[o~_t | q_t^T P_t]``, ``P_t = A_t ... A_1``: the outputs from a zero state and
  the row that maps ``S_in`` to each output's correction, ``o_t = o~_t + (q_t^T P_t) S_in``.

One all-gather of the fixed-size ``[S~ | M]`` ([B, H, K, V + K]) from every rank, then each rank
scans its predecessors, ``S_in(r) = M(r-1) S_in(r-1) + S~(r-1)`` from ``S_in(0) = 0``, and
corrects its outputs with one matmul (``method="correct"``), or reruns its shard from
``S_in`` (``method="rerun"``: the plainest form, one more KDA call). Gradients reach earlier
ranks through the all-gather's backward (a reduce-scatter of the gradients of ``[S~ | M]``).

Packed documents (``cu_seqlens``): a shard holds local segments; only its first may continue
a document from the previous rank (initial state ``[0 | I]``); segments that start a document
begin from ``[0 | 0]``, so their correction rows are zero and, when such a segment is the
shard's last, its ``M`` is zero: the scan resets there.
"""

from __future__ import annotations

import torch

from openk3.ops.kda import kda


def state_scan(gathered: torch.Tensor, count: int, value_dim: int) -> torch.Tensor:
    """The incoming state of the shard that follows the first ``count`` shards of ``gathered``.

    gathered: ``[P, B, H, K, V + K]`` fp32, ``[S~ | M]`` of every shard in order.
    Returns ``S_in`` [B, H, K, V] fp32: ``S = M_j S + S~_j`` for j = 0 .. count-1, from S = 0.

    The zero start is taken from ``gathered`` (times 0) rather than made anew, so that even
    rank 0, which reads no predecessor, has the all-gather in its autograd graph: the
    all-gather's backward is a reduce-scatter that every rank must join."""
    K = gathered.shape[-2]
    S = gathered[0, ..., :value_dim] * 0
    for j in range(count):
        S_local, M = gathered[j].split([value_dim, K], dim=-1)
        S = M @ S + S_local
    return S


def kcp_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
            beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, cp,
            lower_bound: float | None, cu_seqlens: torch.Tensor | None = None,
            cu_seqlens_cpu: torch.Tensor | None = None, continues: bool,
            method: str = "correct") -> tuple[torch.Tensor, torch.Tensor]:
    """KDA on this rank's shard of a sequence split over the ranks of ``cp``: collective.

    Args:
        q, k, v, f, beta, A_log, dt_bias, lower_bound: as ``openk3.ops.kda.kda``'s, for the
            local tokens ([B, T_r, H, K] etc.).
        cp: anything with ``rank`` and ``all_gather(x)`` -> ``[P, *x.shape]`` with autograd
            (``ContextParallel``).
        cu_seqlens, cu_seqlens_cpu: the local segments of a packed sequence (B = 1), or None
            (each row one sequence).
        continues: the first local segment (every row, without cu_seqlens) continues a
            sequence from the previous rank.
        method: ``"correct"`` (one KDA call of width V + K, then a matmul) or ``"rerun"``
            (the summary call, then the plain call from the incoming state).

    Returns:
        o ``[B, T_r, H, V]`` in v.dtype; the state after this shard ``[B, H, K, V]`` fp32 (of
        its last segment with cu_seqlens): on the last rank, the sequence's final state.
    """
    if method not in ("correct", "rerun"):
        raise ValueError(f"`method` must be 'correct' or 'rerun', got {method!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)   # [B, T, H, V + K]
    init = torch.zeros(N, H, K, V + K, dtype=torch.float32, device=q.device)
    if continues:
        rows = slice(None) if cu_seqlens is None else slice(0, 1)
        init[rows, :, :, V:] = torch.eye(K, device=q.device)
    args = {"lower_bound": lower_bound, "cu_seqlens": cu_seqlens, "cu_seqlens_cpu": cu_seqlens_cpu}
    o_aug, final = kda(q, k, v_aug, f, beta, A_log, dt_bias, initial_state=init,
                       output_final_state=True, **args)
    summary = final if cu_seqlens is None else final[-1:]     # [B, H, K, V + K]
    gathered = cp.all_gather(summary)                         # [P, B, H, K, V + K]
    S_in = state_scan(gathered, cp.rank, V)                   # [B, H, K, V]
    S_local, M = summary.split([V, K], dim=-1)
    S_out = M @ S_in + S_local
    if not continues:  # a shard that starts its sequence(s) reads no incoming state
        S_in = S_in * 0
    if method == "rerun":
        # the first segment starts from S_in, the others (packed documents) from zero
        init_v = S_in if N == S_in.shape[0] else torch.cat([S_in, S_in.new_zeros(N - 1, H, K, V)])
        o, _ = kda(q, k, v, f, beta, A_log, dt_bias, initial_state=init_v, **args)
        return o, S_out
    o_local, qP = o_aug.split([V, K], dim=-1)                 # [B, T, H, V], [B, T, H, K]
    # applied on every rank, zeros included: each rank's loss must reach the all-gather
    correction = torch.einsum("bthk,bhkv->bthv", qP.float(), S_in)
    return (o_local.float() + correction).to(v.dtype), S_out
