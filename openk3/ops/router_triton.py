"""The Triton kernel behind ``openk3.ops.router.router_topk`` (imported only on CUDA).

One program per token: its E logits in one tile, the sigmoid scores (written out), the biased
scores, then k rounds of "take the largest, mask it" (the first index among equal values), the
chosen scores renormalised and scaled in registers. It replaces the sigmoid, bias add, top-k,
gather, sum and divide kernels of the PyTorch router by one launch.
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
