"""Triton kernel of ``openk3.ops.gemv.linear`` (imported only on the CUDA fast path: CPU installs
have no triton).

``_gemv_kernel``, grid (N / BLOCK_N,): a program owns ``BLOCK_N`` output columns of all M rows
(M <= ``openk3.ops.gemv.GEMV_MAX_ROWS``), streams the matching ``BLOCK_N`` rows of the weight
``[N, K]`` once, ``BLOCK_K`` columns a step, and accumulates the products elementwise in an fp32
``[M, BLOCK_N, BLOCK_K]`` tile reduced over K once at the end; with ``ACCUMULATE`` it adds the
output's old value (loaded before the weights, so that its latency hides under theirs) in fp32
before the one rounding (``addmm_``'s result). A projection of a few rows is bound by the
latency of its loads: many short programs win (``openk3.ops.gemv.gemv_blocks``), e.g. 2.7 us
for one row of [1024, 1024] against cuBLAS's 7.7 (its tiles give that output 16 blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                 M: tl.constexpr, M_POW2: tl.constexpr, ACCUMULATE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)           # [BLOCK_N]
    m = tl.arange(0, M_POW2)                                         # [M_POW2]
    n_ok, m_ok = n < N, m < M
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn             # [BLOCK_N, 1]
    x_rows = x_ptr + m[:, None] * stride_xm                          # [M_POW2, 1]
    offs = m[:, None] * stride_om + n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:  # loaded first: its latency hides under the weights' loads
        old = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros([M_POW2, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)                               # [BLOCK_K]
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    y = tl.sum(acc, axis=2)                                          # [M_POW2, BLOCK_N]
    if ACCUMULATE:
        y += old
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gemv_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, accumulate: bool,
                block_n: int, block_k: int, num_warps: int) -> torch.Tensor:
    """``out (+)= x @ w.T`` for x [M, K] (unit stride along K), w [N, K] contiguous, out [M, N]
    (unit stride along N); arguments already validated by ``openk3.ops.gemv``."""
    M, K = x.shape
    N = w.shape[0]
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, w, out, N, K, x.stride(0), w.stride(0), out.stride(0),
        M=M, M_POW2=triton.next_power_of_2(M), ACCUMULATE=accumulate,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out
