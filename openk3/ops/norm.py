"""RMSNorm and gated RMSNorm (K3_SPEC §1.1, §1.2).

``rms_norm(x, w, eps)``:        ``w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``
``gated_rms_norm(x, w, g, eps)``: ``rms_norm`` in fp32 times ``sigmoid(g)``, cast to x.dtype —
the KDA output norm (``o_norm``), whose gate is ``g_proj(x)`` for K3 and the low-rank
``g_b_proj(g_a_proj(x))`` for Kimi Linear.

Under autocast ``rms_norm`` returns the autocast dtype (unless ``out_dtype`` says otherwise):
training keeps fp32 weights, so ``w * y`` would promote every norm's output, the input of every
attention and MLP, to fp32, which each reading matmul casts back to bf16 and whose gradients come
back as bf16 to be cast up and summed in fp32. The one rounding of ``w * y`` moves into the
norm's kernel: the matmuls read the same bf16 values, and half the bytes (issue P7,
docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from openk3.ops.fast import compiled, use_fast_path


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [..., D]; weight: [D] or None (no affine weight). Returns x.dtype (promoted with the
    weight's), then cast to ``out_dtype`` if given (in the same kernel on the fast path)."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = y if weight is None else weight * y
    return y if out_dtype is None else y.to(out_dtype)


def gated_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """x, gate: [..., D]; weight: [D]. Norm, weight and gate all in fp32; returns x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y * torch.sigmoid(gate.float())).to(x.dtype)


_rms_norm_fast = compiled(rms_norm_ref)
_gated_rms_norm_fast = compiled(gated_rms_norm_ref)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if out_dtype is None and torch.is_autocast_enabled(x.device.type):
        out_dtype = torch.get_autocast_dtype(x.device.type)
    return (_rms_norm_fast if use_fast_path(x) else rms_norm_ref)(x, weight, eps, out_dtype)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    if x.shape != gate.shape:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)} and gate {tuple(gate.shape)} differ")
    return (_gated_rms_norm_fast if use_fast_path(x) else gated_rms_norm_ref)(x, weight, gate, eps)
