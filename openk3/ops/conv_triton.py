"""The Triton kernels behind ``openk3.ops.conv`` (imported only on CUDA).

``conv_fwd_kernel`` / ``conv_bwd_kernel``: training's convolution (``causal_conv1d`` without a
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


# The short convolution of training (no state in, one sequence per batch row): a forward, and a
# backward in one pass that recomputes the pre-activation at the four positions whose outputs
# read x[t]; one program per (block of BLOCK_T positions, block of BLOCK_C channels, row b). A
# position's taps are loads of the same tile shifted by one row, which the caches serve: the
# DRAM traffic is x read and y written (forward), x and dy read and dx written (backward).
# Measured at `small`'s shape on the H200 (docs/benchmarks.md, fifteenth session): forward
# ~28 us (floor 15.6); backward 115 us in the training step with 16x64 tiles, 137 against 154 us
# for 16x32 and 16x64 tiles in `benchmarks/conv_speed.py` (floor 23.4); fla's backward ~148 us
# plus its ~25 us forward recomputation. A two-pass backward (da written in fp32, then dx)
# measured slower: its first pass alone took ~129 us, so the per-block dw sums (four reductions
# across positions) look like the bound, not the four sigmoids. Hence ITERS: a program walks
# ITERS blocks and accumulates dw elementwise, reducing once (ITERS = 1 keeps the measured
# kernel's per-block sums; larger ones are for ``conv_speed.py`` to measure: not run on a GPU
# yet). The backward is written for K3's W = 4 taps (``causal_conv1d`` sends other widths to fla).


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
def conv_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, T, C, stride_xb, stride_xt,
                    stride_dyb, stride_dyt, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                    ITERS: tl.constexpr):
    """W = 4 taps, ITERS consecutive blocks of BLOCK_T positions per program. dx[t] = sum_s
    w[3-s] da[t+s], da = dy silu'(a), from the seven tiles x[t-3 .. t+3] each loaded once; the
    program's share of dw[c, j] = sum_t da[t] x[t-3+j], accumulated elementwise over its blocks
    and summed over positions once, goes to row (b, program) of dw_ptr ``[B * programs, 4, C]``
    fp32."""
    b = tl.program_id(2).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    xb, dyb = x_ptr + b * stride_xb, dy_ptr + b * stride_dyb
    w0 = tl.load(w_ptr + c * 4, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    w1 = tl.load(w_ptr + c * 4 + 1, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + c * 4 + 2, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    w3 = tl.load(w_ptr + c * 4 + 3, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    part = dw_ptr + (b * tl.num_programs(0) + tl.program_id(0)) * 4 * C + c
    dw0 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    dw1 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    dw3 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for it in range(ITERS):
        t = (tl.program_id(0) * ITERS + it) * BLOCK_T + tl.arange(0, BLOCK_T)
        x0 = _tap(xb, t - 3, c, c_ok, T, stride_xt)
        x1 = _tap(xb, t - 2, c, c_ok, T, stride_xt)
        x2 = _tap(xb, t - 1, c, c_ok, T, stride_xt)
        x3 = _tap(xb, t, c, c_ok, T, stride_xt)
        da = _dsilu(w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3, _tap(dyb, t, c, c_ok, T, stride_dyt))
        if ITERS == 1:  # the measured kernel: the block's sums at once, no accumulator registers
            tl.store(part, tl.sum(da * x0, axis=0), mask=c_ok)
            tl.store(part + C, tl.sum(da * x1, axis=0), mask=c_ok)
            tl.store(part + 2 * C, tl.sum(da * x2, axis=0), mask=c_ok)
            tl.store(part + 3 * C, tl.sum(da * x3, axis=0), mask=c_ok)
        else:
            dw0 += da * x0
            dw1 += da * x1
            dw2 += da * x2
            dw3 += da * x3
        dx = w3 * da
        x4 = _tap(xb, t + 1, c, c_ok, T, stride_xt)
        dx += w2 * _dsilu(w0 * x1 + w1 * x2 + w2 * x3 + w3 * x4, _tap(dyb, t + 1, c, c_ok, T, stride_dyt))
        x5 = _tap(xb, t + 2, c, c_ok, T, stride_xt)
        dx += w1 * _dsilu(w0 * x2 + w1 * x3 + w2 * x4 + w3 * x5, _tap(dyb, t + 2, c, c_ok, T, stride_dyt))
        x6 = _tap(xb, t + 3, c, c_ok, T, stride_xt)
        dx += w0 * _dsilu(w0 * x3 + w1 * x4 + w2 * x5 + w3 * x6, _tap(dyb, t + 3, c, c_ok, T, stride_dyt))
        rows = (b * T + t).to(tl.int64)
        tl.store(dx_ptr + rows[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=(t < T)[:, None] & c_ok[None, :])
    if ITERS > 1:
        tl.store(part, tl.sum(dw0, axis=0), mask=c_ok)
        tl.store(part + C, tl.sum(dw1, axis=0), mask=c_ok)
        tl.store(part + 2 * C, tl.sum(dw2, axis=0), mask=c_ok)
        tl.store(part + 3 * C, tl.sum(dw3, axis=0), mask=c_ok)


