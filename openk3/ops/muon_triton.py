"""The Triton kernels behind ``openk3.ops.muon`` (imported only on CUDA, or by the CPU tests
under Triton's interpreter).

One program per tile of ``BR x BC`` elements of one matrix of a ``[n, r, c]`` block (program
axis 1 picks the matrix), each operand addressed through its own three strides: a head's columns
(a transposed view) or a tall matrix iterated in its wide orientation are read in place. Every
operand is read once and written at most once. Automatic fp contraction is off: the momentum's
multiply and add round separately, as the reference's two passes do, and the two products that
torch's kernels may contract (``add`` with ``alpha`` does; ``addcmul``, ``a + v * b * c``, may
round ``b * c`` first: half an ulp of the update term) are explicit ``fma`` calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.fast import launch_device

BR, BC = 32, 64
SCALE_BLOCK = 4096


@triton.jit
def _offsets(R, C, BR: tl.constexpr, BC: tl.constexpr):
    tiles_c = tl.cdiv(C, BC)
    rows = (tl.program_id(0) // tiles_c) * BR + tl.arange(0, BR)
    cols = (tl.program_id(0) % tiles_c) * BC + tl.arange(0, BC)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    return rows.to(tl.int64)[:, None], cols.to(tl.int64)[None, :], mask


@triton.jit
def momentum_kernel(g_ptr, m_ptr, out_ptr, scale_ptr, R, C, g0, g1, g2, m0, m1, m2, o0, o1, o2, mu,
                    NESTEROV: tl.constexpr, SCALED: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    r, c, mask = _offsets(R, C, BR, BC)
    b = tl.program_id(1).to(tl.int64)
    g = tl.load(g_ptr + b * g0 + r * g1 + c * g2, mask=mask, other=0.0).to(tl.float32)
    if SCALED:  # gradient clipping's coefficient, as its own pass would have applied it
        g = (g * tl.load(scale_ptr).to(tl.float32)).to(g_ptr.dtype.element_ty).to(tl.float32)
    p_m = m_ptr + b * m0 + r * m1 + c * m2
    m = tl.load(p_m, mask=mask, other=0.0) * mu + g
    tl.store(p_m, m, mask=mask)
    out = tl.fma(m, mu, g) if NESTEROV else m  # contracted, as torch.add(g, m, alpha=mu) is
    tl.store(out_ptr + b * o0 + r * o1 + c * o2, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def apply_update_kernel(w_ptr, x_ptr, lr_ptr, decay, factor, wd, scale, R, C, w0, w1, w2, x0, x1, x2,
                        LR_IN_MEMORY: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    r, c, mask = _offsets(R, C, BR, BC)
    b = tl.program_id(1).to(tl.int64)
    if LR_IN_MEMORY:  # a 0-dim device tensor (the CUDA graphs): the factors as the reference's tensor ops
        lr = tl.load(lr_ptr).to(tl.float32)
        decay = 1.0 - lr * wd
        factor = -lr * scale
    p_w = w_ptr + b * w0 + r * w1 + c * w2
    w = tl.load(p_w, mask=mask, other=0.0)
    x = tl.load(x_ptr + b * x0 + r * x1 + c * x2, mask=mask, other=0.0).to(tl.float32)
    w = tl.fma(x, factor, w * decay)  # contracted, as add_(alpha=) is (addcmul_ may not be)
    tl.store(p_w, w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def scale_kernel(t_ptr, s_ptr, per, BLOCK: tl.constexpr):
    """t[n] *= s[n] for a contiguous [N, ...] t (``per`` elements a matrix), in fp32, rounded to
    t's dtype: a per-matrix factor as a vectorised pass (torch's broadcast of an [N, 1, 1]
    factor runs its non-vectorised kernel, at a third of the bandwidth or less)."""
    n = tl.program_id(0).to(tl.int64)  # axis 0: up to 2^31 - 1 matrices (axis 1 stops at 65,535)
    i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < per
    p = t_ptr + n * per + i
    v = tl.load(p, mask=ok, other=0.0).to(tl.float32) * tl.load(s_ptr + n).to(tl.float32)
    tl.store(p, v.to(t_ptr.dtype.element_ty), mask=ok)


def launch_scale(t: torch.Tensor, s: torch.Tensor) -> None:
    N = t.shape[0]
    per = t.numel() // max(N, 1)
    if t.numel():
        with launch_device(t):
            scale_kernel[(N, triton.cdiv(per, SCALE_BLOCK))](t, s, per, BLOCK=SCALE_BLOCK, num_warps=8)


def _grid(t: torch.Tensor) -> tuple[int, int]:
    n, R, C = t.shape
    if n > 65535:  # CUDA's limit on a grid's second axis
        raise ValueError(f"Muon's kernels take at most 65535 matrices a block, got {list(t.shape)}")
    return triton.cdiv(R, BR) * triton.cdiv(C, BC), n


def launch_momentum(g: torch.Tensor, m: torch.Tensor, out: torch.Tensor, mu: float, nesterov: bool,
                    grad_scale: torch.Tensor | None = None) -> None:
    if g.numel():
        with launch_device(g):
            momentum_kernel[_grid(g)](g, m, out, g if grad_scale is None else grad_scale, g.shape[1], g.shape[2],
                                      *g.stride(), *m.stride(), *out.stride(), mu, NESTEROV=nesterov,
                                      SCALED=grad_scale is not None, BR=BR, BC=BC, enable_fp_fusion=False)


def launch_apply_update(w: torch.Tensor, x: torch.Tensor, lr: float | torch.Tensor, wd: float, scale: float) -> None:
    if not w.numel():
        return
    in_memory = isinstance(lr, torch.Tensor)
    # host floats: the factors computed in double as the reference's Python scalars are
    decay, factor = (1.0, 0.0) if in_memory else (1 - lr * wd, -lr * scale)
    with launch_device(w):
        apply_update_kernel[_grid(w)](w, x, lr if in_memory else w, decay, factor, wd, scale, w.shape[1],
                                      w.shape[2], *w.stride(), *x.stride(), LR_IN_MEMORY=in_memory,
                                      BR=BR, BC=BC, enable_fp_fusion=False)
