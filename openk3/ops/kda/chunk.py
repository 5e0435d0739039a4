"""Chunkwise KDA (WY representation, UT transform) in plain PyTorch: training and prefill
off the fast path, and the reference the fla kernels are tested against on GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.kda.naive import prepare_qk

# exp(85) ~ 8e36 sits below fp32's max (~3.4e38, exp(88.7)) with room for the sum over K
# of unit-norm key products; beyond it 1 / cumulative decay would overflow.
_MAX_RECIPROCAL_LOG_DECAY = 85.0


def _to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, ...] with T a multiple of chunk_size -> [B, H, N, C, ...]."""
    B, T, H = x.shape[:3]
    x = x.reshape(B, T // chunk_size, chunk_size, H, *x.shape[3:])
    return x.movedim(3, 1)


def kda_chunk_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, scale: float | None = None,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                  use_qk_l2norm: bool = True, chunk_size: int = 16,
                  bounded_gate: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA in plain PyTorch: the same result as ``kda_recurrent_ref``, with a Python
    loop over chunks only.

    Within a chunk, with Gamma_r = exp(cumulative log-decay up to position r), the state
    corrections delta satisfy the unit-lower-triangular system (I + A) delta = beta (v - (Gamma k) S_0),
    A[r, s] = beta_r sum_c k_rc k_sc Gamma_rc / Gamma_sc for s < r. Solving it once per chunk
    for all chunks at once (the UT transform) gives delta = U - W S_0 (the WY representation),
    so the sequential part is two matmuls per chunk.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log decay;
            beta: ``[B, T, H]``; initial_state: ``[B, H, K, V]``. Any T (the tail is padded).
        bounded_gate: g >= -5 (K3's gate), so the intra-chunk products are dense matmuls of
            ``k * Gamma`` / ``q * Gamma`` with ``k / Gamma``. Raises ValueError when the
            cumulative log-decay of a chunk would overflow fp32 on that path. With False
            (Kimi Linear's unbounded softplus gate) the decays are formed pairwise as
            exp(G_r - G_s) for r >= s only: always finite, C times more memory.

    Returns:
        o ``[B, T, H, V]`` in v.dtype; final state ``[B, H, K, V]`` fp32 or None.

    Example::

        >>> q, k, v = (torch.randn(1, 20, 2, 8) for _ in range(3))
        >>> g, beta = -5 * torch.rand(1, 20, 2, 8), torch.rand(1, 20, 2)
        >>> o, S = kda_chunk_ref(q, k, v, g, beta, output_final_state=True)
        >>> o.shape, S.shape
        (torch.Size([1, 20, 2, 8]), torch.Size([1, 2, 8, 8]))
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    q, k = prepare_qk(q, k, scale, use_qk_l2norm)
    vf, g, beta = v.float(), g.float(), beta.float()
    # Padded positions have k = 0 and beta = 0 (no state update) and g = 0 (no decay),
    # so the final state is unchanged by them; their outputs are dropped.
    pad = -T % C
    q, k, vf, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, vf, g))
    beta = F.pad(beta, (0, 0, 0, pad))
    q, k, vf, g, beta = (_to_chunks(x, C) for x in (q, k, vf, g, beta))  # [B, H, N, C, ...]
    N = q.shape[2]

    G = g.cumsum(-2)                                          # [B, H, N, C, K] log Gamma
    decay = G.exp()                                           # Gamma, in (0, 1]
    q_dec = q * decay                                         # reads S_0 through the decay
    if bounded_gate:
        # Checking the cumulative decay itself (not chunk_size * min(g)) is the exact condition
        # for exp(-G) below to stay finite; with g >= -5 and C = 16 it always holds.
        min_log_decay = G.min().item()
        if min_log_decay < -_MAX_RECIPROCAL_LOG_DECAY:
            raise ValueError(
                f"bounded_gate=True but the cumulative log-decay in a chunk of {C} reaches "
                f"{min_log_decay:.1f} < -{_MAX_RECIPROCAL_LOG_DECAY:.0f}: 1/decay would overflow "
                f"fp32. Use g >= {-_MAX_RECIPROCAL_LOG_DECAY / C:.2f}, a smaller chunk_size, "
                f"or bounded_gate=False")
        k_inv = k * (-G).exp()                                # k_s / Gamma_s, <= e^85 * |k|
        A_kk = (k * decay) @ k_inv.transpose(-1, -2)          # [B, H, N, C, C]
        A_qk = q_dec @ k_inv.transpose(-1, -2)                # [B, H, N, C, C]
    else:
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # [B, H, N, C(r), C(s), K]: exp(G_r - G_s), masked before exp so r < s never overflows
        pair_decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(
            ~causal[:, :, None], float("-inf")).exp()
        A_kk = torch.einsum("...rc,...sc,...rsc->...rs", k, k, pair_decay)
        A_qk = torch.einsum("...rc,...sc,...rsc->...rs", q, k, pair_decay)
    A_kk = A_kk.tril(-1) * beta[..., :, None]                 # strictly lower: s < r
    A_qk = A_qk.tril()                                        # o_r sees delta_s for s <= r

    eye = torch.eye(C, dtype=A_kk.dtype, device=A_kk.device)
    L = eye + A_kk                                            # unit lower triangular
    U = torch.linalg.solve_triangular(L, beta[..., None] * vf, upper=False,
                                      unitriangular=True)     # [B, H, N, C, V]
    W = torch.linalg.solve_triangular(L, beta[..., None] * k * decay, upper=False,
                                      unitriangular=True)     # [B, H, N, C, K]
    G_last = G[..., -1:, :]                                   # [B, H, N, 1, K]
    k_to_end = k * (G_last - G).exp()                         # decay from s to chunk end, <= 1

    S = vf.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outs = []
    for n in range(N):
        delta = U[:, :, n] - W[:, :, n] @ S                   # [B, H, C, V]
        outs.append(q_dec[:, :, n] @ S + A_qk[:, :, n] @ delta)
        S = S * G_last[:, :, n].exp().transpose(-1, -2) + k_to_end[:, :, n].transpose(-1, -2) @ delta
    o = torch.stack(outs, dim=2)                              # [B, H, N, C, V]
    o = o.movedim(1, 3).reshape(B, N * C, H, V)[:, :T]
    return o.to(v.dtype), (S if output_final_state else None)
