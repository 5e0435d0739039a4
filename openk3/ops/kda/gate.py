"""KDA's decay gate (K3_SPEC §1.2): raw decay logits ``f`` -> per-channel log decay ``g``.

K3's bounded gate ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))`` keeps ``g`` in
``[lower_bound, 0]``; Kimi Linear's unbounded gate is ``g = -exp(A_log[h]) * softplus(f + dt_bias)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The spec's lower bound: with g >= -5 a 16-token chunk keeps its cumulative log-decay in
# (-80, 0], which is what lets the dense (bounded) intra-chunk path divide by the decay.
SAFE_LOWER_BOUND = -5.0


def a_log_heads(A_log: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A_log as a [H] vector: either exactly H elements (any shape, e.g. Kimi Linear's
    [1, 1, H, 1]) or the K3 checkpoint's zero-padded 1-D vector, of which the first H count."""
    if A_log.numel() == num_heads:
        return A_log.reshape(num_heads)
    if A_log.dim() == 1 and A_log.numel() > num_heads:
        return A_log[:num_heads]
    raise ValueError(f"`A_log` has shape {list(A_log.shape)}: expected {num_heads} elements "
                     f"or a zero-padded 1-D tensor longer than {num_heads}")


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float | None = SAFE_LOWER_BOUND, *,
             num_heads: int | None = None) -> torch.Tensor:
    """Per-channel log decay g from the raw decay logits.

    Args:
        f: raw decay logits ``[B, T, H, K]``, or ``[B, T, H*K]`` together with ``num_heads``.
        A_log: one scalar per head: ``H`` elements in any shape, or a zero-padded 1-D tensor
            longer than ``H`` (the K3 checkpoint pads it to 128); only the first ``H`` are used.
        dt_bias: ``[H*K]`` per-channel bias.
        lower_bound: K3's bounded gate ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))``,
            so ``g`` is in ``[lower_bound, 0]`` (closed once sigmoid rounds); ``None`` selects
            Kimi Linear's unbounded ``g = -exp(A_log[h]) * softplus(f + dt_bias)``.
        num_heads: ``H``; needed only for a 3-D ``f``, since a padded ``A_log`` cannot tell it.

    Returns:
        g: ``[B, T, H, K]`` fp32.

    Example::

        >>> f = torch.randn(1, 6, 2 * 8)
        >>> g = kda_gate(f, torch.zeros(128), torch.zeros(2 * 8), num_heads=2)
        >>> g.shape, bool((g >= -5).all() and (g <= 0).all())
        (torch.Size([1, 6, 2, 8]), True)
    """
    if f.dim() == 3:
        if num_heads is None or f.shape[-1] % num_heads:
            raise ValueError(f"`f` of shape {list(f.shape)} is [B, T, H*K]: pass num_heads dividing "
                             f"{f.shape[-1]}, got num_heads={num_heads}")
        f = f.unflatten(-1, (num_heads, -1))
    elif f.dim() != 4:
        raise ValueError(f"`f` must be [B, T, H, K] or [B, T, H*K], got {list(f.shape)}")
    H, K = f.shape[-2:]
    if dt_bias.numel() != H * K:
        raise ValueError(f"`dt_bias` has {dt_bias.numel()} elements, expected H*K = {H * K}")
    a_H1 = a_log_heads(A_log, H).float().exp()[:, None]      # [H, 1]
    x = f.float() + dt_bias.float().reshape(H, K)            # [B, T, H, K]
    if lower_bound is None:
        return -a_H1 * F.softplus(x)
    return lower_bound * torch.sigmoid(a_H1 * x)
