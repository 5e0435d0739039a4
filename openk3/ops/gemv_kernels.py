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

With ``NORM`` the kernel normalises x before the products (its prologue; one ``BLOCK_K`` step
holds a whole row, so every program has the row's sum of squares at hand): 1, an RMSNorm over
the row with weight ``nw`` [K]; 2, a gated RMSNorm over groups of ``GROUP`` columns (the heads),
``nw`` [GROUP] and the gate's sigmoid per column (``gated_rms_norm_ref``). The normed row stays
in fp32 (the separate norm kernel's output was rounded to 16 bits): a decode step's norm kernel
before its projection is one link less in its chain of dependent kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, add_ptr, nw_ptr, gate_ptr, N, K, eps,
                 stride_xm, stride_wn, stride_om, stride_am, stride_gm,
                 M: tl.constexpr, M_POW2: tl.constexpr, ACCUMULATE: tl.constexpr,
                 NORM: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)           # [BLOCK_N]
    m = tl.arange(0, M_POW2)                                         # [M_POW2]
    n_ok, m_ok = n < N, m < M
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn             # [BLOCK_N, 1]
    x_rows = x_ptr + m[:, None] * stride_xm                          # [M_POW2, 1]
    offs = m[:, None] * stride_om + n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:  # loaded first: its latency hides under the weights' loads
        old = tl.load(add_ptr + m[:, None] * stride_am + n[None, :], mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros([M_POW2, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one step with NORM (BLOCK_K >= K)
        k = k0 + tl.arange(0, BLOCK_K)                               # [BLOCK_K]
        k_ok = k < K
        x_mask = m_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
        if NORM == 1:
            inv = tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)          # [M_POW2]
            nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            x = x * inv[:, None] * nw[None, :]
        if NORM == 2:
            sq = tl.reshape(x * x, (M_POW2, BLOCK_K // GROUP, GROUP))
            inv = tl.rsqrt(tl.sum(sq, axis=2) / GROUP + eps)         # [M_POW2, BLOCK_K // GROUP]
            inv = tl.reshape(tl.broadcast_to(inv[:, :, None], (M_POW2, BLOCK_K // GROUP, GROUP)),
                             (M_POW2, BLOCK_K))
            nw = tl.load(nw_ptr + k % GROUP).to(tl.float32)
            g = tl.load(gate_ptr + m[:, None] * stride_gm + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            x = x * inv * nw[None, :] * tl.sigmoid(g)
        acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
    y = tl.sum(acc, axis=2)                                          # [M_POW2, BLOCK_N]
    if ACCUMULATE:
        y += old
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gemv_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, accumulate: bool,
                block_n: int, block_k: int, num_warps: int, *, add: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                eps: float = 0.0) -> torch.Tensor:
    """``out = [add +] norm(x) @ w.T`` for x [M, K] (unit stride along K), w [N, K] contiguous,
    out [M, N] (unit stride along N); ``accumulate`` adds ``add`` (default: ``out`` itself, in
    place). ``norm_weight`` [K]: x RMS-normed first; [G] with ``gate`` [M, K] (unit stride along
    K): the gated norm over groups of G columns (``block_k`` must then cover K). Arguments
    already validated by ``openk3.ops.gemv``."""
    M, K = x.shape
    N = w.shape[0]
    add = out if add is None else add
    norm = 0 if norm_weight is None else 1 if gate is None else 2
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, w, out, add, x if norm_weight is None else norm_weight, x if gate is None else gate,
        N, K, eps, x.stride(0), w.stride(0), out.stride(0), add.stride(0),
        0 if gate is None else gate.stride(0),
        M=M, M_POW2=triton.next_power_of_2(M), ACCUMULATE=accumulate, NORM=norm,
        GROUP=1 if norm_weight is None else norm_weight.shape[0],
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out
