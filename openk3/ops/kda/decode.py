"""One KDA decode token in plain PyTorch (fla's ``fused_recurrent_kda`` is the fast path)."""

from __future__ import annotations

import torch

from openk3.ops.kda.naive import delta_rule_step, prepare_qk


def kda_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, state: torch.Tensor, scale: float | None = None,
                    use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token. q, k: ``[B, H, K]``; v: ``[B, H, V]``; g: ``[B, H, K]`` log decay;
    beta: ``[B, H]``; state: ``[B, H, K, V]``. Returns (o ``[B, H, V]`` in v.dtype,
    new state ``[B, H, K, V]`` fp32); ``state`` itself is not modified.

    Example::

        >>> q, k, v = (torch.randn(3, 2, 8) for _ in range(3))
        >>> g, beta, state = -torch.rand(3, 2, 8), torch.rand(3, 2), torch.zeros(3, 2, 8, 8)
        >>> o, state = kda_decode_step(q, k, v, g, beta, state)
        >>> o.shape, state.shape
        (torch.Size([3, 2, 8]), torch.Size([3, 2, 8, 8]))
    """
    q, k = prepare_qk(q, k, scale, use_qk_l2norm)
    o, S = delta_rule_step(state.float(), q, k, v.float(), g.float(), beta.float())
    return o.to(v.dtype), S
