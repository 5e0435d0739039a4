"""Triton kernels of ``openk3.ops.moe.moe_gemv`` (imported only on the CUDA fast path: CPU
installs have no triton).

The gate/up kernel's programs own one (token, slot) pair p and ``ROWS`` output rows of it,
and stream the matching rows of its expert's weights (a memory-bound GEMV: products accumulate
elementwise in an fp32 ``[ROWS, COLS]`` tile, reduced across columns once at the end):

1. ``_gate_up_kernel``, grid (P, F / ROWS): ``h[p] = act(W1[e_p] x[t_p], W3[e_p] x[t_p])``,
   ``[P, F]`` fp32.
2. ``_down_sum_kernel``, grid (N, D / rows): ``y[t] = sum_j w_j W2[e_j] h[t, j]``, ``[N, D]``
   fp32: a program owns a token and a few output rows and holds all k slots' weight rows in one
   ``[k, rows, COLS]`` tile, so the slots' loads go out together and their sum (a fixed tree
   over the slots: the same bits at every run) needs no kernel of its own. (Before: a per-pair
   down kernel into a ``[P, D]`` buffer, then ``sum(1)``: one launch more per MoE layer.)

Pairs are the fastest grid axis of the gate/up kernel (CUDA starts blocks in that order): the
programs of one row block of all pairs run together, so pairs that chose the same expert read
the same weight rows at about the same time, and all but the first read come from L2.

Expert offsets are computed in int64: K3's stacked W1 holds 896 x 3072 x 3584 = 9.9e9 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

ROWS = 16        # output rows per program: >= 1,500 programs for one K3 token, 64 for `small`
# the down kernel's [slots, rows, columns] tile: 4 x 4 x 128 for `small` (128 programs a token, as
# the per-pair kernel had), 16 x 1 x 128 for K3
DOWN_SUM_TILE = 2048
COLS = 128       # input columns per step: one 16-byte load of 8 bf16 per thread per row
NUM_WARPS = 4


@triton.jit
def _glu(gate, up, SITU: tl.constexpr, BETA1: tl.constexpr, BETA2: tl.constexpr):
    """fp32 gate, up -> SiTU-GLU (K3_SPEC §1.4: the sigmoid takes the uncapped gate) or SwiGLU."""
    if SITU:
        capped_up = BETA2 * libdevice.tanh(up / BETA2)
        h = BETA1 * libdevice.tanh(gate / BETA1) * tl.sigmoid(gate) * capped_up
    else:
        h = gate * tl.sigmoid(gate) * up
    return h


@triton.jit
def _gate_up_kernel(x_ptr, w1_ptr, w3_ptr, idx_ptr, h_ptr, F, D, K,
                    stride_xn, stride_xd, stride_we, stride_wf, stride_wd,
                    SITU: tl.constexpr, BETA1: tl.constexpr, BETA2: tl.constexpr,
                    ROWS: tl.constexpr, COLS: tl.constexpr):
    pair = tl.program_id(0)
    expert = tl.load(idx_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // K).to(tl.int64) * stride_xn
    f = tl.program_id(1) * ROWS + tl.arange(0, ROWS)                 # [ROWS]
    w_rows = expert * stride_we + f[:, None].to(tl.int64) * stride_wf  # [ROWS, 1]
    acc_gate = tl.zeros([ROWS, COLS], dtype=tl.float32)
    acc_up = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for d0 in range(0, D, COLS):
        d = d0 + tl.arange(0, COLS)                                  # [COLS]
        x = tl.load(x_row + d * stride_xd, mask=d < D, other=0.0).to(tl.float32)
        mask = (f[:, None] < F) & (d[None, :] < D)
        offs = w_rows + d[None, :] * stride_wd
        acc_gate += tl.load(w1_ptr + offs, mask=mask, other=0.0).to(tl.float32) * x[None, :]
        acc_up += tl.load(w3_ptr + offs, mask=mask, other=0.0).to(tl.float32) * x[None, :]
    h = _glu(tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1), SITU, BETA1, BETA2)
    tl.store(h_ptr + pair.to(tl.int64) * F + f, h, mask=f < F)


@triton.jit
def _down_sum_kernel(h_ptr, w2_ptr, idx_ptr, weight_ptr, y_ptr, F, D, K,
                     stride_we, stride_wd, stride_wf,
                     K_POW2: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """y[t, d] = sum_j w_j W2[e_j][d] h_j over token t's K slots: the K experts' rows in one
    [K, ROWS, COLS] tile, so the slots' loads are issued together (a loop over the slots, tried
    in the eleventh session, ran them one after another)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_POW2)                                         # [K_POW2] slots
    j_ok = j < K
    pair = t * K + j
    expert = tl.load(idx_ptr + pair, mask=j_ok, other=0).to(tl.int64)
    w = tl.load(weight_ptr + pair, mask=j_ok, other=0.0).to(tl.float32)
    d = tl.program_id(1) * ROWS + tl.arange(0, ROWS)                 # [ROWS]
    w_rows = (expert[:, None, None] * stride_we
              + d[None, :, None].to(tl.int64) * stride_wd)            # [K_POW2, ROWS, 1]
    row_ok = j_ok[:, None, None] & (d < D)[None, :, None]
    acc = tl.zeros([K_POW2, ROWS, COLS], dtype=tl.float32)
    for f0 in range(0, F, COLS):
        f = f0 + tl.arange(0, COLS)                                  # [COLS]
        h = tl.load(h_ptr + pair[:, None] * F + f[None, :], mask=j_ok[:, None] & (f < F)[None, :], other=0.0)
        w2 = tl.load(w2_ptr + w_rows + f[None, None, :] * stride_wf,
                     mask=row_ok & (f < F)[None, None, :], other=0.0)
        acc += w2.to(tl.float32) * h[:, None, :]
    y = tl.sum(tl.sum(acc, axis=2) * w[:, None], axis=0)            # [ROWS]
    tl.store(y_ptr + t * D + d, y, mask=d < D)


def moe_gemv_triton(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                    topk_idx: torch.Tensor, topk_weight: torch.Tensor, *, hidden_act: str,
                    situ_beta1: float, situ_beta2: float) -> torch.Tensor:
    """``moe_gemv`` on CUDA; arguments as its, already validated. Returns ``[N, D]`` fp32."""
    N, D = x.shape
    F = w1.shape[1]
    k = topk_idx.shape[1]
    P = N * k
    experts = topk_idx.contiguous().view(P)                          # no copy: the router's
    weights = topk_weight.contiguous().view(P)                       # outputs are contiguous
    h = torch.empty(P, F, device=x.device, dtype=torch.float32)
    y = torch.empty(N, D, device=x.device, dtype=torch.float32)
    _gate_up_kernel[(P, triton.cdiv(F, ROWS))](
        x, w1, w3, experts, h, F, D, k, *x.stride(), *w1.stride(),
        SITU=hidden_act == "situ", BETA1=situ_beta1, BETA2=situ_beta2,
        ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS)
    k_pow2 = triton.next_power_of_2(k)
    rows = max(1, DOWN_SUM_TILE // (k_pow2 * COLS))
    _down_sum_kernel[(N, triton.cdiv(D, rows))](
        h, w2, experts, weights, y, F, D, k, *w2.stride(),
        K_POW2=k_pow2, ROWS=rows, COLS=COLS, num_warps=NUM_WARPS)
    return y


# ``combine_pairs`` without autograd (prefill): tokens per program and the widest column tile
COMBINE_TOKENS = 8
COMBINE_COLS = 512


@triton.jit(do_not_specialize=["N"])  # token counts vary from pass to pass: one compile for all
def _combine_kernel(ys_ptr, position_ptr, weight_ptr, out_ptr, N, D, stride_ys, stride_out,
                    K: tl.constexpr, TOKENS: tl.constexpr, COLS: tl.constexpr):
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)             # [TOKENS]
    d = tl.program_id(1) * COLS + tl.arange(0, COLS)                 # [COLS]
    t_ok = t < N
    mask = t_ok[:, None] & (d[None, :] < D)
    acc = tl.zeros([TOKENS, COLS], dtype=tl.float32)
    for j in tl.static_range(K):  # the token's k slots in choice order: the reference's sum
        pair = t.to(tl.int64) * K + j
        row = tl.load(position_ptr + pair, mask=t_ok, other=0).to(tl.int64)
        w = tl.load(weight_ptr + pair, mask=t_ok, other=0.0).to(tl.float32)
        y = tl.load(ys_ptr + row[:, None] * stride_ys + d[None, :], mask=mask, other=0.0)
        acc += y.to(tl.float32) * w[:, None]
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_out + d[None, :], acc, mask=mask)


def combine_pairs_triton(ys: torch.Tensor, position: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """``openk3.ops.moe.combine_pairs`` in one kernel: ys [N k, D] (rows in expert order, unit
    column stride), ``position`` [N k] the row of each flat (token, choice) pair, topk_weight
    [N, k]. Returns [N, D] fp32."""
    N, k = topk_weight.shape
    D = ys.shape[1]
    out = torch.empty(N, D, device=ys.device, dtype=torch.float32)
    cols = min(COMBINE_COLS, triton.next_power_of_2(D))
    _combine_kernel[(triton.cdiv(N, COMBINE_TOKENS), triton.cdiv(D, cols))](
        ys, position.contiguous(), topk_weight.contiguous(), out, N, D, ys.stride(0), out.stride(0),
        K=k, TOKENS=COMBINE_TOKENS, COLS=cols, num_warps=4)
    return out


# ``group_pairs`` without autograd: the expert order of the (token, choice) pairs as two kernels
# over blocks of ``route_block(E)`` pairs, each block's one-hot [block, E] tile in registers. A block
# tile and the second kernel's tile of every block's histogram [blocks, E] stay within
# ROUTE_MAX_TILE elements (``route_fits``): `small`'s 64 experts up to 65,536 pairs.
ROUTE_MAX_TILE = 16384


def route_block(num_experts: int) -> int:
    """Pairs per block of the routing kernels: 256 for up to 64 experts, fewer for more."""
    return max(16, min(256, ROUTE_MAX_TILE // triton.next_power_of_2(num_experts)))


def route_fits(num_pairs: int, num_experts: int) -> bool:
    """Whether ``group_pairs_triton`` takes ``num_pairs`` pairs over ``num_experts`` experts."""
    e_pow2 = triton.next_power_of_2(num_experts)
    blocks = triton.cdiv(num_pairs, route_block(num_experts))
    return 0 < num_pairs and triton.next_power_of_2(blocks) * e_pow2 <= ROUTE_MAX_TILE


@triton.jit(do_not_specialize=["P"])
def _route_count_kernel(idx_ptr, hist_ptr, P, E_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """hist[b, e]: the pairs of block b that chose expert e."""
    b = tl.program_id(0)
    p = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(idx_ptr + p, mask=p < P, other=-1)
    experts = tl.arange(0, E_POW2)
    onehot = (e[:, None] == experts[None, :]).to(tl.int32)           # [BLOCK, E_POW2]
    tl.store(hist_ptr + b * E_POW2 + experts, tl.sum(onehot, axis=0))


@triton.jit(do_not_specialize=["P", "NB"])
def _route_place_kernel(idx_ptr, hist_ptr, position_ptr, token_ptr, counts_ptr, ends_ptr, P, E, NB, K,
                        E_POW2: tl.constexpr, NB_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """Each pair's row in expert order (experts ascending, pairs in index order within one: the
    stable sort) and each row's token; block 0 also writes the counts and their running sums."""
    b = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    blocks = tl.arange(0, NB_POW2)
    hist = tl.load(hist_ptr + blocks[:, None] * E_POW2 + experts[None, :],
                   mask=blocks[:, None] < NB, other=0)                   # [NB_POW2, E_POW2]
    counts = tl.sum(hist, axis=0)                                        # [E_POW2]
    ends = tl.cumsum(counts, axis=0)
    before = tl.sum(tl.where(blocks[:, None] < b, hist, 0), axis=0)      # this expert's pairs in earlier blocks
    if b == 0:
        tl.store(counts_ptr + experts, counts.to(tl.int64), mask=experts < E)
        tl.store(ends_ptr + experts, ends, mask=experts < E)
    p = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(idx_ptr + p, mask=p < P, other=-1)
    onehot = e[:, None] == experts[None, :]                              # [BLOCK, E_POW2]
    rank = tl.cumsum(onehot.to(tl.int32), axis=0)                        # 1 + earlier pairs of e in the block
    row = rank + (ends - counts + before - 1)[None, :]
    position = tl.sum(tl.where(onehot, row, 0), axis=1).to(tl.int64)    # [BLOCK]
    tl.store(position_ptr + p, position, mask=p < P)
    tl.store(token_ptr + position, (p // K).to(tl.int64), mask=p < P)


def group_pairs_triton(topk_idx: torch.Tensor, num_experts: int, tile_rows: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``openk3.ops.moe.group_pairs`` in two kernels, for ``route_fits`` sizes: topk_idx [N, k]
    integer expert ids in [0, num_experts). Returns (position [N k] int64, token_of_row [N k]
    int64, counts [E] int64, ends [E] int32). ``tile_rows``: the blocks of pairs the second
    kernel's histogram tile holds (a power of two, at least the blocks there are; None: the widest
    ``route_fits`` allows, one compile for every size); ``moe_route_bench.py`` compares the two."""
    N, k = topk_idx.shape
    P, E, dev = N * k, num_experts, topk_idx.device
    if not route_fits(P, E):  # the kernel's histogram tile would miss blocks: wrong rows, stray writes
        raise ValueError(f"group_pairs_triton: {P} pairs over {E} experts exceed the routing tile "
                         f"(route_fits); use openk3.ops.moe.group_pairs")
    e_pow2, block = triton.next_power_of_2(E), route_block(E)
    nb = triton.cdiv(P, block)
    idx = topk_idx.contiguous().view(P)
    hist = torch.empty(nb, e_pow2, dtype=torch.int32, device=dev)
    position = torch.empty(P, dtype=torch.int64, device=dev)
    token = torch.empty(P, dtype=torch.int64, device=dev)
    counts = torch.empty(E, dtype=torch.int64, device=dev)
    ends = torch.empty(E, dtype=torch.int32, device=dev)
    _route_count_kernel[(nb,)](idx, hist, P, E_POW2=e_pow2, BLOCK=block, num_warps=4)
    # the histogram tile as wide as ``route_fits`` allows, whatever nb is: one compile for every
    # size (a tile of next_power_of_2(nb) rows compiled anew for each power of two that a serving
    # pass of a new length met, ~0.3 s inside a step)
    rows = ROUTE_MAX_TILE // e_pow2 if tile_rows is None else tile_rows
    if rows < nb or rows & (rows - 1):
        raise ValueError(f"group_pairs_triton: tile_rows = {rows} must be a power of two >= the {nb} blocks")
    _route_place_kernel[(nb,)](idx, hist, position, token, counts, ends, P, E, nb, k, E_POW2=e_pow2,
                               NB_POW2=rows, BLOCK=block, num_warps=8)
    return position, token, counts, ends
