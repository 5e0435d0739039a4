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

``route_kernel``: both in one launch for a few tokens (decode: the two kernels were two of a MoE
layer's launches, ~8 us a `small` layer on the H200, against 0.06 us to read its 256 KB
weight). The grid is ``router_logits_kernel``'s, (token, ``ROWS`` experts); each program writes
its experts' sigmoid scores to ``scores`` (an output the router returns anyway: no scratch),
then takes a ticket from the token's arrival counter, and the program that arrives last
chooses that token's experts from all E scores, as ``router_topk_kernel`` does. Nothing waits:
no program spins on another, so any scheduling order finishes. Both halves are the two
kernels' own jit functions (``_logits_of_rows``, ``_choose_experts``) with the same tiles, so the
scores, ids and weights are theirs bit for bit.

Why a split grid and not one program per token computing all E logits over a
``[BLOCK_E, COLS]`` tile before its top-k in registers (no counter, no round trip of the
scores): that program reads the whole weight through one SM, which sustains perhaps 50-200 GB/s
(the loads it keeps in flight over the memory's latency; an estimate, nothing here is measured):
`small`'s 256 KB take ~1.5-5 us there, K3's router (896 x 7168 fp32, 25.7 MB) 130-500 us. Split,
each program reads ``ROWS`` rows (16 KB of `small`'s, 115 KB of K3's) on its own SM: a few
memory latencies (D / COLS dependent steps, as the GEMV), then one atomic in L2 and, in the
last program, a re-read of E scores from L2 (~1 us together, estimated). For `small` the two
designs are of the same order by these estimates; K3 rules the single program out, and one
kernel for both keeps the GEMV's programs and sums, hence its logits bit for bit (a
``[BLOCK_E, COLS]`` tile would reduce in another order). The split costs K3 occupancy: the
1024-wide top-k tile makes every program of the kernel hold ~92 registers per thread (ptxas for
sm_90, against 32 for the GEMV), so 5 of its programs fit an SM instead of 16; for `small`'s 64
experts it stays at 32. ``benchmarks/moe_decode_bench.py --router`` times it beside the two
kernels.

Memory ordering (the last program must see every program's scores): each program's threads
store their scores, a CTA barrier (``tl.debug_barrier``) orders those stores before the one
thread that performs the scalar atomic, and the atomic is ``acq_rel`` at GPU scope: its release
publishes the program's scores with its increment, and the increment that reads ``slices - 1``
acquires every earlier program's release (they precede it in the counter's modification order).
Triton broadcasts the atomic's result through shared memory behind a barrier, so all of the
last program's threads read the scores after the acquire; they read them with ``.cg`` (from L2,
past the SM's L1, which is not coherent across SMs) as well. The PTX for sm_90 is that: the
stores, ``bar.sync``, one thread's ``atom.global.gpu.acq_rel.add``, ``st.shared``, ``bar.sync``,
the branch, ``ld.global.cg``. The last program then stores 0 back in the counter: every program
of its token has taken its ticket, so nothing else touches it in this launch, and the next
launch (or CUDA graph replay) finds it zero.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _logits_of_rows(x_row, w_ptr, e, E, D, stride_we, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The fp32 logits ``x . W[e]`` of one token (``x_row`` its first element) for the ``[ROWS]``
    experts ``e``: products summed elementwise in a ``[ROWS, COLS]`` tile over D, then across
    its columns."""
    w_rows = w_ptr + e[:, None].to(tl.int64) * stride_we                # [ROWS, 1]
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for d0 in range(0, D, COLS):
        d = d0 + tl.arange(0, COLS)                                     # [COLS]
        x = tl.load(x_row + d, mask=d < D, other=0.0).to(tl.float32)
        w = tl.load(w_rows + d[None, :], mask=(e[:, None] < E) & (d[None, :] < D), other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _choose_experts(s, bias, ok, e, E, eps, scale, K: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_K: tl.constexpr, TOKENS: tl.constexpr, RENORMALIZE: tl.constexpr):
    """The K experts of each of ``TOKENS`` tokens from their fp32 scores ``s`` ``[TOKENS, BLOCK_E]``
    (``ok`` marks the real ones, ``e`` ``[1, BLOCK_E]`` their ids, ``bias`` ``[1, BLOCK_E]``):
    ids ``[TOKENS, BLOCK_K]`` int32 (largest ``s + bias`` first) and their weights
    ``[TOKENS, BLOCK_K]`` fp32 (the chosen ``s``, renormalised, times ``scale``)."""
    biased = s + bias
    # NaN ranks first, as in torch.topk (a NaN hidden state must still name experts in 0..E-1;
    # the GPU's max ignores NaN)
    biased = tl.where(biased != biased, float("inf"), biased)
    free = ok                                                           # not padding, not chosen yet
    slot = tl.arange(0, BLOCK_K)[None, :]                               # [1, BLOCK_K]
    chosen = tl.zeros([TOKENS, BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([TOKENS, BLOCK_K], dtype=tl.float32)
    total = tl.zeros([TOKENS], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(tl.where(free, biased, float("-inf")), axis=1)[:, None]
        # the first free index of the largest (of any free one when all are -inf), in range
        i = tl.minimum(tl.min(tl.where(free & (biased == best), e, BLOCK_E), axis=1), E - 1)
        hit = e == i[:, None]
        picked = tl.sum(tl.where(hit, s, 0.0), axis=1)                  # [TOKENS]
        chosen = tl.where(slot == j, i[:, None], chosen)
        weights = tl.where(slot == j, picked[:, None], weights)
        # summed in slot order, not by a tile reduction whose order follows the tile's layout:
        # route_kernel (one token per tile) and router_topk_kernel (TOKENS) give equal weights
        total += picked
        free = free & ~hit
    if RENORMALIZE:
        weights = weights / (total[:, None] + eps)
    return chosen, weights * scale


@triton.jit
def router_topk_kernel(logits_ptr, bias_ptr, scores_ptr, idx_ptr, weight_ptr, N, E, stride_l, eps, scale,
                       K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, TOKENS: tl.constexpr,
                       RENORMALIZE: tl.constexpr, WRITE_SCORES: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)  # [TOKENS]
    e = tl.arange(0, BLOCK_E)[None, :]                                  # [1, BLOCK_E]
    ok = (t < N)[:, None] & (e < E)                                     # [TOKENS, BLOCK_E]
    s = tl.sigmoid(tl.load(logits_ptr + t[:, None] * stride_l + e, mask=ok, other=0.0).to(tl.float32))
    if WRITE_SCORES:
        tl.store(scores_ptr + t[:, None] * E + e, s, mask=ok)
    bias = tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32)
    chosen, weights = _choose_experts(s, bias, ok, e, E, eps, scale, K, BLOCK_E, BLOCK_K, TOKENS, RENORMALIZE)
    slot = tl.arange(0, BLOCK_K)[None, :]
    out = (t < N)[:, None] & (slot < K)
    tl.store(idx_ptr + t[:, None] * K + slot, chosen.to(idx_ptr.dtype.element_ty), mask=out)
    tl.store(weight_ptr + t[:, None] * K + slot, weights, mask=out)


@triton.jit
def router_logits_kernel(x_ptr, w_ptr, out_ptr, E, D, stride_xn, stride_we,
                         ROWS: tl.constexpr, COLS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * ROWS + tl.arange(0, ROWS)                   # [ROWS]
    logits = _logits_of_rows(x_ptr + t * stride_xn, w_ptr, e, E, D, stride_we, ROWS, COLS)
    tl.store(out_ptr + t * E + e, logits, mask=e < E)


@triton.jit
def route_kernel(x_ptr, w_ptr, bias_ptr, scores_ptr, idx_ptr, weight_ptr, tickets_ptr, E, D, stride_xn,
                 stride_we, eps, scale, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                 ROWS: tl.constexpr, COLS: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Grid (N tokens, cdiv(E, ROWS) slices); ``tickets_ptr``: N int32 zeros (zeros again after)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * ROWS + tl.arange(0, ROWS)                   # [ROWS]
    logits = _logits_of_rows(x_ptr + t * stride_xn, w_ptr, e, E, D, stride_we, ROWS, COLS)
    tl.store(scores_ptr + t * E + e, tl.sigmoid(logits), mask=e < E)
    tl.debug_barrier()  # every thread's stores before the (one-thread) release below
    arrived = tl.atomic_add(tickets_ptr + t, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:  # the last of the token's programs: all E scores are out
        tl.store(tickets_ptr + t, 0)
        ids = tl.arange(0, BLOCK_E)[None, :]                            # [1, BLOCK_E]
        ok = ids < E
        s = tl.load(scores_ptr + t * E + ids, mask=ok, other=0.0, cache_modifier=".cg")
        bias = tl.load(bias_ptr + ids, mask=ok, other=0.0).to(tl.float32)
        chosen, weights = _choose_experts(s, bias, ok, ids, E, eps, scale, K, BLOCK_E, BLOCK_K, 1, RENORMALIZE)
        slot = tl.arange(0, BLOCK_K)[None, :]
        tl.store(idx_ptr + t * K + slot, chosen.to(idx_ptr.dtype.element_ty), mask=slot < K)
        tl.store(weight_ptr + t * K + slot, weights, mask=slot < K)


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
