"""A latent MoE layer's output for a few tokens (K3_SPEC §1.4-1.5): the shared experts' down
projection and the routed experts' norm and up projection, added to the residual.

    h   = act(gate, up)                                  [N, F]  SiTU-GLU or SwiGLU (``glu_act``)
    y   = rms_norm(u, norm_weight, eps) in gate's dtype  [N, L]  u: the routed experts' fp32 sum
    out = residual + h W_sd^T + y W_up^T                 [N, d]

``W_sd`` [d, F] is the shared experts' ``down_proj.weight``, ``W_up`` [d, L] the layer's
``routed_expert_up_proj.weight``. At inference ``MoE.forward`` runs this as four kernels (the
GLU, a GEMM adding into the residual, the norm, a second GEMM adding into it); a decode step of
a few tokens pays each one's launch (~4 us on the H200) rather than its bytes (0.49 us for all
of `small`'s: ``openk3.ops.moe_output_triton``).

* ``moe_output_ref``: plain PyTorch, the unfused inference path's ops and roundings.
* ``moe_output``: the entry point; one Triton kernel (``moe_output_triton``) for a few bf16
  tokens on CUDA without autograd (``use_moe_output``), else the reference.

Example::

    >>> N, d, F, L = 2, 16, 24, 8
    >>> gate, up, residual = torch.randn(N, F), torch.randn(N, F), torch.randn(N, d)
    >>> u = torch.randn(N, L)
    >>> out = moe_output(residual, gate, up, u, torch.randn(d, F), torch.ones(L), torch.randn(d, L),
    ...                  norm_eps=1e-5, hidden_act="situ", situ_beta1=4.0, situ_beta2=25.0)
    >>> out.shape, out.dtype
    (torch.Size([2, 16]), torch.float32)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.fast import compile_disabled, needs_grad, use_fast_path
from openk3.ops.moe import triton_available
from openk3.ops.norm import rms_norm_ref
from openk3.ops.situ import situ_glu_ref, swiglu_ref

# The most tokens that take the kernel: each token's programs read every weight row again (from
# L2 after the first token), where the GEMMs read them once. A first guess, to be measured with
# benchmarks/moe_output_bench.py on the device (the fused kernel against the four unfused ones).
MOE_OUTPUT_MAX_TOKENS = 8
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def use_moe_output(x: torch.Tensor, shared_down_proj: torch.Tensor, routed_up_proj: torch.Tensor) -> bool:
    """Whether ``moe_output`` takes the Triton kernel for the tokens ``x`` [N, d] (the layer's
    input, whose dtype its activations share) and the layer's two weights: at most
    ``MOE_OUTPUT_MAX_TOKENS`` bf16 tokens and bf16 weights on CUDA, none needing gradients.
    ``MoE.forward`` asks before it runs the routed experts; the call itself checks the rest
    (an fp32 latent sum, unit column strides: ``_triton_takes``) and takes the reference where
    they do not fit."""
    return (x.shape[0] <= MOE_OUTPUT_MAX_TOKENS and use_fast_path(x) and x.dtype == torch.bfloat16
            and shared_down_proj.dtype == routed_up_proj.dtype == torch.bfloat16
            and not needs_grad(x, shared_down_proj, routed_up_proj) and triton_available())


def moe_output_ref(residual: torch.Tensor | None, gate: torch.Tensor, up: torch.Tensor,
                   u: torch.Tensor, shared_down_proj: torch.Tensor, norm_weight: torch.Tensor,
                   routed_up_proj: torch.Tensor, *, norm_eps: float, hidden_act: str,
                   situ_beta1: float, situ_beta2: float) -> torch.Tensor:
    """``moe_output`` in plain PyTorch, as ``MoE.forward`` computes it at inference (fused
    projections, no autograd): the activation and the norm in gate's dtype, then one GEMM per
    weight, each adding into the running sum in its epilogue (``add_linear_``'s ``addmm``: the
    sum is rounded once per GEMM, twice in all). Out of place; arguments as ``moe_output``'s."""
    if hidden_act == "situ":
        h = situ_glu_ref(gate, up, situ_beta1, situ_beta2)
    else:
        h = swiglu_ref(gate, up)
    y = rms_norm_ref(u, norm_weight, norm_eps, out_dtype=gate.dtype)
    out = F.linear(h, shared_down_proj) if residual is None else torch.addmm(residual, h, shared_down_proj.t())
    return torch.addmm(out, y, routed_up_proj.t())


def _validate(residual, gate, up, u, shared_down_proj, norm_weight, routed_up_proj, hidden_act) -> None:
    if gate.dim() != 2:
        raise ValueError(f"moe_output: `gate` must be [N, F], got {list(gate.shape)}")
    N, width = gate.shape
    if up.shape != gate.shape:
        raise ValueError(f"moe_output: `up` must be [N, F] = {[N, width]} as gate, got {list(up.shape)}")
    if shared_down_proj.dim() != 2 or shared_down_proj.shape[1] != width:
        raise ValueError(f"moe_output: `shared_down_proj` must be [d, F] with F = {width}, got "
                         f"{list(shared_down_proj.shape)}")
    d = shared_down_proj.shape[0]
    if u.dim() != 2 or u.shape[0] != N:
        raise ValueError(f"moe_output: `u` must be [N, L] with N = {N}, got {list(u.shape)}")
    L = u.shape[1]
    if routed_up_proj.shape != (d, L):
        raise ValueError(f"moe_output: `routed_up_proj` must be [d, L] = {[d, L]}, got "
                         f"{list(routed_up_proj.shape)}")
    if norm_weight.shape != (L,):
        raise ValueError(f"moe_output: `norm_weight` must be [L] = {[L]}, got {list(norm_weight.shape)}")
    if residual is not None and residual.shape != (N, d):
        raise ValueError(f"moe_output: `residual` must be [N, d] = {[N, d]} or None, got "
                         f"{list(residual.shape)}")
    named = {"gate": gate, "up": up, "u": u, "shared_down_proj": shared_down_proj,
             "norm_weight": norm_weight, "routed_up_proj": routed_up_proj, "residual": residual}
    for name, t in named.items():
        if t is None:
            continue
        if not t.is_floating_point():
            raise ValueError(f"moe_output: `{name}` must be a float tensor, got {t.dtype}")
        if t.device != gate.device:
            raise ValueError(f"moe_output: `{name}` is on {t.device}, gate on {gate.device}")
        if name in ("up", "shared_down_proj", "routed_up_proj", "residual") and t.dtype != gate.dtype:
            raise ValueError(f"moe_output: `{name}` must be {gate.dtype} as gate (the GEMMs' operands "
                             f"and the sum share one dtype), got {t.dtype}")
    if hidden_act not in ("situ", "silu"):
        raise ValueError(f"moe_output: `hidden_act` must be 'situ' or 'silu', got {hidden_act!r}")


def _triton_takes(residual, gate, up, u, shared_down_proj, norm_weight, routed_up_proj) -> str | None:
    """Why the kernel cannot take these (validated) arguments, or None: it reads rows of unit
    column stride, an fp32 u and a contiguous norm weight, and has no backward."""
    if needs_grad(residual, gate, up, u, shared_down_proj, norm_weight, routed_up_proj):
        return "inputs that need no gradients (it has no backward: call it under torch.no_grad())"
    if gate.dtype not in _TRITON_DTYPES:
        return f"`gate` in {_TRITON_DTYPES}, got {gate.dtype}"
    if u.dtype != torch.float32:
        return f"`u` in fp32 (the routed experts' sum), got {u.dtype}"
    for name, t in (("residual", residual), ("gate", gate), ("up", up), ("u", u),
                    ("shared_down_proj", shared_down_proj), ("routed_up_proj", routed_up_proj),
                    ("norm_weight", norm_weight)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            return f"`{name}` with unit column stride, got strides {t.stride()}"
    return None


@compile_disabled("a Triton kernel launched as it is")
def _moe_output_triton(*args, **kwargs) -> torch.Tensor:
    from openk3.ops.moe_output_triton import moe_output_triton

    return moe_output_triton(*args, **kwargs)


def moe_output(residual: torch.Tensor | None, gate: torch.Tensor, up: torch.Tensor, u: torch.Tensor,
               shared_down_proj: torch.Tensor, norm_weight: torch.Tensor, routed_up_proj: torch.Tensor,
               *, norm_eps: float, hidden_act: str, situ_beta1: float, situ_beta2: float,
               backend: str = "auto") -> torch.Tensor:
    """A latent MoE layer's output: ``residual + W_sd act(gate, up) + W_up rmsnorm(u)``.

    Args:
        residual: ``[N, d]`` the caller's own tensor, accumulated into in place on the Triton
            path (as ``openk3.model.fuse.add_linear_``: its old value may be lost; use the
            result), or None (no residual).
        gate, up: ``[N, F]`` the shared experts' input projections (column views of the fused
            projection's output are fine).
        u: ``[N, L]`` the routed experts' weighted sum (fp32 from ``RoutedExperts``).
        shared_down_proj: ``[d, F]`` the shared experts' ``down_proj.weight``.
        norm_weight: ``[L]`` ``routed_expert_norm.weight``; ``norm_eps`` its epsilon.
        routed_up_proj: ``[d, L]`` ``routed_expert_up_proj.weight``.
        hidden_act: ``"situ"`` (SiTU-GLU with ``situ_beta1``, ``situ_beta2``) or ``"silu"``
            (SwiGLU; the betas are unused).
        backend: ``"triton"`` the kernel (CUDA), ``"torch"`` the reference, ``"auto"`` the kernel
            where ``use_moe_output`` allows it and the arguments fit it, else the reference.

    Returns:
        ``[N, d]`` in gate's dtype (residual, gate, up and both weights share it). The kernel
        rounds the sum once; the reference, as the unfused path, rounds after each GEMM: they
        differ in the last bit of some outputs (the GEMMs' inputs, the activation and the
        normalised latent in gate's dtype, are the same, up to fp32 rounding inside them).

    No autograd on the Triton path: ``backend="triton"`` refuses inputs that need gradients.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"moe_output: `backend` must be 'auto', 'torch' or 'triton', got {backend!r}")
    _validate(residual, gate, up, u, shared_down_proj, norm_weight, routed_up_proj, hidden_act)
    args = (residual, gate, up, u, shared_down_proj, norm_weight, routed_up_proj)
    kwargs = dict(norm_eps=norm_eps, hidden_act=hidden_act, situ_beta1=situ_beta1, situ_beta2=situ_beta2)
    if backend == "triton":
        if not gate.is_cuda:
            raise ValueError(f"moe_output: backend='triton' needs CUDA tensors, got gate on {gate.device}")
        unfit = _triton_takes(*args)
        if unfit is not None:
            raise ValueError(f"moe_output: backend='triton' needs {unfit}")
        if not triton_available():
            raise ValueError("moe_output: backend='triton' needs triton (CUDA builds of torch install it)")
    elif backend == "auto":
        fits = use_moe_output(gate, shared_down_proj, routed_up_proj) and _triton_takes(*args) is None
        backend = "triton" if fits else "torch"
    if backend == "torch":
        return moe_output_ref(*args, **kwargs)
    return _moe_output_triton(*args, **kwargs)
