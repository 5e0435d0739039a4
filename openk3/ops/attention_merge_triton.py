"""The Triton kernel behind ``openk3.ops.varlen_attention.merge_parts`` (imported only on CUDA).

``merge_parts_kernel``: one program per (block of BLOCK_Q queries, head). Attention over a set of
keys cut into parts gives per part an output o_i (each part's softmax-weighted values) and the
log-sum-exp l_i of its scaled scores; the whole attention is sum_i o_i * exp(l_i - L) with
L = logsumexp_i l_i. The program reads the m prefix parts' and the tail's log-sum-exps, their
maximum first (a part no query key reaches has l = -inf and weight 0), then accumulates the
weighted outputs in fp32 and writes them once in the output's dtype: one kernel where the torch
merge took ten (concatenation, logsumexp, exp, an fp32 copy and a product per part, the sums).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_parts_kernel(o_ptr, lse_ptr, tail_ptr, tail_lse_ptr, out_ptr, m, Tq, Dv,
                       so_m, so_q, so_h, sl_m, sl_h, sl_q, st_q, st_h, stl_h, stl_q, sout_q, sout_h,
                       BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    q_ok, d_ok = q < Tq, d < Dv
    q64 = q.to(tl.int64)
    tail_lse = tl.load(tail_lse_ptr + h * stl_h + q64 * stl_q, mask=q_ok, other=0.0).to(tl.float32)
    top = tail_lse
    for i in range(m):
        lse = tl.load(lse_ptr + i * sl_m + h * sl_h + q64 * sl_q, mask=q_ok, other=0.0).to(tl.float32)
        top = tl.maximum(top, lse)
    top = tl.where(top == float("-inf"), 0.0, top)  # no part sees a key: every weight is 0
    w = tl.exp(tail_lse - top)
    total = w
    mask = q_ok[:, None] & d_ok[None, :]
    acc = w[:, None] * tl.load(tail_ptr + q64[:, None] * st_q + h * st_h + d[None, :], mask=mask,
                               other=0.0).to(tl.float32)
    for i in range(m):
        lse = tl.load(lse_ptr + i * sl_m + h * sl_h + q64 * sl_q, mask=q_ok, other=0.0).to(tl.float32)
        w = tl.exp(lse - top)
        total += w
        o = tl.load(o_ptr + i * so_m + q64[:, None] * so_q + h * so_h + d[None, :], mask=mask, other=0.0)
        acc += w[:, None] * o.to(tl.float32)
    acc = acc / total[:, None]
    tl.store(out_ptr + q64[:, None] * sout_q + h * sout_h + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)
