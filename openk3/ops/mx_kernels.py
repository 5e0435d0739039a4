"""Triton kernels of ``openk3.ops.mx_moe``: routed experts straight from MXFP4-packed weights
(imported only on the CUDA fast path: CPU installs have no triton).

Hopper has no FP4 tensor cores, so every kernel reads the packed bytes and E8M0 scales and
dequantises in registers, then multiplies in fp32 (GEMV) or on the bf16 tensor cores (grouped GEMM).

Decoding a 4-bit code ``c`` (bit 3 the sign, bits 0-2 ``e1 e0 m``, K3_SPEC §2) costs a few integer
ops: moved to the fp16 bit pattern ``((c & 7) << 9) | ((c & 8) << 12)`` it lands in the low two
exponent bits and the top mantissa bit, which as an fp16 is exactly ``value * 2^-14`` (codes with
``e = 0``, i.e. 0 and 0.5, become fp16 subnormals, which the fp16 -> fp32 conversion keeps). The
``2^14`` goes back onto the other operand or is multiplied in before the scale, so every decoded
weight is exact in fp32 and the only rounding is the arithmetic that follows, as in the reference.
(Scale byte 0, ``2^-127``, is an fp32 subnormal: a GPU that flushes subnormal products would zero
the values under it, at most ``6 * 2^-127``. The quantiser gives byte 0 only to blocks whose
largest magnitude is below ``2^-124``: all-zero blocks, or weights no bf16 model holds.)

* ``mxfp4_moe_gemv_triton``: decode, one program per (token, slot) pair and ``ROWS`` output rows,
  as ``openk3.ops.moe_kernels`` (its structure and its GLU), three kernels, no host sync:
  1. ``_mx_gate_up_kernel``, grid (P, F / ROWS): ``h[p] = act(W1[e_p] x[t_p], W3[e_p] x[t_p])``;
  2. ``_mx_down_kernel``, grid (P, D / ROWS): ``y_pairs[p] = w_p W2[e_p] h[p]``;
  3. ``y = y_pairs.view(N, k, D).sum(1)`` (slot order: deterministic).
  A step reads ``BLOCKS`` whole MX blocks of each row: a ``[ROWS, BLOCKS, 16]`` tile of bytes (one
  16-byte load per block) and ``[ROWS, BLOCKS, 1]`` scales; products accumulate elementwise in
  fp32 and are reduced once at the end.
* ``mxfp4_grouped_triton``: prefill and large batches, rows sorted by expert. One program per
  ``BM`` rows of one expert and ``BN`` output columns; the tiles of all experts are numbered on the
  device (a cumulative sum and a ``searchsorted``; the grid is the static bound
  ``cdiv(P, BM) + min(E, P)``, programs past the last tile return at once), so nothing syncs.
  The packed ``[BK/2, BN]`` weight tile holds the even inputs in its low nibbles and the odd in its
  high ones: it is dequantised into two bf16 tiles, and the activations are read as their even
  and odd columns, so ``x W^T = x_even W_even^T + x_odd W_odd^T`` is two ``tl.dot`` of K = BK/2
  with no interleaving in registers. Pass 1 writes ``h = act(x W1^T, x W3^T)`` in the
  activations' dtype (the second GEMM's operand), pass 2 ``y = h W2^T`` in fp32.

Expert offsets are int64: K3's stacked packed W1 holds 896 x 3072 x 1792 = 4.9e9 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.moe_kernels import _glu
from openk3.ops.mx import fake_quant_mxfp8_e4m3

ROWS = 16        # GEMV: output rows per program, as the bf16 kernels
BLOCKS = 16      # GEMV: MX blocks (32 inputs, 16 bytes) per row per step: 256 bytes, 512 inputs
NUM_WARPS = 4
BM, BN, BK = 64, 64, 64  # grouped GEMM tile: rows, output columns, inputs (BK/2 bytes) per step
GEMM_WARPS, GEMM_STAGES = 4, 3


@triton.jit
def _fp4_pair(byte):
    """uint8 bytes -> (even, odd) element values times 2^-14, fp32, exact (module docstring)."""
    b = byte.to(tl.int32)
    lo = ((b & 0x07) << 9) | ((b & 0x08) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    return (lo.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32),
            hi.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _e8m0(scale_byte):
    """E8M0 bytes -> fp32 ``2^(s - 127)`` from its bit pattern, as ``openk3.ops.mx.e8m0_to_float``."""
    s = scale_byte.to(tl.int32)
    bits = tl.where(s == 0, 1 << 22, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mx_step(w_ptrs, s_ptrs, mask, v_even, v_odd):
    """One GEMV step: ``[ROWS, BLOCKS, 16]`` products of a tile of packed weights with the
    matching inputs (``v_even``, ``v_odd``: ``[1, BLOCKS, 16]``, already times 2^14), scaled."""
    lo, hi = _fp4_pair(tl.load(w_ptrs, mask=mask, other=0))
    return (lo * v_even + hi * v_odd) * _e8m0(tl.load(s_ptrs, mask=mask, other=0))


@triton.jit
def _mx_gate_up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, idx_ptr, h_ptr, F, D, K,
                       stride_xn, stride_xd, stride_we, stride_wf, stride_wd,
                       stride_se, stride_sf, stride_sd,
                       SITU: tl.constexpr, BETA1: tl.constexpr, BETA2: tl.constexpr,
                       ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    pair = tl.program_id(0)
    expert = tl.load(idx_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // K).to(tl.int64) * stride_xn
    f = tl.program_id(1) * ROWS + tl.arange(0, ROWS)                    # [ROWS]
    f3 = f[:, None, None]
    blk = tl.arange(0, BLOCKS)[None, :, None]                           # [1, BLOCKS, 1]
    j = tl.arange(0, 16)[None, None, :]                                 # byte in the block
    w_rows = expert * stride_we + f3.to(tl.int64) * stride_wf           # [ROWS, 1, 1]
    s_rows = expert * stride_se + f3.to(tl.int64) * stride_sf
    num_blocks = D // 32
    acc_gate = tl.zeros([ROWS, BLOCKS, 16], dtype=tl.float32)
    acc_up = tl.zeros([ROWS, BLOCKS, 16], dtype=tl.float32)
    for b0 in range(0, num_blocks, BLOCKS):
        b = b0 + blk
        in_d = b < num_blocks
        mask = (f3 < F) & in_d
        d_even = b * 32 + 2 * j                                         # [1, BLOCKS, 16]
        x_even = tl.load(x_row + d_even * stride_xd, mask=in_d, other=0.0).to(tl.float32) * 16384.0
        x_odd = tl.load(x_row + (d_even + 1) * stride_xd, mask=in_d, other=0.0).to(tl.float32) * 16384.0
        w_at = w_rows + (b * 16 + j) * stride_wd
        s_at = s_rows + b * stride_sd
        acc_gate += _mx_step(w1_ptr + w_at, s1_ptr + s_at, mask, x_even, x_odd)
        acc_up += _mx_step(w3_ptr + w_at, s3_ptr + s_at, mask, x_even, x_odd)
    gate = tl.sum(tl.sum(acc_gate, axis=2), axis=1)
    up = tl.sum(tl.sum(acc_up, axis=2), axis=1)
    h = _glu(gate, up, SITU, BETA1, BETA2)
    tl.store(h_ptr + pair.to(tl.int64) * F + f, h, mask=f < F)


@triton.jit
def _mx_down_kernel(h_ptr, w2_ptr, s2_ptr, idx_ptr, weight_ptr, y_ptr, F, D,
                    stride_we, stride_wd, stride_wf, stride_se, stride_sd, stride_sf,
                    ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    pair = tl.program_id(0)
    expert = tl.load(idx_ptr + pair).to(tl.int64)
    h_row = h_ptr + pair.to(tl.int64) * F
    d = tl.program_id(1) * ROWS + tl.arange(0, ROWS)                    # [ROWS]
    d3 = d[:, None, None]
    blk = tl.arange(0, BLOCKS)[None, :, None]
    j = tl.arange(0, 16)[None, None, :]
    w_rows = expert * stride_we + d3.to(tl.int64) * stride_wd
    s_rows = expert * stride_se + d3.to(tl.int64) * stride_sd
    num_blocks = F // 32
    acc = tl.zeros([ROWS, BLOCKS, 16], dtype=tl.float32)
    for b0 in range(0, num_blocks, BLOCKS):
        b = b0 + blk
        in_f = b < num_blocks
        f_even = b * 32 + 2 * j
        h_even = tl.load(h_row + f_even, mask=in_f, other=0.0) * 16384.0
        h_odd = tl.load(h_row + f_even + 1, mask=in_f, other=0.0) * 16384.0
        acc += _mx_step(w2_ptr + w_rows + (b * 16 + j) * stride_wf, s2_ptr + s_rows + b * stride_sf,
                        (d3 < D) & in_f, h_even, h_odd)
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * tl.load(weight_ptr + pair).to(tl.float32)
    tl.store(y_ptr + pair.to(tl.int64) * D + d, y, mask=d < D)


def mxfp4_moe_gemv_triton(x: torch.Tensor, w1, w3, w2, topk_idx: torch.Tensor,
                          topk_weight: torch.Tensor, *, hidden_act: str, situ_beta1: float,
                          situ_beta2: float, mxfp8_inputs: bool = False) -> torch.Tensor:
    """``mxfp4_moe_gemv`` on CUDA; arguments as its, already validated. Returns ``[N, D]`` fp32."""
    if mxfp8_inputs:
        x = fake_quant_mxfp8_e4m3(x)
    N, D = x.shape
    F = w1.packed.shape[1]
    k = topk_idx.shape[1]
    P = N * k
    experts = topk_idx.contiguous().view(P)
    weights = topk_weight.contiguous().view(P)
    h = torch.empty(P, F, device=x.device, dtype=torch.float32)
    y_pairs = torch.empty(P, D, device=x.device, dtype=torch.float32)
    _mx_gate_up_kernel[(P, triton.cdiv(F, ROWS))](
        x, w1.packed, w1.scale, w3.packed, w3.scale, experts, h, F, D, k, *x.stride(),
        *w1.packed.stride(), *w1.scale.stride(),
        SITU=hidden_act == "situ", BETA1=situ_beta1, BETA2=situ_beta2,
        ROWS=ROWS, BLOCKS=BLOCKS, num_warps=NUM_WARPS)
    if mxfp8_inputs:
        h = fake_quant_mxfp8_e4m3(h)
    _mx_down_kernel[(P, triton.cdiv(D, ROWS))](
        h, w2.packed, w2.scale, experts, weights, y_pairs, F, D,
        *w2.packed.stride(), *w2.scale.stride(), ROWS=ROWS, BLOCKS=BLOCKS, num_warps=NUM_WARPS)
    return y_pairs.view(N, k, D).sum(1)


@triton.jit
def _dequant_tile(w_ptrs, s_ptrs, mask):
    """A ``[BK/2, BN]`` tile of packed bytes and their scales -> (even-input, odd-input) fp32
    weight tiles ``[BK/2, BN]``, exact (a power-of-two scale times a 2-bit mantissa), so exact
    in bf16 too."""
    lo, hi = _fp4_pair(tl.load(w_ptrs, mask=mask, other=0))
    scale = _e8m0(tl.load(s_ptrs, mask=mask, other=0))
    return (lo * 16384.0) * scale, (hi * 16384.0) * scale


@triton.jit
def _mx_grouped_kernel(a_ptr, wa_ptr, sa_ptr, wb_ptr, sb_ptr, out_ptr,
                       tile_expert_ptr, tile_first_ptr, row_start_ptr, row_end_ptr,
                       N, K, E, stride_am, stride_ak,
                       stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om,
                       GLU: tl.constexpr, SITU: tl.constexpr, BETA1: tl.constexpr,
                       BETA2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``out[m] = act(a[m] Wa[e]^T, a[m] Wb[e]^T)`` (``GLU``) or ``a[m] Wa[e]^T`` for the rows m of
    tile ``program_id(0)``, all of expert e; W: packed ``[E, N, K/2]``, scales ``[E, N, K/32]``."""
    t = tl.program_id(0)
    e = tl.load(tile_expert_ptr + t)
    if e >= E:  # past the last tile of the batch (the grid is a static bound)
        return
    m_end = tl.load(row_end_ptr + e)
    m = tl.load(row_start_ptr + e) + (t - tl.load(tile_first_ptr + e)) * BM + tl.arange(0, BM)
    m_ok = m < m_end
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < N
    kb = tl.arange(0, BK // 2)                                          # byte in the K tile
    a_rows = a_ptr + m[:, None].to(tl.int64) * stride_am                # [BM, 1]
    w_cols = e.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn   # [1, BN]
    s_cols = e.to(tl.int64) * stride_se + n[None, :].to(tl.int64) * stride_sn
    acc_a = tl.zeros([BM, BN], dtype=tl.float32)
    acc_b = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        byte = k0 // 2 + kb                                             # [BK/2]
        k_ok = byte < K // 2
        a_mask = m_ok[:, None] & k_ok[None, :]
        a_even = tl.load(a_rows + (2 * byte)[None, :] * stride_ak, mask=a_mask, other=0.0)
        a_odd = tl.load(a_rows + (2 * byte + 1)[None, :] * stride_ak, mask=a_mask, other=0.0)
        w_at = w_cols + byte[:, None] * stride_wk                       # [BK/2, BN]
        s_at = s_cols + (byte // 16)[:, None] * stride_sk
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_even, w_odd = _dequant_tile(wa_ptr + w_at, sa_ptr + s_at, w_mask)
        # "ieee" matters for fp32 activations only (no TF32); bf16 ones ignore it
        acc_a = tl.dot(a_even, w_even.to(a_even.dtype), acc_a, input_precision="ieee")
        acc_a = tl.dot(a_odd, w_odd.to(a_even.dtype), acc_a, input_precision="ieee")
        if GLU:
            w_even, w_odd = _dequant_tile(wb_ptr + w_at, sb_ptr + s_at, w_mask)
            acc_b = tl.dot(a_even, w_even.to(a_even.dtype), acc_b, input_precision="ieee")
            acc_b = tl.dot(a_odd, w_odd.to(a_even.dtype), acc_b, input_precision="ieee")
    if GLU:
        out = _glu(acc_a, acc_b, SITU, BETA1, BETA2)
    else:
        out = acc_a
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _tiles(counts: torch.Tensor, num_rows: int):
    """Number the ``BM``-row tiles of every expert's rows on the device (no sync).

    Returns (T, the static bound on the tile count; tile -> expert [T] (E past the last tile);
    each expert's first tile, first row and end row [E])."""
    E = counts.numel()
    counts = counts.long()
    row_end = counts.cumsum(0)
    tiles = (counts + BM - 1) // BM
    tile_end = tiles.cumsum(0)
    T = triton.cdiv(num_rows, BM) + min(E, num_rows)  # at most one partial tile per used expert
    tile_expert = torch.searchsorted(tile_end, torch.arange(T, device=counts.device), right=True)
    return T, tile_expert, tile_end - tiles, row_end - counts, row_end


def _grouped_pass(a, wa, wb, tiling, out, act: dict) -> None:
    """One grouped GEMM over the tiles of ``tiling``: ``out = act(a Wa^T, a Wb^T)``, or
    ``a Wa^T`` when ``wb`` is None."""
    T, tile_expert, tile_first, row_start, row_end = tiling
    E, N = wa.packed.shape[:2]
    glu = wb is not None
    wb = wb if glu else wa  # an unread stand-in: the kernel's pointers need a value
    _mx_grouped_kernel[(T, triton.cdiv(N, BN))](
        a, wa.packed, wa.scale, wb.packed, wb.scale, out, tile_expert, tile_first, row_start,
        row_end, N, a.shape[1], E, *a.stride(), *wa.packed.stride(), *wa.scale.stride(),
        out.stride(0), GLU=glu, SITU=act["hidden_act"] == "situ",
        BETA1=act["situ_beta1"], BETA2=act["situ_beta2"], BM=BM, BN=BN, BK=BK,
        num_warps=GEMM_WARPS, num_stages=GEMM_STAGES)


def mxfp4_grouped_triton(xs: torch.Tensor, counts: torch.Tensor, w1, w3, w2, *, hidden_act: str,
                         situ_beta1: float, situ_beta2: float, mxfp8_inputs: bool = False) -> torch.Tensor:
    """``mxfp4_grouped_experts`` on CUDA; arguments as its, already validated. Returns ``[P, D]``
    fp32; ``h`` between the passes is in ``xs.dtype``."""
    quant = fake_quant_mxfp8_e4m3 if mxfp8_inputs else (lambda t: t)
    xs = quant(xs)
    P, D = xs.shape
    F = w1.packed.shape[1]
    act = {"hidden_act": hidden_act, "situ_beta1": situ_beta1, "situ_beta2": situ_beta2}
    y = torch.empty(P, D, device=xs.device, dtype=torch.float32)
    if P == 0:
        return y
    tiling = _tiles(counts, P)
    h = torch.empty(P, F, device=xs.device, dtype=xs.dtype)
    _grouped_pass(xs, w1, w3, tiling, h, act)
    _grouped_pass(quant(h), w2, None, tiling, y, act)
    return y
