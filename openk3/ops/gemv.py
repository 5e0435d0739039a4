"""A few rows times a weight: the projections of a decode step as one Triton GEMV each (issue P8).

A batch-1 decode step of ``small`` multiplies one row by 143 weights (the fused input
projections, ``o_proj``, the MoE's output projections, ...). cuBLAS runs each as a GEMM whose
tiles give a 1,024-wide output 16 thread blocks: 2.9-7.7 us per projection for weights of
0.25-8.7 MB that the H200 reads in 0.06-2 us; 744 us a step, where this kernel takes 402 (floor
90; docs/benchmarks.md, twenty-sixth session). ``linear`` takes openk3's GEMV kernel
(``gemv_kernels.py``: hundreds of short programs, each streaming a few weight rows once for all
M rows) for 1-2 rows, and for 3-``GEMV_MAX_ROWS`` rows of outputs up to ``GEMV_WIDE_N`` wide, of
bf16/fp16 on CUDA without autograd; ``F.linear`` otherwise. ``linear_add_`` is its ``addmm_``
(the product added into the caller's tensor, rounded once). ``gemv_ref`` is the reference:
fp32 products and sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.fast import needs_grad, use_fast_path
from openk3.ops.moe import triton_available  # whether triton imports, as the router asks

GEMV_MAX_ROWS = 4  # decode batches up to this many rows; cuBLAS's tiles fill the GPU beyond
GEMV_WIDE_N = 2048  # from 3 rows on, outputs wider than this stay with cuBLAS (faster there)
DTYPES = (torch.bfloat16, torch.float16)


def gemv_blocks(M: int, N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the kernel for ``M`` rows of ``[N, K]``: whole rows of up
    to 1,024 columns a step (512 for more than one row), a fp32 tile of at most 2,048 products a
    row and 4,096 in all (``M_POW2 x BLOCK_N x BLOCK_K``), at least ~256 programs where N allows,
    2 warps. Many short programs win: a projection of a few rows is bound by the latency of its
    loads, not by bandwidth (``benchmarks/gemv_bench.py --sweep``, docs/benchmarks.md,
    twenty-sixth session: these blocks were the best or within 10% at `small`'s shapes)."""
    m_pow2 = 1 << (M - 1).bit_length()
    block_k = min(1024 if M == 1 else 512, max(16, 1 << (K - 1).bit_length()))
    block_n = max(1, min(2048 // block_k, 4096 // (m_pow2 * block_k), N // 256))
    return 1 << (block_n.bit_length() - 1), block_k, 2


def use_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``linear(x, w)`` runs the GEMV kernel."""
    rows = x.numel() // max(1, x.shape[-1])
    return (not torch.compiler.is_compiling() and x.dtype == w.dtype and x.dtype in DTYPES
            and (rows <= 2 or rows <= GEMV_MAX_ROWS and w.shape[0] <= GEMV_WIDE_N) and w.dim() == 2
            and w.stride(1) == 1 and use_fast_path(x) and not needs_grad(x, w) and triton_available())


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` (``F.linear`` without bias): x ``[..., K]``, w ``[N, K]`` -> ``[..., N]``."""
    if not use_gemv(x, w):
        return F.linear(x, w)
    from openk3.ops.gemv_kernels import gemv_triton

    x2 = _rows(x)
    out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return gemv_triton(x2, w, out, False, *gemv_blocks(x2.shape[0], w.shape[0], w.shape[1])).view(
        *x.shape[:-1], w.shape[0])


def linear_add_(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``out += x @ w.T`` in place, the sum rounded once (``addmm_``): out ``[..., N]``
    contiguous, of x's dtype, x ``[..., K]``, w ``[N, K]``. Returns ``out``."""
    o2 = out.view(-1, w.shape[0])
    if not use_gemv(x, w) or needs_grad(out):
        o2.addmm_(x.reshape(-1, x.shape[-1]), w.t())
    else:
        from openk3.ops.gemv_kernels import gemv_triton

        x2 = _rows(x)
        gemv_triton(x2, w, o2, True, *gemv_blocks(x2.shape[0], w.shape[0], w.shape[1]))
    return out


def gemv_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``x @ w.T`` (plus ``out``) in fp32, rounded once to x's dtype."""
    y = x.float() @ w.float().t()
    if out is not None:
        y = y + out.float()
    return y.to(x.dtype)
