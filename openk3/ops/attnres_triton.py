"""The backward of one AttnRes read (``openk3.ops.attnres``) as one Triton kernel that adds each
sealed bank entry's gradient into that entry's accumulator instead of returning it.

Per row n (softmax over the L sources, ``p_l = exp(logit_l - lse)``, ``k_l = rstd_l v_l``,
``logit_l = <k_l, qw>`` with ``qw = q * w``, ``g`` the output's gradient):

    delta = <o, g> = sum_l p_l <v_l, g>
    ds_l  = p_l (<v_l, g> - delta)
    dv_l  = p_l g + ds_l rstd_l (qw - k_l logit_l / D)
    dqw  += ds_l k_l                           (summed over rows here, then over programs)

The forward's statistics (``rstd``, ``logit`` [L, N] fp32, ``lse`` [N]) are fla-core's
``attnres_fwd_kernel``'s. Sources whose bit in ``ACC`` is set have their ``dv`` added to what
``dsrc`` already holds (the accumulator of a sealed entry read by a later layer); the others are
written. Each program takes ``ROWS`` rows, so ``dqw`` leaves the kernel as ``N / ROWS`` partial
sums instead of an [N, D] fp32 tensor (fla's backward writes that, then reduces it in a second
kernel).

A row's sources are loaded as tiles of ``BL`` sources x ``BD`` features. When one tile holds
them all (``BL >= L``: `small`'s reads) every source is read once, kept in registers while
``delta`` is reduced, and all its gradients come from those registers; otherwise (wide models)
a first pass over the tiles reduces ``delta`` and a second reads them again for the gradients.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pick(ptrs, o_l, L: tl.constexpr):
    """[BL] base pointers: ``ptrs[l]`` for each ``l`` in ``o_l`` below ``L``, ``ptrs[0]`` past it."""
    p = ptrs[0] + o_l * 0
    for i in tl.static_range(1, L):
        p = tl.where(o_l == i, ptrs[i], p)
    return p


@triton.jit
def _load_tile(src, logit, rstd, lse_n, g, o_l, n, N, off, md, L: tl.constexpr):
    """One tile's sources [BL, BD] (fp32), logits, rstds, softmax weights and ``<v_l, g>``."""
    ml = o_l < L
    v = tl.load(_pick(src, o_l, L)[:, None] + off[None, :], mask=ml[:, None] & md[None, :],
                other=0.0).to(tl.float32)
    s = tl.load(logit + o_l * N + n, mask=ml, other=0.0)
    rs = tl.load(rstd + o_l * N + n, mask=ml, other=0.0)
    p = tl.where(ml, tl.exp(s - lse_n), 0.0)
    return v, s, rs, p, tl.sum(v * g[None, :], axis=1)


@triton.jit
def _tile_grads(v, s, rs, p, vg, delta, g, qw, dsrc, o_l, off, md, D: tl.constexpr,
                L: tl.constexpr, ACC: tl.constexpr):
    """Write (or add into the accumulators of) one tile's source gradients; return its ``dqw``."""
    ml = o_l < L
    ds = p * (vg - delta)
    k = v * rs[:, None]
    dv = p[:, None] * g[None, :] + (ds * rs)[:, None] * (qw[None, :] - k * (s / D)[:, None])
    ptrs = _pick(dsrc, o_l, L)[:, None] + off[None, :]
    acc = (((o_l * 0 + ACC) >> o_l) & 1) == 1
    dv += tl.load(ptrs, mask=(ml & acc)[:, None] & md[None, :], other=0.0).to(tl.float32)
    tl.store(ptrs, dv.to(dsrc[0].dtype.element_ty), mask=ml[:, None] & md[None, :])
    return tl.sum(ds[:, None] * k, axis=0)


@triton.jit
def attnres_bwd_kernel(q, w, src, dsrc, rstd, logit, lse, do, dqw_partial, N,
                       D: tl.constexpr, BD: tl.constexpr, L: tl.constexpr, BL: tl.constexpr,
                       ACC: tl.constexpr, ROWS: tl.constexpr):
    NT: tl.constexpr = (L + BL - 1) // BL
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    md = d < D
    o_l = tl.arange(0, BL)
    qw = tl.load(q + d, mask=md, other=0.0).to(tl.float32) * tl.load(w + d, mask=md, other=0.0).to(tl.float32)
    dqw = tl.zeros([BD], dtype=tl.float32)
    for r in range(ROWS):
        n = pid.to(tl.int64) * ROWS + r
        if n < N:
            off = n * D + d
            g = tl.load(do + off, mask=md, other=0.0).to(tl.float32)
            lse_n = tl.load(lse + n)
            if NT == 1:
                v, s, rs, p, vg = _load_tile(src, logit, rstd, lse_n, g, o_l, n, N, off, md, L)
                delta = tl.sum(p * vg, axis=0)
                dqw += _tile_grads(v, s, rs, p, vg, delta, g, qw, dsrc, o_l, off, md, D, L, ACC)
            else:
                delta = 0.0
                for t in tl.static_range(NT):
                    v, s, rs, p, vg = _load_tile(src, logit, rstd, lse_n, g, t * BL + o_l, n, N, off, md, L)
                    delta += tl.sum(p * vg, axis=0)
                for t in tl.static_range(NT):
                    v, s, rs, p, vg = _load_tile(src, logit, rstd, lse_n, g, t * BL + o_l, n, N, off, md, L)
                    dqw += _tile_grads(v, s, rs, p, vg, delta, g, qw, dsrc, t * BL + o_l, off, md, D, L, ACC)
    tl.store(dqw_partial + pid.to(tl.int64) * D + d, dqw, mask=md)
