"""The Triton kernels behind ``openk3.ops.router`` (imported only on CUDA).

``router_logits_kernel``: the fp32 logits ``x W^T`` of a few tokens, read from bf16 (or any
float) activations and the fp32 weight directly. One program per (token, ``ROWS`` experts); the
products accumulate elementwise in an fp32 ``[ROWS, COLS]`` tile, reduced across columns once
at the end (as ``openk3.ops.moe_kernels``). It replaces the activation's cast to fp32 and
cuBLAS's fp32 GEMM, which runs as two kernels at these sizes (a dot and a reduction, or a GEMM
and a split-K reduction).

``router_topk_kernel``: one program per token: its E logits in one tile, the sigmoid scores
(written out), the biased scores, then k rounds of "take the largest, mask it" (the first index
among equal values), the chosen scores renormalised and scaled in registers. It replaces the
sigmoid, bias add, top-k, gather, sum and divide kernels of the PyTorch router by one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def router_topk_kernel(logits_ptr, bias_ptr, scores_ptr, idx_ptr, weight_ptr, E, stride_l, eps, scale,
                       K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       RENORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    s = tl.sigmoid(tl.load(logits_ptr + t * stride_l + e, mask=ok, other=0.0).to(tl.float32))
    tl.store(scores_ptr + t * E + e, s, mask=ok)
    biased = s + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    # NaN ranks first, as in torch.topk (a NaN hidden state must still name experts in 0..E-1;
    # the GPU's max ignores NaN), and the padding lanes last
    biased = tl.where(ok, tl.where(biased != biased, float("inf"), biased), float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(biased, axis=0)
        i = tl.min(tl.where(ok & (biased == best), e, BLOCK_E), axis=0)  # the first index of the largest
        i = tl.minimum(i, E - 1)  # never out of range, whatever the values
        chosen = tl.where(slot == j, i, chosen)
        weights = tl.where(slot == j, tl.sum(tl.where(e == i, s, 0.0), axis=0), weights)
        biased = tl.where(e == i, float("-inf"), biased)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + eps)
    weights = weights * scale
    tl.store(idx_ptr + t * K + slot, chosen.to(idx_ptr.dtype.element_ty), mask=slot < K)
    tl.store(weight_ptr + t * K + slot, weights, mask=slot < K)


@triton.jit
def router_logits_kernel(x_ptr, w_ptr, out_ptr, E, D, stride_xn, stride_we,
                         ROWS: tl.constexpr, COLS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * ROWS + tl.arange(0, ROWS)                   # [ROWS]
    w_rows = w_ptr + e[:, None].to(tl.int64) * stride_we                # [ROWS, 1]
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for d0 in range(0, D, COLS):
        d = d0 + tl.arange(0, COLS)                                     # [COLS]
        x = tl.load(x_ptr + t * stride_xn + d, mask=d < D, other=0.0).to(tl.float32)
        w = tl.load(w_rows + d[None, :], mask=(e[:, None] < E) & (d[None, :] < D), other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(out_ptr + t * E + e, tl.sum(acc, axis=1), mask=e < E)
