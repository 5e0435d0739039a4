"""GLU experts over expert-sorted rows in two Triton kernels (inference; imported only on CUDA):
``run_experts``' grouped path for a prefill pass's few thousand (token, expert) pairs.

``torch``'s ``grouped_mm`` (CUTLASS' pointer-array grouped GEMM) runs the three projections as
three launches, each after a kernel that prepares the groups' pointers, plus the GLU between
them: at a 1,024-token pass of `small` (4,096 pairs over 64 experts, ~64 rows each) each GEMM
took ~16 us where its weights (16 MB) take ~4 us to read. Here:

1. ``_gate_up_kernel``, grid (row tiles, F / BLOCK_N): ``h = act(xs W1[e]^T, xs W3[e]^T)`` for a
   tile of BLOCK_M rows of one expert e, both products accumulated in fp32 side by side and the
   activation (SiTU-GLU or SwiGLU, ``openk3.ops.moe_kernels._glu``) applied before the one
   rounding to xs' dtype;
2. ``_down_kernel``, grid (row tiles, D / BLOCK_N): ``y = h W2[e]^T``.

Row tiles never straddle two experts: expert e owns ceil(count_e / BLOCK_M) tiles, and a
program finds its expert from the offsets ``ends`` (the running sums of the counts, on the
device) by a scan over the E experts in registers, so the grid is fixed without reading the
counts on the host: cdiv(P, BLOCK_M) + E tiles at most, the programs past the last tile return
at once. No host synchronisation, static shapes: a CUDA graph captures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.moe_kernels import _glu

# `benchmarks/moe_route_bench.py` on the H200 (twenty-fourth session, `small`'s layer): these blocks
# 29.2 us at 4,096 pairs (grouped_mm 52.4), 66.9 at 16,384 (86.7); at 65,536 pairs grouped_mm
# wins (204 against 216-287 over five block shapes): ``openk3.ops.moe.GROUPED_TRITON_MAX_PAIRS``.
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 64, 64, 4, 3


@triton.jit
def _tile(ends_ptr, E, N_OUT, stride_we, stride_wn, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr):
    """This program's tile: its expert (E or more past the last row tile: nothing to do), rows
    ``m`` of xs and output columns ``n`` (of N_OUT) with their masks, and the offsets of its
    expert's weight rows ``n`` (strides of the weight's expert and output dims)."""
    e = tl.arange(0, E_POW2)
    ends = tl.load(ends_ptr + e, mask=e < E, other=0)
    starts = tl.load(ends_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M                 # row tiles of each expert
    cum = tl.cumsum(tiles, axis=0)                                   # tiles of experts 0 .. e
    tile = tl.program_id(0)
    expert = tl.sum((cum <= tile).to(tl.int32), axis=0)
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, cum - tiles, 0), axis=0)
    m = tl.sum(tl.where(mine, starts, 0), axis=0) + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < tl.sum(tl.where(mine, ends, 0), axis=0), n < N_OUT
    w_cols = expert.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn   # [1, BLOCK_N]
    return expert, m, n, m_ok, n_ok, w_cols


@triton.jit
def _gate_up_kernel(xs_ptr, w1_ptr, w3_ptr, ends_ptr, h_ptr, E, F, D,
                    stride_xs, stride_we, stride_wf, stride_wd, stride_h,
                    SITU: tl.constexpr, BETA1: tl.constexpr, BETA2: tl.constexpr, E_POW2: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    expert, m, n, m_ok, n_ok, w_cols = _tile(ends_ptr, E, F, stride_we, stride_wf, E_POW2, BLOCK_M, BLOCK_N)
    if expert >= E:
        return
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, D, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < D
        x = tl.load(xs_ptr + m[:, None].to(tl.int64) * stride_xs + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)           # [BLOCK_M, BLOCK_K]
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_offs = w_cols + k[:, None] * stride_wd                            # [BLOCK_K, BLOCK_N]
        acc_gate = tl.dot(x, tl.load(w1_ptr + w_offs, mask=w_mask, other=0.0).to(x.dtype), acc_gate)
        acc_up = tl.dot(x, tl.load(w3_ptr + w_offs, mask=w_mask, other=0.0).to(x.dtype), acc_up)
    h = _glu(acc_gate, acc_up, SITU, BETA1, BETA2)
    tl.store(h_ptr + m[:, None].to(tl.int64) * stride_h + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, ends_ptr, y_ptr, E, D, F, stride_h, stride_we, stride_wd, stride_wf, stride_y,
                 E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    expert, m, n, m_ok, n_ok, w_cols = _tile(ends_ptr, E, D, stride_we, stride_wd, E_POW2, BLOCK_M, BLOCK_N)
    if expert >= E:
        return
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, F, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < F
        h = tl.load(h_ptr + m[:, None].to(tl.int64) * stride_h + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w2_ptr + w_cols + k[:, None] * stride_wf, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(h, w.to(h.dtype), acc)
    tl.store(y_ptr + m[:, None].to(tl.int64) * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def grouped_experts_triton(xs: torch.Tensor, ends: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                           w2: torch.Tensor, *, hidden_act: str, situ_beta1: float, situ_beta2: float,
                           blocks: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """GLU experts over expert-sorted rows: xs [P, D] (rows of expert e end at ``ends[e]``, int32
    running sums of the counts), w1, w3 [E, F, D], w2 [E, D, F] (unit stride along the last dim).
    Returns [P, D] in xs.dtype; ``h`` is rounded to xs.dtype between the projections, as
    ``grouped_mm``'s path rounds its products. ``blocks``: (BLOCK_M, BLOCK_N, BLOCK_K, warps,
    stages), the module's defaults when None."""
    bm, bn, bk, warps, stages = blocks or (BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES)
    P, D = xs.shape
    E, F, _ = w1.shape
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    tiles = triton.cdiv(P, bm) + E
    e_pow2 = triton.next_power_of_2(E)
    h = torch.empty(P, F, device=xs.device, dtype=xs.dtype)
    _gate_up_kernel[(tiles, triton.cdiv(F, bn))](
        xs, w1, w3, ends, h, E, F, D, xs.stride(0), *w1.stride(), h.stride(0),
        SITU=hidden_act == "situ", BETA1=situ_beta1, BETA2=situ_beta2, E_POW2=e_pow2,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps)
    y = torch.empty(P, D, device=xs.device, dtype=xs.dtype)
    _down_kernel[(tiles, triton.cdiv(D, bn))](
        h, w2, ends, y, E, D, F, h.stride(0), *w2.stride(), y.stride(0),
        E_POW2=e_pow2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps)
    return y
