"""Inference-time fusion of projections that read the same input (issue P8).

A decode step of one token is bound by kernel count, not bytes: every ``nn.Linear`` is its own
GEMM although several read the same input. ``fuse_projections(model)`` concatenates, per layer,
the weights of such a group into one tensor and makes each module's weight a view of its rows:

* KDA: ``q_proj | k_proj | v_proj | g_proj`` (Kimi Linear: ``g_a_proj``) ``| f_a_proj | b_proj``,
  and the short convolutions ``q_conv1d | k_conv1d | v_conv1d`` (one depthwise conv call);
* MLA: ``q_a_proj`` (or ``q_proj``) ``| kv_a_proj_with_mqa`` (``| g_proj`` for K3);
* dense MLP and shared experts: ``gate_proj | up_proj``; a latent MoE (K3) also puts the routed
  experts' ``routed_expert_down_proj`` in front of its shared experts' two.

The Parameters stay the same objects with the same names and shapes, so ``state_dict``,
``save_pretrained`` and ``load_state_dict`` (which copies into the views, hence into the fused
tensor) see no difference, and no weight is stored twice. The fused tensor is a plain attribute
of the layer (``fused_proj``, ``fused_conv``), not a buffer: checkpoints never see it.

Fusion is for inference only. One fused tensor cannot give each Parameter its own ``.grad``
(and FSDP re-allocates parameter storage), so training keeps the separate projections:
``fuse_projections`` refuses trainable parameters, and a fused layer whose weights are made
trainable again runs its separate projections (``is_fused``). Call it after the model's last
``.to()``: moving the model copies each weight separately (the same function, but the layer keeps
its fused tensor on the old device and dtype); fusing again then re-shares the memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from openk3.ops.fast import needs_grad
from openk3.ops.gemv import linear, linear_add_, norm_linear
from openk3.ops.norm import rms_norm


def _views_of(fused: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether ``weights`` are, in order, the row blocks of ``fused``."""
    if fused.shape[0] != sum(w.shape[0] for w in weights):
        return False
    rows = fused.split([w.shape[0] for w in weights])
    return all(w.data_ptr() == r.data_ptr() and w.shape == r.shape for w, r in zip(weights, rows))


def fuse_weights(modules: Sequence[nn.Module], fused: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the ``weight`` of ``modules`` along dim 0 (``[out_i, ...]`` ->
    ``[sum out_i, ...]``) and make each module's weight a view of its rows.

    ``fused``: what a previous call returned for the same modules; it is returned unchanged while
    the weights still view it (fusing twice is a no-op)."""
    weights = [m.weight for m in modules]
    if fused is not None and _views_of(fused, weights):
        return fused
    first = weights[0]
    for m, w in zip(modules, weights):
        if (w.shape[1:], w.dtype, w.device) != (first.shape[1:], first.dtype, first.device):
            raise ValueError(f"fuse_weights: the weight of {m} is {list(w.shape)} {w.dtype} on "
                             f"{w.device}; the first module's is {list(first.shape)} "
                             f"{first.dtype} on {first.device} (all but dim 0 must match)")
    fused = torch.cat([w.detach() for w in weights])
    for w, rows in zip(weights, fused.split([w.shape[0] for w in weights])):
        w.data = rows  # the same Parameter object, now a view: names, shapes, references kept
    return fused


def is_fused(fused: torch.Tensor | None, modules: Sequence[nn.Module]) -> bool:
    """Whether a layer runs ``modules`` through ``fused``: fused, and none of their weights is
    trainable (gradients need the separate projections, see the module docstring)."""
    return fused is not None and not any(m.weight.requires_grad for m in modules)


def project(x: torch.Tensor, modules: Sequence[nn.Linear],
            fused: torch.Tensor | None) -> list[torch.Tensor]:
    """``[m(x) for m in modules]``, as one GEMM when ``is_fused(fused, modules)`` (a GEMV for a
    few rows: ``openk3.ops.gemv.linear``).

    x: ``[..., d]``; returns ``[..., out_i]`` per module (column views of one output when fused).
    """
    if not is_fused(fused, modules):
        return [m(x) for m in modules]
    return list(linear(x, fused).split([m.out_features for m in modules], dim=-1))


def add_linear_(out: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``out + linear(x)``, accumulated into ``out`` in place where it can be: one GEMM that adds
    in its epilogue (``addmm_``, or the GEMV's for a few rows: ``openk3.ops.gemv.linear_add_``;
    the sum is rounded once) instead of a GEMM and an add kernel.
    Used for the residual stream and the MoE's two outputs at inference (a decode step pays an
    add kernel per layer otherwise).

    ``out`` must be the caller's own tensor of ``linear(x)``'s shape: its old value may be lost.
    Out of place (``out + linear(x)``, ``out`` untouched) where autograd would record the ops,
    under autocast, or when dtypes, shape or layout do not allow ``addmm_``. Use the result."""
    if not _adds_in_place(out, x, x.dtype, linear):
        return out + linear(x)
    return linear_add_(out, x, linear.weight)


def add_normed_linear_(out: torch.Tensor, x: torch.Tensor, norm: nn.Module, linear: nn.Linear,
                       dtype: torch.dtype) -> torch.Tensor:
    """``add_linear_(out, rms_norm(x, norm.weight, norm.eps, out_dtype=dtype), linear)``: the
    latent MoE's output. Where ``add_linear_`` adds in place, one call of
    ``openk3.ops.gemv.norm_linear``: for a few rows one GEMV kernel whose prologue is the norm."""
    if not _adds_in_place(out, x, dtype, linear):
        return out + linear(rms_norm(x, norm.weight, norm.eps, out_dtype=dtype))
    return norm_linear(x, linear.weight, norm.weight, norm.eps, out=out)


def _adds_in_place(out: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, linear: nn.Linear) -> bool:
    """``add_linear_``'s condition for ``addmm_`` into ``out`` (x's values in ``dtype``)."""
    w = linear.weight
    return not (needs_grad(out, x, w) or torch.is_autocast_enabled(x.device.type) or linear.bias is not None
                or not out.dtype == dtype == w.dtype or not out.is_contiguous()
                or out.shape != (*x.shape[:-1], w.shape[0]))


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse, in every layer of ``model``, the projections that read the same input (see the
    module docstring); returns ``model``. Numerically the same function (up to GEMM summation
    order). Needs ``requires_grad=False`` parameters; calling it again is a no-op.

    Example::

        >>> from openk3 import build_model, preset
        >>> model = build_model(preset("debug")).eval().requires_grad_(False)
        >>> attn = fuse_projections(model).model.layers[0].self_attn
        >>> attn.fused_proj.shape, attn.q_proj.weight.data_ptr() == attn.fused_proj.data_ptr()
        (torch.Size([290, 128]), True)
    """
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if trainable:
        raise ValueError(f"fuse_projections: {len(trainable)} parameters require grad (first: "
                         f"{trainable[0]}); fusion is for inference: call "
                         "model.requires_grad_(False) first")
    for module in model.modules():
        if hasattr(module, "fuse"):  # KDAttention, MLAttention, MoE (before its MLP), MLP
            module.fuse()
    return model
