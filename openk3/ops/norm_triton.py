"""The Triton kernels behind ``openk3.ops.norm``'s RMSNorm (imported only on CUDA, or by the CPU
tests under Triton's interpreter).

``rms_norm_fwd_kernel``: one program per BLOCK_M rows of ``x [N, D]`` (a row whole in one
tile). Per row ``rstd = rsqrt(mean(x^2) + eps)`` in fp32 (kept for the backward), then the
reference's roundings: the normalised row rounded to x's dtype, times the weight rounded to the
product's dtype (``ROUND_PRODUCT``: when x and the weight are both 16-bit floats),
stored in y's dtype.

``rms_norm_bwd_kernel``: the derivative of the norm without its roundings (what inductor's
fusion of the reference computes: the weight's gradient ~1e-7 from fp32's, where autograd
through the reference's rounded ``xhat`` is ~2e-3 from it at `small`'s shape), in one pass over
x and dy. Each program walks row blocks ``pid, pid + P, ...`` and keeps its share of the
weight's gradient (the column sums of ``dy * xhat``) in fp32 registers, written once as a row
of ``dw_partial [P, D]``, which ``column_sum_kernel`` sums in a fixed order (no atomics: the
same bits on every run on one GPU model; P follows the SM count, so another model may group the
sums differently): the DRAM traffic is x and dy read and dx written.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, D, eps,
                        ROUND_PRODUCT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    tl.store(rstd_ptr + rows, rstd, mask=rows < N)
    xhat = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = xhat * w[None, :]
    if ROUND_PRODUCT:  # x and w both bf16 (or fp16): the product is rounded before any cast
        y = y.to(x_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_bwd_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_ptr, N, D,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for block in range(pid, tl.cdiv(N, BLOCK_M), programs):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < N)[:, None] & col_ok[None, :]
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < N, other=0.0)
        xhat = x * rstd[:, None]
        dw += tl.sum(dy * xhat, axis=0)
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / D
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid.to(tl.int64) * D + cols, dw, mask=col_ok)


@triton.jit
def column_sum_kernel(x_ptr, y_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """y[c] = sum_r x[r, c] for a contiguous fp32 x [R, C], in row order (deterministic)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        acc += tl.sum(tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0), axis=0)
    tl.store(y_ptr + cols, acc.to(y_ptr.dtype.element_ty), mask=cols < C)
