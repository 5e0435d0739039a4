"""The Triton kernel behind ``openk3.ops.conv.causal_conv1d_update_`` (imported only on CUDA).

One program per (row b, block of BLOCK_C channels). It reads row b's state from the pool at
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
