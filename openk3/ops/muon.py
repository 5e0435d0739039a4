"""Muon's elementwise passes over one head block (``openk3.train.optim.Muon._update_in_place``).

A block is a ``[n, r, c]`` view of a parameter (its gradient, momentum and weight alike: a
head's rows, a head's columns, experts), any strides. Two passes per block and step:

* ``momentum_``: ``m <- mu * m + g`` in place, and ``out = g + mu * m`` (Nesterov) or ``m``,
  written in ``out``'s dtype (Newton-Schulz's bf16 input on CUDA, a slice of the stacked batch);
  with ``grad_scale`` (gradient clipping's 0-dim coefficient) g is ``g * grad_scale`` first, as
  the clipping's own pass would have left it.
* ``apply_update_``: ``w <- w * (1 - lr * wd) + (-lr * scale) * x``: weight decay and the
  orthogonalised update ``x`` in one pass; ``lr`` a float or a 0-dim tensor (the CUDA graphs
  read it on the device).

And for Newton-Schulz (``openk3.train.optim.zeropower_via_newtonschulz``), ``scale_matrices_``:
each matrix of a contiguous batch times its own factor, in place.

The reference is plain PyTorch (a few ops a pass, each reading and writing its operands); on
CUDA one Triton kernel a pass reads and writes each operand once (``muon_triton.py``): about
24 bytes an element a step instead of 48 (fp32 gradient, momentum and weight, bf16 update).
"""

from __future__ import annotations

import torch

from openk3.ops.fast import importable, use_fast_path


def _check(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.shape != like.shape or t.device != like.device:
        raise ValueError(f"Muon's `{name}` must match the block {list(like.shape)} on {like.device}, "
                         f"got {list(t.shape)} on {t.device}")


def momentum_ref(g: torch.Tensor, m: torch.Tensor, out: torch.Tensor, mu: float, nesterov: bool,
                 grad_scale: torch.Tensor | None = None) -> None:
    if grad_scale is not None:
        g = g * grad_scale
    m.mul_(mu).add_(g)
    if nesterov:
        torch.add(g, m, alpha=mu, out=out)
    else:
        out.copy_(m)


def apply_update_ref(w: torch.Tensor, x: torch.Tensor, lr: float | torch.Tensor, wd: float,
                     scale: float) -> None:
    if wd:
        w.mul_(1 - lr * wd)
    if isinstance(lr, torch.Tensor):
        w.addcmul_(x, -lr * scale)
    else:
        w.add_(x, alpha=-lr * scale)


def _kernels(t: torch.Tensor) -> bool:
    return use_fast_path(t) and t.dim() == 3 and importable("triton")


def momentum_(g: torch.Tensor, m: torch.Tensor, out: torch.Tensor, mu: float, nesterov: bool,
              grad_scale: torch.Tensor | None = None) -> None:
    """``m <- mu * m + g``; ``out <- g + mu * m`` (``nesterov``) or ``m``. g, m: blocks
    ``[n, r, c]`` (fp32 in training), any strides; out: the same shape, any float dtype. The
    kernel computes in fp32 and rounds to each tensor's dtype on store."""
    _check("momentum", m, g)
    _check("out", out, g)
    if grad_scale is not None and (grad_scale.dim() != 0 or grad_scale.device != g.device):
        raise ValueError(f"Muon's grad_scale must be 0-dim on {g.device}, got {list(grad_scale.shape)} "
                         f"on {grad_scale.device}")
    if not _kernels(g):
        return momentum_ref(g, m, out, mu, nesterov, grad_scale)
    from openk3.ops.muon_triton import launch_momentum

    launch_momentum(g, m, out, float(mu), bool(nesterov), grad_scale)


def apply_update_(w: torch.Tensor, x: torch.Tensor, lr: float | torch.Tensor, wd: float, scale: float) -> None:
    """``w <- w * (1 - lr * wd) + (-lr * scale) * x`` in place. w: a block ``[n, r, c]`` of the
    weight, any strides; x: the update, same shape; lr: a float or a 0-dim tensor on w's device."""
    _check("x", x, w)
    if isinstance(lr, torch.Tensor) and (lr.dim() != 0 or lr.device != w.device):
        raise ValueError(f"Muon's lr tensor must be 0-dim on {w.device}, got {list(lr.shape)} on {lr.device}")
    if not _kernels(w):
        return apply_update_ref(w, x, lr, wd, scale)
    from openk3.ops.muon_triton import launch_apply_update

    launch_apply_update(w, x, lr, float(wd), float(scale))


def scale_matrices_(t: torch.Tensor, s: torch.Tensor) -> None:
    """``t[n] *= s[n]`` in place for a contiguous batch t ``[N, r, c]`` and s ``[N]`` (any float
    dtypes; products in fp32 on CUDA, rounded to t's dtype)."""
    if t.dim() != 3 or s.shape != (t.shape[0],) or not t.is_contiguous():
        raise ValueError(f"scale_matrices_: t must be a contiguous [N, r, c] and s [N], got "
                         f"{list(t.shape)} (contiguous: {t.is_contiguous()}) and {list(s.shape)}")
    if not _kernels(t):
        t.mul_(s[:, None, None])
        return
    from openk3.ops.muon_triton import launch_scale

    launch_scale(t, s.contiguous())
