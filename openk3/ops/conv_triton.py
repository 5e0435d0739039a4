"""The Triton kernels behind ``openk3.ops.conv`` (imported only on CUDA).

``conv_fwd_kernel`` / ``conv_bwd_walk_kernel``: training's convolution (``causal_conv1d`` without a
state or ``cu_seqlens``), described above them.

``conv_update_kernel`` (``causal_conv1d_update_``): one program per (row b, block of BLOCK_C
channels). It reads row b's state from the pool at
``slots[b]`` (the W-1 inputs before this token, oldest first), convolves them and the token's
input with the channel's W taps in fp32, writes ``silu`` of the sum to row b of its part of
``y`` (``[C / part, B, part]``, i.e. ``[parts, B, C / parts]``: q, k and v each contiguous), and writes the
shifted state (the last W-1 inputs: the old state's newest W-2 and the token) back to the same
pool row: no gather or scatter of states around it (fla's ``causal_conv1d_update`` takes a
contiguous batch of states, not a pool and indices).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def conv_update_kernel(x_ptr, w_ptr, pool_ptr, slots_ptr, y_ptr, B, C, part, stride_x, stride_pool,
                       W: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    state = pool_ptr + slot * stride_pool + c * (W - 1)             # row slot, channels c: [W-1] each
    x = tl.load(x_ptr + b * stride_x + c, mask=ok, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + c * W + (W - 1), mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):                                # tap j reads the input W-1-j back
        s = tl.load(state + j, mask=ok, other=0.0)
        acc += s.to(tl.float32) * tl.load(w_ptr + c * W + j, mask=ok, other=0.0).to(tl.float32)
        if j > 0:                                                   # every column moves one older
            tl.store(state + j - 1, s, mask=ok)
    tl.store(state + (W - 2), x.to(pool_ptr.dtype.element_ty), mask=ok)
    y = acc * tl.sigmoid(acc)
    # y is [C // part, B, part] (parts x rows x channels of a part): q, k, v each a contiguous [B, part]
    tl.store(y_ptr + (c // part) * B * part + b * part + c % part, y.to(y_ptr.dtype.element_ty), mask=ok)


# The short convolution of training (no state in, one sequence per batch row). Forward: one
# program per (block of BLOCK_T positions, block of BLOCK_C channels, row b); a position's taps
# are loads of the same tile shifted by one row, which the caches serve, so the DRAM traffic is x
# read and y written. Backward (``conv_bwd_walk_kernel``): a program walks its positions in
# order. Measured at `small`'s shape on the H200 (`benchmarks/conv_speed.py`, docs/benchmarks.md,
# nineteenth session; floors at ~4.3 TB/s: forward 15.6 us, backward 23.4 us): forward ~31 us;
# backward 77.8 us (16 positions x 128 channels, 1 warp; 40 us a call in the graphed training
# step) where the tiled backward it replaced, which recomputed the pre-activation at the four
# positions whose outputs read x[t], took 138 us, and fla's 206 us. Written for K3's W = 4 taps
# (``causal_conv1d`` sends other widths to fla).


@triton.jit
def _tap(ptr, t, c, c_ok, T, stride_t):
    """The tile at positions t (zeros outside 0 .. T-1) and channels c, in fp32."""
    ok = ((t >= 0) & (t < T))[:, None] & c_ok[None, :]
    return tl.load(ptr + t[:, None].to(tl.int64) * stride_t + c[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _preactivation(xb, w_ptr, t, c, c_ok, T, stride_xt, W: tl.constexpr):
    """a[t, c] = sum_j w[c, j] x[t - (W-1) + j, c] in fp32 (zeros before 0 and from T on)."""
    a = tl.zeros([t.shape[0], c.shape[0]], dtype=tl.float32)
    for j in tl.static_range(W):
        w = tl.load(w_ptr + c * W + j, mask=c_ok, other=0.0).to(tl.float32)
        a += _tap(xb, t - (W - 1) + j, c, c_ok, T, stride_xt) * w[None, :]
    return a


@triton.jit
def conv_fwd_kernel(x_ptr, w_ptr, y_ptr, T, C, stride_xb, stride_xt,
                    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    a = _preactivation(x_ptr + b * stride_xb, w_ptr, t, c, c_ok, T, stride_xt, W)
    y = a * tl.sigmoid(a)
    rows = (b * T + t).to(tl.int64)
    tl.store(y_ptr + rows[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & c_ok[None, :])


@triton.jit
def _dsilu(a, dy):
    sig = tl.sigmoid(a)
    return dy * sig * (1.0 + a * (1.0 - sig))


@triton.jit
def _row(ptr, t, stride_t, c_ok, T):
    """Position t's row (zeros outside 0 .. T-1) of ``ptr`` (already at the row's channels), fp32."""
    return tl.load(ptr + t.to(tl.int64) * stride_t, mask=c_ok & (t >= 0) & (t < T), other=0.0).to(tl.float32)


@triton.jit
def conv_bwd_walk_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, T, C, stride_xb, stride_xt,
                         stride_dyb, stride_dyt, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """W = 4 taps. A program walks its BLOCK_T positions in order, one row of BLOCK_C channels at a
    time, keeping the last three inputs and the last three da = dy silu'(a) in registers: each
    input and each dy is loaded once (plus a three-row halo), each da computed once, and
    dx[t-3] = w3 da[t-3] + w2 da[t-2] + w1 da[t-1] + w0 da[t] leaves as soon as da[t] exists. The
    program's dw[c, j] = sum_t da[t] x[t-3+j] accumulates per channel (no reduction across
    threads) and goes to row (b, program) of dw_ptr ``[B * programs, 4, C]`` fp32."""
    b = tl.program_id(2).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    t0 = tl.program_id(0) * BLOCK_T
    xb, dyb = x_ptr + b * stride_xb + c, dy_ptr + b * stride_dyb + c
    w0 = tl.load(w_ptr + c * 4, mask=c_ok, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + c * 4 + 1, mask=c_ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + c * 4 + 2, mask=c_ok, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + c * 4 + 3, mask=c_ok, other=0.0).to(tl.float32)
    # x[t-3], x[t-2], x[t-1] and da[t-3], da[t-2], da[t-1] for t = t0 (the da before t0 are
    # never used: dx is stored from t0 on)
    x1 = _row(xb, t0 - 3, stride_xt, c_ok, T)
    x2 = _row(xb, t0 - 2, stride_xt, c_ok, T)
    x3 = _row(xb, t0 - 1, stride_xt, c_ok, T)
    d1 = tl.zeros([BLOCK_C], dtype=tl.float32)
    d2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    d3 = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw0 = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw1 = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw3 = tl.zeros([BLOCK_C], dtype=tl.float32)
    # the rows of positions t, t+1, t+2: each row is loaded three steps before it is used, so
    # its load is in flight while the steps between run (their dx stores included)
    xa = _row(xb, t0, stride_xt, c_ok, T)
    xn = _row(xb, t0 + 1, stride_xt, c_ok, T)
    xm = _row(xb, t0 + 2, stride_xt, c_ok, T)
    ga = _row(dyb, t0, stride_dyt, c_ok, T)
    gn = _row(dyb, t0 + 1, stride_dyt, c_ok, T)
    gm = _row(dyb, t0 + 2, stride_dyt, c_ok, T)
    for i in tl.static_range(BLOCK_T + 3):
        t = t0 + i
        x4, dy = xa, ga
        if i < BLOCK_T:
            xa, xn, xm = xn, xm, _row(xb, t + 3, stride_xt, c_ok, T)
            ga, gn, gm = gn, gm, _row(dyb, t + 3, stride_dyt, c_ok, T)
        else:
            xa, xn, ga, gn = xn, xm, gn, gm
        da = _dsilu(w0 * x1 + w1 * x2 + w2 * x3 + w3 * x4, dy)
        if i < BLOCK_T:
            dw0 += da * x1
            dw1 += da * x2
            dw2 += da * x3
            dw3 += da * x4
        if i >= 3:
            dx = w3 * d1 + w2 * d2 + w1 * d3 + w0 * da
            tl.store(dx_ptr + (b * T + t - 3) * C + c, dx.to(dx_ptr.dtype.element_ty), mask=c_ok & (t - 3 < T))
        x1, x2, x3 = x2, x3, x4
        d1, d2, d3 = d2, d3, da
    part = dw_ptr + (b * tl.num_programs(0) + tl.program_id(0)) * 4 * C + c
    tl.store(part, dw0, mask=c_ok)
    tl.store(part + C, dw1, mask=c_ok)
    tl.store(part + 2 * C, dw2, mask=c_ok)
    tl.store(part + 3 * C, dw3, mask=c_ok)


# The serving prefill's convolution (no autograd): N sequences packed in x [T, C], each continuing
# from its state [N, C, W-1] (the W-1 inputs before it, oldest first). ``conv_varlen_fwd_kernel``
# tiles positions x channels like the training forward (its output [C / CP, T, CP]: q, k and v
# each contiguous, as fla's KDA reads them, for CP = C / 3); a tap that reaches before its sequence's
# first token reads the sequence's state (or zero without one). ``conv_varlen_state_kernel``
# writes each sequence's new state: its last W-1 inputs, reaching into the old state when it is
# shorter than W-1. Only the tiles holding one of a sequence's first W-1 positions read the state
# (a branch on the tile), and a program's taps are 32-bit offsets from its first row: at `small`'s
# layer and 32K tokens 230 us at (16, 128, 4) against 441 us before and fla's 341 (floor ~94;
# `benchmarks/conv_speed.py --varlen`, twenty-fourth session).


@triton.jit
def conv_varlen_fwd_kernel(x_ptr, w_ptr, y_ptr, state_ptr, seq_ptr, cu_ptr, T, C, stride_xt,
                           CP: tl.constexpr, HAS_STATE: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_C: tl.constexpr, ROW_ALIGN: tl.constexpr):
    t0 = tl.program_id(0) * BLOCK_T
    dt = tl.arange(0, BLOCK_T)                                       # positions t0 + dt
    t = t0 + dt
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok, c_ok = t < T, c < C
    seq = tl.load(seq_ptr + t, mask=t_ok, other=0)
    start = tl.load(cu_ptr + seq, mask=t_ok, other=0)
    xb = x_ptr + t0.to(tl.int64) * stride_xt                         # the program's first row: the
    a = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)               # taps' offsets fit 32 bits
    for j in tl.static_range(W):
        w = tl.load(w_ptr + c * W + j, mask=c_ok, other=0.0).to(tl.float32)
        dp = dt - (W - 1) + j                                        # the input this tap reads
        in_x = (t_ok & (t0 + dp >= start))[:, None] & c_ok[None, :]
        row = tl.multiple_of(dp * stride_xt, ROW_ALIGN)  # vector loads along a row need to know it
        tap = tl.load(xb + row[:, None] + c[None, :], mask=in_x, other=0.0).to(tl.float32)
        a += tap * w[None, :]
    if HAS_STATE:  # only tiles holding one of a sequence's first W-1 positions read the state
        if tl.max((t_ok & (t - start < W - 1)).to(tl.int32), axis=0) > 0:
            for j in tl.static_range(W - 1):                         # the last tap is the token itself
                w = tl.load(w_ptr + c * W + j, mask=c_ok, other=0.0).to(tl.float32)
                p = t - (W - 1) + j
                in_state = (t_ok & (p < start))[:, None] & c_ok[None, :]
                col = p - start + (W - 1)                            # column of the sequence's state
                tap = tl.load(state_ptr + (seq[:, None].to(tl.int64) * C + c[None, :]) * (W - 1) + col[:, None],
                              mask=in_state, other=0.0).to(tl.float32)
                a += tap * w[None, :]
    y = a * tl.sigmoid(a)
    # y is [C / CP, T, CP]: channel c of position t goes to part c // CP, each part contiguous
    part = (c // CP).to(tl.int64) * T * CP + c % CP
    yb = y_ptr + t0.to(tl.int64) * CP
    tl.store(yb + (dt * CP)[:, None] + part[None, :], y.to(y_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def conv_varlen_state_kernel(x_ptr, state_ptr, new_ptr, cu_ptr, C, stride_xt,
                             HAS_STATE: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    start = tl.load(cu_ptr + n).to(tl.int64)
    length = tl.load(cu_ptr + n + 1).to(tl.int64) - start
    for i in tl.static_range(W - 1):
        e = length + i                                               # extended position: state first
        if e < W - 1:
            if HAS_STATE:
                v = tl.load(state_ptr + (n * C + c) * (W - 1) + e, mask=c_ok, other=0.0)
            else:
                v = tl.zeros([BLOCK_C], dtype=new_ptr.dtype.element_ty)
        else:
            v = tl.load(x_ptr + (start + e - (W - 1)) * stride_xt + c, mask=c_ok, other=0.0)
        tl.store(new_ptr + (n * C + c) * (W - 1) + i, v.to(new_ptr.dtype.element_ty), mask=c_ok)


# ``causal_conv1d_pooled``: T tokens per row after a state held in a pool, which is read and not
# written (the speculative verify step: which of the tokens stay is known only later). One program
# per (position t of row b, block of BLOCK_C channels); tap j reads x at position t - (W-1) + j, or,
# before the row's first token, the state's column at that offset (pool row ``slots[b]``). The taps
# are summed in ``conv_update_kernel``'s order (the token's own tap first), so a row's first output
# is bit for bit what a decode step would give.


@triton.jit
def conv_pooled_kernel(x_ptr, w_ptr, pool_ptr, slots_ptr, y_ptr, BT, T, C, part, stride_xb, stride_xt,
                       stride_pool, W: tl.constexpr, BLOCK_C: tl.constexpr):
    i = tl.program_id(0)                                            # i = b * T + t
    b, t = (i // T).to(tl.int64), i % T
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    x_row = x_ptr + b * stride_xb + c
    state = pool_ptr + slot * stride_pool + c * (W - 1)
    acc = tl.load(x_row + t * stride_xt, mask=ok, other=0.0).to(tl.float32) * \
        tl.load(w_ptr + c * W + (W - 1), mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        p = t - (W - 1) + j                                         # < 0: column p + W-1 of the state
        tap = tl.load(x_row + p * stride_xt, mask=ok & (p >= 0), other=0.0).to(tl.float32) + \
            tl.load(state + (p + W - 1), mask=ok & (p < 0), other=0.0).to(tl.float32)
        acc += tap * tl.load(w_ptr + c * W + j, mask=ok, other=0.0).to(tl.float32)
    y = acc * tl.sigmoid(acc)
    # y is [C // part, B*T, part]: q, k, v each a contiguous [B, T, part]
    tl.store(y_ptr + (c // part) * BT * part + i * part + c % part, y.to(y_ptr.dtype.element_ty), mask=ok)
