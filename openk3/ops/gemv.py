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

``norm_linear`` is ``linear`` (or ``linear_add_``) of a normed row: the MoE's latent RMSNorm
before its up projection, KDA's gated output norm before ``o_proj``. On the GEMV path the norm is
the kernel's prologue (``FOLD_NORMS``), one dependent kernel less per layer in a decode step's
chain; ``norm_linear_ref`` is its reference (the norm in fp32, not rounded before the product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.fast import needs_grad, use_fast_path
from openk3.ops.moe import triton_available  # whether triton imports, as the router asks
from openk3.ops.norm import gated_rms_norm, rms_norm

GEMV_MAX_ROWS = 4  # decode batches up to this many rows; cuBLAS's tiles fill the GPU beyond
GEMV_WIDE_N = 2048  # from 3 rows on, outputs wider than this stay with cuBLAS (faster there)
DTYPES = (torch.bfloat16, torch.float16)
FOLD_NORMS = True  # norm_linear's norm as the GEMV's prologue (False: the norm kernel, then the GEMV)
FOLD_ADDS = True  # linear's ``add`` in the GEMV's epilogue (False: the GEMV, then an add kernel)
MAX_TILE = 4096  # fp32 products a program holds: M_POW2 x BLOCK_N x BLOCK_K
# the fold's rows x whole-row step (M_POW2 x BLOCK_K) at most: KDA's o_proj (K 1,024) folds at 1-2
# rows (4 rows took 9.7 us against 5.4 for the norm kernel and the GEMV), the MoE's up projection
# (K 512) at 1-4 (docs/benchmarks.md, twenty-seventh session)
FOLD_MAX_ROW_TILE = 2048


def gemv_blocks(M: int, N: int, K: int, whole_rows: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the kernel for ``M`` rows of ``[N, K]``: whole rows of up
    to 1,024 columns a step (512 for more than one row; with ``whole_rows``, all K, which the
    norm prologue needs), a fp32 tile of at most 2,048 products a row and ``MAX_TILE`` in all
    (``M_POW2 x BLOCK_N x BLOCK_K``), at least ~256 programs where N allows, 2 warps. Many
    short programs win: a projection of a few rows is bound by the latency of its loads, not by
    bandwidth (``benchmarks/gemv_bench.py --sweep``, docs/benchmarks.md, twenty-sixth session:
    these blocks were the best or within 10% at `small`'s shapes)."""
    m_pow2 = 1 << (M - 1).bit_length()
    block_k = max(16, 1 << (K - 1).bit_length())
    if not whole_rows:
        block_k = min(1024 if M == 1 else 512, block_k)
    block_n = max(1, min(2048 // block_k, MAX_TILE // (m_pow2 * block_k), N // 256))
    return 1 << (block_n.bit_length() - 1), block_k, 2


def use_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``linear(x, w)`` runs the GEMV kernel."""
    return x.dtype == w.dtype and _gemv_applies(x, w)


def _gemv_applies(x: torch.Tensor, w: torch.Tensor, *others: torch.Tensor) -> bool:
    rows = x.numel() // max(1, x.shape[-1])
    return (not torch.compiler.is_compiling() and w.dtype in DTYPES
            and (rows <= 2 or rows <= GEMV_MAX_ROWS and w.shape[0] <= GEMV_WIDE_N) and w.dim() == 2
            and w.stride(1) == 1 and use_fast_path(x) and not needs_grad(x, w, *others)
            and triton_available())


def use_norm_gemv(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor,
                  gate: torch.Tensor | None = None) -> bool:
    """Whether ``norm_linear`` folds the norm into the GEMV kernel: ``FOLD_NORMS``, the GEMV's
    conditions (x may be fp32), the rows' whole-row step within ``FOLD_MAX_ROW_TILE`` and, with
    a gate, groups of a power-of-two size that divides K."""
    K = x.shape[-1]
    rows = x.numel() // max(1, K)
    if not (FOLD_NORMS and x.dtype in (*DTYPES, torch.float32) and K == w.shape[-1]
            and (1 << (rows - 1).bit_length()) * max(16, 1 << (K - 1).bit_length()) <= FOLD_MAX_ROW_TILE):
        return False
    if gate is None:
        shape_ok = norm_weight.shape == (K,)
    else:
        G = norm_weight.shape[0]
        shape_ok = (norm_weight.dim() == 1 and G & (G - 1) == 0 and K % G == 0
                    and gate.shape == x.shape and gate.stride(-1) == 1)
    return shape_ok and norm_weight.stride(0) == 1 and _gemv_applies(x, w, norm_weight, *(() if gate is None else (gate,)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def linear(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` (``F.linear`` without bias): x ``[..., K]``, w ``[N, K]`` -> ``[..., N]``;
    with ``add`` (the output's shape and dtype), ``add + x @ w.T`` in a new tensor (the GEMV
    adds it before its one rounding: the residual stream's add kernel folded away)."""
    if not use_gemv(x, w):
        return F.linear(x, w) if add is None else add + F.linear(x, w)
    if not _addable(add, x, w):  # the GEMV, then the add
        return add + linear(x, w)
    from openk3.ops.gemv_kernels import gemv_triton

    x2 = _rows(x)
    out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return gemv_triton(x2, w, out, add is not None, *gemv_blocks(x2.shape[0], w.shape[0], w.shape[1]),
                       add=_add_rows(add, w)).view(*x.shape[:-1], w.shape[0])


def _addable(add: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the GEMV can add ``add`` in its epilogue: the output's shape and w's dtype, rows
    of unit stride, no autograd."""
    return add is None or (FOLD_ADDS and add.shape == (*x.shape[:-1], w.shape[0]) and add.dtype == w.dtype
                           and add.stride(-1) == 1 and not needs_grad(add))


def _add_rows(add: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor | None:
    return None if add is None else add.reshape(-1, w.shape[0])


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


def norm_linear(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor, eps: float, *,
                gate: torch.Tensor | None = None, out: torch.Tensor | None = None,
                add: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(norm(x), w, add)``, or with ``out`` ``linear_add_(out, norm(x), w)`` (the caller's
    own tensor, added into in place: check ``fuse.add_linear_``'s conditions first).

    norm: without ``gate``, the RMSNorm over x's last dim K with ``norm_weight`` [K]
    (``rms_norm``, its output in w's dtype); with ``gate`` (x's shape), the gated RMSNorm over
    groups of G = ``len(norm_weight)`` columns (``gated_rms_norm`` of x and gate viewed
    [..., K / G, G], in x's dtype): KDA's output norm over its heads. Where ``use_norm_gemv``,
    one GEMV kernel whose prologue is the norm (the normed row in fp32: ``norm_linear_ref``).
    """
    if out is not None and add is not None:
        raise ValueError("norm_linear: give `out` (added into in place) or `add`, not both")
    if not _addable(add, x, w):  # the projection (its norm folded where it can be), then the add
        return add + norm_linear(x, w, norm_weight, eps, gate=gate)
    if not use_norm_gemv(x, w, norm_weight, gate):
        normed = _norm_ref_ops(x, norm_weight, eps, gate, w.dtype)
        return linear(normed, w, add) if out is None else linear_add_(out, normed, w)
    from openk3.ops.gemv_kernels import gemv_triton

    x2 = _rows(x)
    g2 = None if gate is None else gate.reshape(-1, gate.shape[-1])
    N = w.shape[0]
    dest = torch.empty(x2.shape[0], N, dtype=w.dtype, device=x.device) if out is None else out.view(-1, N)
    gemv_triton(x2, w, dest, out is not None or add is not None,
                *gemv_blocks(x2.shape[0], N, x2.shape[1], whole_rows=True),
                add=_add_rows(add, w), norm_weight=norm_weight, gate=g2, eps=eps)
    return dest.view(*x.shape[:-1], N) if out is None else out


def _norm_ref_ops(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """``norm_linear``'s norm as the norm ops (their own fast paths)."""
    if gate is None:
        return rms_norm(x, norm_weight, eps, out_dtype=dtype)
    G = norm_weight.shape[0]
    grouped = (*x.shape[:-1], x.shape[-1] // G, G)
    return gated_rms_norm(x.reshape(grouped), norm_weight, gate.reshape(grouped), eps).reshape(x.shape)


def norm_linear_ref(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor, eps: float, *,
                    gate: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of the folded kernel: the norm in fp32 (not rounded), then ``gemv_ref``'s
    fp32 products and sums (plus ``out``), rounded once to w's dtype."""
    xf = x.float()
    if gate is None:
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    else:
        G = norm_weight.shape[0]
        g = xf.unflatten(-1, (-1, G))
        normed = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
                  * torch.sigmoid(gate.float().unflatten(-1, (-1, G)))).flatten(-2)
    y = normed @ w.float().t()
    if out is not None:
        y = y + out.float()
    return y.to(w.dtype)


def gemv_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``x @ w.T`` (plus ``out``) in fp32, rounded once to x's dtype."""
    y = x.float() @ w.float().t()
    if out is not None:
        y = y + out.float()
    return y.to(x.dtype)
