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

On CUDA, outside a compiled region, ``rms_norm`` runs openk3's Triton kernels
(``openk3.ops.norm_triton``): a forward with the reference's roundings that keeps each row's
rstd, and a backward, the derivative of the unrounded norm (as inductor's fusion of the
reference computes it), that writes dx and per-program shares of the weight's gradient in one
pass. Inside a compiled region the reference is traced, for the region's graph to fuse it with
its neighbours.
Training runs 72 such norms a step for `small` outside the compiled regions; inductor's kernels
for them (forward, two reductions in the backward and a cast) took ~147 us each at `small`'s
shape against a floor of ~39 us (docs/benchmarks.md, sixteenth session).
"""

from __future__ import annotations

import os

import torch

from openk3.ops.fast import compile_disabled, compiled, importable, launch_device, use_fast_path

# BLOCK_M x BLOCK_D per tile (rows per program by the row's padded width) and the backward's
# programs per SM, from ``benchmarks/norm_speed.py`` on one H200 (docs/benchmarks.md)
FWD_ELEMENTS, BWD_ELEMENTS = 4096, 2048
BWD_PROGRAMS_PER_SM = 4
MAX_TRITON_WIDTH = 16384  # a whole row in one tile; wider rows take the compiled reference
_NORM_TRITON = "openk3.ops.norm_triton"


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


def _warps(elements: int) -> int:
    return 8 if elements >= 4096 else 4


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _product_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype)


def _round_product(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``w * xhat`` is rounded before the cast to y: when both are 16-bit floats."""
    return _product_dtype(x, weight) in (torch.float16, torch.bfloat16)


def _rms_norm_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype):
    """Forward over x [N, D] (contiguous): (y [N, D] in out_dtype, rstd [N] fp32)."""
    import triton

    from openk3.ops.norm_triton import rms_norm_fwd_kernel

    N, D = x.shape
    block_d = triton.next_power_of_2(D)
    block_m = max(1, FWD_ELEMENTS // block_d)
    y = torch.empty(N, D, device=x.device, dtype=out_dtype)
    rstd = torch.empty(N, device=x.device, dtype=torch.float32)
    if N:
        with launch_device(x):
            rms_norm_fwd_kernel[(triton.cdiv(N, block_m),)](
                x, weight, y, rstd, N, D, eps, ROUND_PRODUCT=_round_product(x, weight),
                BLOCK_M=block_m, BLOCK_D=block_d, num_warps=_warps(block_m * block_d))
    return y, rstd


def _rms_norm_bwd_launch(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor):
    """Backward over x, dy [N, D] (contiguous): (dx in x's dtype, dweight in the weight's)."""
    import triton

    from openk3.ops.norm_triton import column_sum_kernel, rms_norm_bwd_kernel

    N, D = x.shape
    block_d = triton.next_power_of_2(D)
    block_m = max(1, BWD_ELEMENTS // block_d)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2
    programs = max(1, min(triton.cdiv(N, block_m), BWD_PROGRAMS_PER_SM * sms))
    dx = torch.empty_like(x)
    partial = (torch.empty if N else torch.zeros)(programs, D, device=x.device, dtype=torch.float32)
    dw = torch.empty(D, device=x.device, dtype=weight.dtype)
    with launch_device(x):
        if N:
            rms_norm_bwd_kernel[(programs,)](x, weight, rstd, dy, dx, partial, N, D, BLOCK_M=block_m,
                                             BLOCK_D=block_d, num_warps=_warps(block_m * block_d))
        # 32 columns a program: 32 programs for D = 1024 (256 columns made 4: 31.6 us in the step)
        column_sum_kernel[(triton.cdiv(D, 32),)](partial, dw, programs, D, BLOCK_R=128, BLOCK_C=32)
    return dx, dw


class _RMSNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        w = weight if weight.is_contiguous() else weight.contiguous()
        y, rstd = _rms_norm_launch(x2, w, eps, out_dtype)
        ctx.save_for_backward(x2, w, rstd)
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x2, w, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape)
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        dx, dw = _rms_norm_bwd_launch(x2, w, rstd, dy2)
        return (dx.view(dy.shape) if ctx.needs_input_grad[0] else None,
                dw if ctx.needs_input_grad[1] else None, None, None)


@compile_disabled("openk3's Triton RMSNorm kernels run as they are")
def _rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    return _RMSNormTriton.apply(x, weight, eps, out_dtype)


def _triton_shapes(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """What the Triton kernels take: a weight [D] of x's width D <= MAX_TRITON_WIDTH, x and the
    weight fp16, bf16 or fp32 (they compute in fp32: fp64 stays on the reference)."""
    return (weight is not None and weight.dim() == 1 and x.dim() >= 1 and weight.shape[0] == x.shape[-1]
            and 0 < x.shape[-1] <= MAX_TRITON_WIDTH and x.dtype in _TRITON_DTYPES
            and weight.dtype in _TRITON_DTYPES)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             out_dtype: torch.dtype | None = None, *, backend: str = "auto") -> torch.Tensor:
    """``rms_norm_ref``'s values; ``backend``: ``"triton"`` openk3's kernels (CUDA, or Triton's
    interpreter), ``"torch"`` the reference (compiled on CUDA), ``"auto"`` the kernels on the
    fast path where they apply (``_triton_shapes``) and dynamo is not tracing."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"rms_norm: `backend` must be 'auto', 'torch' or 'triton', got {backend!r}")
    if out_dtype is None and torch.is_autocast_enabled(x.device.type):
        out_dtype = torch.get_autocast_dtype(x.device.type)
    if backend == "triton":
        if not _triton_shapes(x, weight):
            raise ValueError(f"rms_norm: backend='triton' needs a weight [D] of x's width (x {tuple(x.shape)}, "
                             f"weight {None if weight is None else tuple(weight.shape)}), D <= "
                             f"{MAX_TRITON_WIDTH}, x and weight fp16, bf16 or fp32 (got {x.dtype} and "
                             f"{None if weight is None else weight.dtype})")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"rms_norm: backend='triton' needs CUDA tensors, got x on {x.device}")
        if not importable(_NORM_TRITON):
            raise ValueError("rms_norm: backend='triton' needs triton: pip install 'openk3[gpu]'")
    elif backend == "auto":  # not while dynamo traces: the reference fuses with its neighbours there
        backend = ("triton" if use_fast_path(x) and _triton_shapes(x, weight) and not torch.compiler.is_compiling()
                   and importable(_NORM_TRITON) else "torch")
    if backend == "triton":
        return _rms_norm_triton(x, weight, eps, out_dtype or _product_dtype(x, weight))
    return (_rms_norm_fast if use_fast_path(x) else rms_norm_ref)(x, weight, eps, out_dtype)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    if x.shape != gate.shape:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)} and gate {tuple(gate.shape)} differ")
    return (_gated_rms_norm_fast if use_fast_path(x) else gated_rms_norm_ref)(x, weight, gate, eps)
