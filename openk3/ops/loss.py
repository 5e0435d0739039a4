"""Cross-entropy of a linear head (the LM loss) without materialising all logits.

    loss = sum_i [logsumexp(hidden_i @ weight.T) - (hidden_i @ weight.T)[targets_i]] / n

over the rows i whose target is not ``ignore_index``, n their number (at least 1, so a batch
with every target ignored gives 0, not NaN).

* ``linear_cross_entropy_ref``: plain PyTorch, the reference: the logits ``[N, V]`` in fp32,
  then ``F.cross_entropy``.
* ``linear_cross_entropy``: the entry point. On CUDA it runs fla-core's fused linear
  cross-entropy, which walks the rows in (at most 8) chunks of ``[C, V]`` logits, C the power of
  two at or above N/8, and computes the loss *and* the gradients of hidden and weight chunk by
  chunk, in the forward; its backward only scales the stored gradients by the incoming one. The
  full logits never exist (4.3 GB in fp32 at N = 16,384, V = 65,536), at the price of doing the
  two gradient matmuls even when no gradient is wanted.

Precision, the same on both paths: the logits are computed in the *compute dtype*, that of
autocast when it is on for the hidden state's device (as autocast would for ``F.linear``), else
``hidden.dtype``; both operands are cast to it (an fp32 master weight with a bf16 hidden state
becomes bf16). Log-softmax and loss are fp32; the logits' gradient is computed in fp32 and
rounded to the compute dtype for the two gradient matmuls. fla sums the weight gradient over
its chunks in the compute dtype (``accumulate_grad_in_fp32=False``): its fp32 option makes that
sum an fp32 matmul, which PyTorch runs without TF32, at 67 instead of 989 dense TFLOP/s on an
H200 (spec); in bf16 the chunk roundings double the weight gradient's rounding error (about
0.35% instead of 0.17% relative with 8 chunks, CPU emulation). ``benchmarks/loss_bench.py``
measures both.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from openk3.ops.fast import use_fast_path

IGNORE_INDEX = -100  # the target value that contributes nothing (torch's and transformers' default)


def _validate(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"`hidden` must be a floating [N, d] tensor, got {hidden.dtype} "
                         f"{list(hidden.shape)}")
    N, d = hidden.shape
    if N == 0:
        raise ValueError("`hidden` has no rows (N = 0)")
    if weight.dim() != 2 or weight.shape[1] != d or not weight.is_floating_point():
        raise ValueError(f"`weight` must be a floating [V, d] tensor with d = {d}, got "
                         f"{weight.dtype} {list(weight.shape)}")
    if targets.shape != (N,) or targets.dtype != torch.long:
        raise ValueError(f"`targets` must be an int64 [N] tensor with N = {N}, got "
                         f"{targets.dtype} {list(targets.shape)}")
    for name, t in (("weight", weight), ("targets", targets)):
        if t.device != hidden.device:
            raise ValueError(f"`{name}` is on {t.device}, hidden on {hidden.device}")


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` would compute in here: autocast's, or hidden's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _loss_torch(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()                                    # [N, V]
    total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    # sum / count rather than reduction="mean", which is NaN when every target is ignored
    return total / targets.ne(ignore_index).sum().clamp_min(1)


@functools.cache
def fla_linear_cross_entropy():
    """fla-core's ``fused_linear_cross_entropy_loss``, or None without fla-core and triton."""
    try:
        from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss
    except ImportError:
        return None
    return fused_linear_cross_entropy_loss


def _loss_fla(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
              ignore_index: int) -> torch.Tensor:
    return fla_linear_cross_entropy()(hidden, targets, weight, ignore_index=ignore_index,
                                      accumulate_grad_in_fp32=False)


def auto_backend(hidden: torch.Tensor) -> str:
    """The backend ``backend="auto"`` takes for ``hidden``: ``"fla"`` for CUDA inputs when
    fla-core imports (unless ``OPENK3_REFERENCE=1``), else ``"torch"``."""
    return "fla" if use_fast_path(hidden) and fla_linear_cross_entropy() is not None else "torch"


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, *,
                         backend: str = "auto") -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` against ``targets``, fp32 scalar.

    Args:
        hidden: ``[N, d]``, e.g. the final hidden states ``[B*T, d]``.
        weight: ``[V, d]``, the LM head (``lm_head.weight``, the embedding when tied).
        targets: ``[N]`` int64 class indices in ``[0, V)``, or ``ignore_index`` for rows that
            do not count. (The fla path does not check the range: that would cost a host sync.)
        ignore_index: the target value to skip; the mean is over the other rows (0 if none).
        backend: ``"fla"`` runs fla-core's fused kernel, ``"torch"`` the reference, ``"auto"``
            the one ``auto_backend(hidden)`` names.

    Returns:
        The loss, a 0-dim fp32 tensor. Gradients reach hidden and weight in their own dtypes.
        The fla path's backward scales gradients it stored in the forward, in place: backward
        through it once (no ``retain_graph`` second pass).

    Example::

        >>> hidden, weight = torch.randn(6, 4), torch.randn(10, 4)
        >>> targets = torch.tensor([3, 1, -100, 9, 0, -100])
        >>> loss = linear_cross_entropy(hidden, weight, targets)
        >>> kept = targets != -100
        >>> torch.allclose(loss, F.cross_entropy(hidden[kept] @ weight.T, targets[kept]))
        True
    """
    if backend not in ("auto", "torch", "fla"):
        raise ValueError(f"`backend` must be 'auto', 'torch' or 'fla', got {backend!r}")
    _validate(hidden, weight, targets)
    if backend == "auto":
        backend = auto_backend(hidden)
    if backend == "fla":
        if not hidden.is_cuda:
            raise ValueError(f"backend='fla' needs CUDA tensors, got hidden on {hidden.device}")
        if fla_linear_cross_entropy() is None:
            raise ValueError("backend='fla' needs fla-core and triton: pip install 'openk3[gpu]'")
    dtype = _compute_dtype(hidden)
    # the casts autocast would make, done explicitly so that both paths see the same operands
    with torch.autocast(hidden.device.type, enabled=False):
        loss_fn = _loss_fla if backend == "fla" else _loss_torch
        return loss_fn(hidden.to(dtype), weight.to(dtype), targets, ignore_index)


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``linear_cross_entropy`` in plain PyTorch, materialising the fp32 logits ``[N, V]``.

    Example::

        >>> hidden, weight, targets = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 4, 2])
        >>> linear_cross_entropy_ref(hidden, weight, targets).dtype
        torch.float32
    """
    return linear_cross_entropy(hidden, weight, targets, ignore_index, backend="torch")
