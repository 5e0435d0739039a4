"""The Triton kernels behind ``openk3.ops.router`` (imported only on CUDA).

``router_logits_kernel``: the fp32 logits ``x W^T`` of a few tokens, read from bf16 (or any
float) activations and the fp32 weight directly. One program per (token, ``ROWS`` experts); the
products accumulate elementwise in an fp32 ``[ROWS, COLS]`` tile, reduced across columns once
at the end (as ``openk3.ops.moe_kernels``). It replaces the activation's cast to fp32 and
cuBLAS's fp32 GEMM, which runs as two kernels at these sizes (a dot and a reduction, or a GEMM
and a split-K reduction).

``router_topk_kernel``: one program per ``TOKENS`` tokens: their E logits in one tile, the sigmoid scores
(written out unless training's autograd computes them), the biased scores, then k rounds of
"take the largest not yet taken" (the first index among equal values), the chosen scores
renormalised and scaled in registers. It replaces the
sigmoid, bias add, top-k, gather, sum and divide kernels of the PyTorch router by one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N"])  # token counts vary from pass to pass: one compile for all
def router_topk_kernel(logits_ptr, bias_ptr, scores_ptr, idx_ptr, weight_ptr, N, E, stride_l, eps, scale,
                       K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, TOKENS: tl.constexpr,
                       RENORMALIZE: tl.constexpr, WRITE_SCORES: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)  # [TOKENS]
    e = tl.arange(0, BLOCK_E)
    ok = (t < N)[:, None] & (e < E)[None, :]                            # [TOKENS, BLOCK_E]
    s = tl.sigmoid(tl.load(logits_ptr + t[:, None] * stride_l + e[None, :], mask=ok, other=0.0).to(tl.float32))
    if WRITE_SCORES:
        tl.store(scores_ptr + t[:, None] * E + e[None, :], s, mask=ok)
    biased = s + tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32)[None, :]
    # NaN ranks first, as in torch.topk (a NaN hidden state must still name experts in 0..E-1;
    # the GPU's max ignores NaN)
    biased = tl.where(biased != biased, float("inf"), biased)
    free = ok                                                           # not padding, not chosen yet
    slot = tl.arange(0, BLOCK_K)[None, :]                               # [1, BLOCK_K]
    chosen = tl.zeros([TOKENS, BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([TOKENS, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(tl.where(free, biased, float("-inf")), axis=1)[:, None]
        # the first free index of the largest (of any free one when all are -inf), in range
        i = tl.minimum(tl.min(tl.where(free & (biased == best), e[None, :], BLOCK_E), axis=1), E - 1)
        hit = e[None, :] == i[:, None]
        chosen = tl.where(slot == j, i[:, None], chosen)
        weights = tl.where(slot == j, tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], weights)
        free = free & ~hit
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + eps)
    weights = weights * scale
    out = (t < N)[:, None] & (slot < K)
    tl.store(idx_ptr + t[:, None] * K + slot, chosen.to(idx_ptr.dtype.element_ty), mask=out)
    tl.store(weight_ptr + t[:, None] * K + slot, weights, mask=out)


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


@triton.jit
def kth_largest_kernel(x_ptr, out_ptr, R, E, K: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr):
    """out[r] = the K-th largest of x[r, :] over E contiguous columns: K rounds of "take the
    largest, mask it once" (ties count, as in ``torch.topk``)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, BLOCK_E)
    ok = (r < R)[:, None] & (e < E)[None, :]
    v = tl.load(x_ptr + r[:, None] * E + e[None, :], mask=ok, other=0.0).to(tl.float32)
    v = tl.where(ok, tl.where(v != v, float("inf"), v), float("-inf"))
    best = tl.max(v, axis=1)
    for _ in tl.static_range(K - 1):
        first = tl.min(tl.where(v == best[:, None], e[None, :], BLOCK_E), axis=1)
        v = tl.where(e[None, :] == first[:, None], float("-inf"), v)
        best = tl.max(v, axis=1)
    tl.store(out_ptr + r, best, mask=r < R)


@triton.jit
def kth_largest_long_kernel(x_ptr, out_ptr, E, K, BLOCK_E: tl.constexpr):
    """out[r] = the K-th largest of x[r, :] (fp32, E contiguous columns, E <= BLOCK_E: the row
    stays in registers) by bisection on the values' ordered bits: from the top bit down, keep a
    bit set where at least K values are >= the threshold so far. 32 counts over the row instead
    of a sort; exact (ties count; a NaN counts as +inf, as in ``kth_largest_kernel``; -0.0 ranks
    below +0.0)."""
    r = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    v = tl.load(x_ptr + r * E + e, mask=e < E, other=float("-inf"))
    bits = tl.where(v != v, float("inf"), v).to(tl.int32, bitcast=True)
    # a signed key that orders as the floats do: negative floats' magnitude bits flipped
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(e < E, key, -2147483648)  # padding below every value (-inf's key is above it)
    # the answer's unsigned form (key + 2^31) is built bit by bit in an int64 scalar; each
    # count compares the int32 keys with its signed form
    ans = tl.zeros([], dtype=tl.int64)
    for i in tl.static_range(32):
        cand = ans + (1 << (31 - i))
        count = tl.sum((key >= (cand - 2147483648).to(tl.int32)).to(tl.int32), axis=0)
        ans = tl.where(count >= K, cand, ans)
    key = (ans - 2147483648).to(tl.int32)
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    tl.store(out_ptr + r, bits.to(tl.float32, bitcast=True))
