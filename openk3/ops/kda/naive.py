"""The per-token KDA recurrence (K3_SPEC §1.2) and the pieces the other paths share with it.

Per head, with an fp32 state ``S`` of shape ``[K, V]``:

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)
"""

from __future__ import annotations

import torch

_L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, as the K3 kernels do (not F.normalize)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2NORM_EPS)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, scale: float | None,
               use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q (normalised and scaled) and k (normalised); q, k: [..., K]."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q * scale, k


def delta_rule_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token on prepared fp32 inputs. S: [B, H, K, V]; q, k, g: [B, H, K]; v: [B, H, V];
    beta: [B, H]. Returns (o [B, H, V], S [B, H, K, V]); out of place so autograd sees every step."""
    S = S * g.exp()[..., None]                                  # Diag(alpha_t) S_{t-1}
    v_err = v - torch.einsum("bhk,bhkv->bhv", k, S)             # what the state mispredicts for k_t
    S = S + torch.einsum("bhk,bhv->bhkv", k, beta[..., None] * v_err)
    return torch.einsum("bhk,bhkv->bhv", q, S), S


def kda_recurrent_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, scale: float | None = None,
                      initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                      use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token KDA loop: the ground truth every other path is tested against.

    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log decay; beta: ``[B, T, H]``;
    initial_state: ``[B, H, K, V]``. Returns o ``[B, T, H, V]`` in v.dtype and, when
    ``output_final_state``, the final state ``[B, H, K, V]`` fp32 (else None).

    Example::

        >>> q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
        >>> g, beta = -torch.rand(1, 5, 2, 8), torch.rand(1, 5, 2)
        >>> o, S = kda_recurrent_ref(q, k, v, g, beta, output_final_state=True)
        >>> o.shape, S.shape
        (torch.Size([1, 5, 2, 8]), torch.Size([1, 2, 8, 8]))
    """
    B, T, H, K = q.shape
    q, k = prepare_qk(q, k, scale, use_qk_l2norm)
    vf, g, beta = v.float(), g.float(), beta.float()
    S = (q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None
         else initial_state.float())
    outs = []
    for t in range(T):
        o_t, S = delta_rule_step(S, q[:, t], k[:, t], vf[:, t], g[:, t], beta[:, t])
        outs.append(o_t)
    return torch.stack(outs, dim=1).to(v.dtype), (S if output_final_state else None)
