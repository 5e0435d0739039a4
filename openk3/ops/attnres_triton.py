"""The backward of one AttnRes read (``openk3.ops.attnres``) as one Triton kernel that adds each
sealed bank entry's gradient into that entry's accumulator instead of returning it.

Per row n (softmax over the L sources, ``p_l = exp(logit_l - lse)``, ``k_l = rstd_l v_l``,
``logit_l = <k_l, qw>`` with ``qw = q * w``, ``g`` the output's gradient):

    o     = sum_l p_l v_l                      (recomputed: the forward keeps only the stats)
    ds_l  = p_l (<v_l, g> - <o, g>)
    dv_l  = p_l g + ds_l rstd_l (qw - k_l logit_l / D)
    dqw  += ds_l k_l                           (summed over rows here, then over programs)

The forward's statistics (``rstd``, ``logit`` [L, N] fp32, ``lse`` [N]) are fla-core's
``attnres_fwd_kernel``'s. Sources whose bit in ``ACC`` is set have their ``dv`` added to what
``dsrc`` already holds (the accumulator of a sealed entry read by a later layer); the others are
written. Each program takes ``ROWS`` rows, so ``dqw`` leaves the kernel as ``N / ROWS`` partial
sums instead of an [N, D] fp32 tensor (fla's backward writes that, then reduces it in a second
kernel).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attnres_bwd_kernel(q, w, src, dsrc, rstd, logit, lse, do, dqw_partial, N,
                       D: tl.constexpr, BD: tl.constexpr, L: tl.constexpr, ACC: tl.constexpr,
                       ROWS: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    md = d < D
    qw = tl.load(q + d, mask=md, other=0.0).to(tl.float32) * tl.load(w + d, mask=md, other=0.0).to(tl.float32)
    dqw = tl.zeros([BD], dtype=tl.float32)
    for r in range(ROWS):
        n = pid.to(tl.int64) * ROWS + r
        if n < N:
            off = n * D + d
            g = tl.load(do + off, mask=md, other=0.0).to(tl.float32)
            lse_n = tl.load(lse + n)
            o = tl.zeros([BD], dtype=tl.float32)
            for i in tl.static_range(L):
                v = tl.load(src[i] + off, mask=md, other=0.0).to(tl.float32)
                o += tl.exp(tl.load(logit + i * N + n) - lse_n) * v
            delta = tl.sum(o * g, axis=0)
            for i in tl.static_range(L):
                v = tl.load(src[i] + off, mask=md, other=0.0).to(tl.float32)
                s = tl.load(logit + i * N + n)
                rs = tl.load(rstd + i * N + n)
                p = tl.exp(s - lse_n)
                ds = p * (tl.sum(v * g, axis=0) - delta)
                k = v * rs
                dv = p * g + (ds * rs) * (qw - k * (s / D))
                if (ACC >> i) & 1:
                    dv += tl.load(dsrc[i] + off, mask=md, other=0.0).to(tl.float32)
                tl.store(dsrc[i] + off, dv.to(dsrc[i].dtype.element_ty), mask=md)
                dqw += ds * k
    tl.store(dqw_partial + pid.to(tl.int64) * D + d, dqw, mask=md)
