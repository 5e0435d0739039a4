"""The MoE router's choice (K3_SPEC §1.4): sigmoid scores, top-k on the biased scores, weights
from the unbiased ones.

    s = sigmoid(logits)                      fp32 [N, E]
    topk_idx = topk(s + bias, k)             the balancing bias only picks the experts
    w = s[topk_idx] / (sum + 1e-20)          with ``renormalize``; then times ``scale``

* ``router_topk_ref``: plain PyTorch (differentiable: training's router).
* ``router_topk``: the entry point; without autograd on CUDA one Triton kernel per call
  (``router_triton.py``) instead of six (a decode step pays them in every MoE layer).
"""

from __future__ import annotations

import torch

from openk3.ops.fast import needs_grad, use_fast_path
from openk3.ops.moe import triton_available

RENORM_EPS = 1e-20


def router_topk_ref(logits: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool = True,
                    scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``router_topk`` in plain PyTorch; arguments and results as its."""
    scores = torch.sigmoid(logits.float())
    topk_idx = (scores + bias).topk(k, dim=-1).indices
    weight = scores.gather(1, topk_idx)
    if renormalize:
        weight = weight / (weight.sum(-1, keepdim=True) + RENORM_EPS)
    if scale != 1.0:  # K3's is 1: one kernel less per layer and step
        weight = weight * scale
    return scores, topk_idx, weight


def router_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool = True,
                scale: float = 1.0, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights.

    Args:
        logits: ``[N, E]`` router logits (fp32 for K3's router; any float dtype).
        bias: ``[E]`` fp32 balancing bias (``e_score_correction_bias``), or ``[N, E]`` per token
            (group-limited routing masks the dropped groups with -inf; the reference runs it).
        k: experts per token, ``1 <= k <= E``.
        renormalize: divide the chosen scores by their sum (+ 1e-20).
        scale: ``routed_scaling_factor``.
        backend: ``"triton"`` (CUDA), ``"torch"`` the reference, ``"auto"``: Triton for CUDA
            inputs that need no gradient (unless ``OPENK3_REFERENCE=1``).

    Returns:
        scores ``[N, E]`` fp32, topk_idx ``[N, k]`` int64 (largest biased score first; the
        kernel takes the first index among equal values, ``torch.topk`` any), weights ``[N, k]``
        fp32.

    Example::

        >>> logits, bias = torch.tensor([[0.0, 2.0, -1.0, 1.0]]), torch.tensor([0.0, 0.0, 5.0, 0.0])
        >>> scores, idx, w = router_topk(logits, bias, k=2)
        >>> idx.tolist(), round(w.sum().item(), 6)
        ([[2, 1]], 1.0)
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"`backend` must be 'auto', 'torch' or 'triton', got {backend!r}")
    if logits.dim() != 2 or bias.shape not in (logits.shape[1:], logits.shape):
        raise ValueError(f"router_topk: `logits` must be [N, E] and `bias` [E] or [N, E], got "
                         f"{list(logits.shape)} and {list(bias.shape)}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"router_topk: k = {k} must be in 1..E = 1..{logits.shape[1]}")
    if backend == "auto":
        backend = ("triton" if use_fast_path(logits) and triton_available() and bias.dim() == 1
                   and not needs_grad(logits, bias) else "torch")
    if backend == "torch":
        return router_topk_ref(logits, bias, k, renormalize, scale)
    if needs_grad(logits, bias) or bias.dim() != 1:
        raise ValueError("router_topk: the Triton kernel takes one bias [E] and has no backward "
                         "(use backend='torch')")
    return _router_topk_triton(logits, bias, k, renormalize, scale)


@torch.compiler.disable(reason="a Triton kernel launched as it is")
def _router_topk_triton(logits, bias, k, renormalize, scale):
    import triton

    from openk3.ops.router_triton import router_topk_kernel

    N, E = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    scores = torch.empty(N, E, device=logits.device, dtype=torch.float32)
    idx = torch.empty(N, k, device=logits.device, dtype=torch.int64)
    weight = torch.empty(N, k, device=logits.device, dtype=torch.float32)
    if N:
        router_topk_kernel[(N,)](logits, bias.contiguous(), scores, idx, weight, E, logits.stride(0),
                                 RENORM_EPS, float(scale), K=k, BLOCK_E=triton.next_power_of_2(E),
                                 BLOCK_K=triton.next_power_of_2(k),
                                 RENORMALIZE=renormalize)
    return scores, idx, weight
