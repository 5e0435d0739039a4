"""The Triton kernel of ``openk3.ops.moe_output.moe_output`` (imported only on the CUDA fast path,
or by the CPU tests under Triton's interpreter): a latent MoE layer's output for a few tokens.

    out[t] = residual[t] + W_sd act(gate[t], up[t]) + W_up (rmsnorm(u[t]) * norm_weight)

``W_sd`` [d, F] is the shared experts' ``down_proj``, ``W_up`` [d, L] the routed experts'
``routed_expert_up_proj``; gate, up [N, F] are the shared experts' input projections and u [N, L]
the routed experts' fp32 latent sum. One launch where the unfused path takes four (the GLU, a
GEMM adding into the residual, the RMSNorm, a second GEMM adding into it): at a decode step of a
few tokens each of them costs its launch, not its bytes.

Grid (N, d / ROWS): a program owns one token and ``ROWS`` output rows, and streams those rows of
W_sd, then of W_up, over the concatenated reduction dimension F + L (a memory-bound GEMV: the
products accumulate elementwise in an fp32 ``[ROWS, COLS]`` tile, reduced across columns once
at the end). Before its loop each program recomputes its token's ``rstd`` (L fp32 values, read
from L2 by all but the first program). Tokens are the fastest grid axis: the programs of one row
block run together, so a token after the first reads those weight rows from L2.

The dtype points are the reference's, so that the GEMV inputs equal the unfused path's bit for
bit (up to the last fp32 bit of the activation or rstd, which can move a rounding):
the activation in fp32, rounded to the activations' dtype (SwiGLU as ``F.silu(gate) * up``
computes it on bf16 tensors: silu rounded, then the product); the normalised latent in fp32,
times the norm weight, rounded to that dtype. Products and sums are fp32 and the output is
rounded once; the unfused path rounds twice (each GEMM's epilogue rounds its sum with the
residual), so the two differ in the last bit of some outputs.

Floor, bf16 at 4.3 TB/s, weights read once (d F + d L) x 2 bytes, plus per token the residual
read and written, gate, up, u (fp32) and the norm weight:

| layer (d, F, L) | weights | 1 token | floor |
|---|---|---|---|
| ``small`` (1024, 512, 512) | 2.10 MB | 2.11 MB | 0.49 us |
| ``k3`` (7168, 6144, 3584) | 139.5 MB | 139.5 MB | 32.4 us |
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.fast import launch_device
from openk3.ops.moe_kernels import _glu

ROWS = 8       # output rows per program: 128 programs a `small` token (the H200 has 132 SMs), 896 a K3 one
COLS = 128     # reduction columns per step: one 16-byte load of 8 bf16 per thread per row
NUM_WARPS = 4


@triton.jit
def _shared_glu(gate, up, SITU: tl.constexpr, BETA1: tl.constexpr, BETA2: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 gate, up -> the shared experts' activation as ``glu_act`` computes it on DTYPE
    tensors, as fp32 holding DTYPE values: SiTU-GLU in fp32 rounded once (``situ_glu``); SwiGLU
    as ``F.silu(gate) * up``: silu rounded to DTYPE, then the product."""
    if SITU:
        h = _glu(gate, up, True, BETA1, BETA2)
    else:
        silu = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
        h = silu * up
    return h.to(DTYPE).to(tl.float32)


@triton.jit
def _moe_output_kernel(gate_ptr, up_ptr, u_ptr, w_sd_ptr, norm_w_ptr, w_up_ptr, out_ptr, D, F, L, eps,
                       stride_gate, stride_up, stride_u, stride_w_sd, stride_w_up, stride_out,
                       HAS_RESIDUAL: tl.constexpr, SITU: tl.constexpr, BETA1: tl.constexpr,
                       BETA2: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)              # [ROWS]
    row_ok = rows < D
    cols = tl.arange(0, COLS)                                        # [COLS]
    dtype = gate_ptr.dtype.element_ty                                # the activations' (bf16)
    u_row = u_ptr + t * stride_u
    sum_sq = tl.zeros([COLS], dtype=tl.float32)
    for l0 in range(0, L, COLS):  # the token's rstd, as the RMSNorm kernel computes it
        lat = l0 + cols
        latent = tl.load(u_row + lat, mask=lat < L, other=0.0)
        sum_sq += latent * latent
    rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / L + eps)

    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    w_sd_rows = w_sd_ptr + rows[:, None].to(tl.int64) * stride_w_sd  # [ROWS, 1]
    for f0 in range(0, F, COLS):
        f = f0 + cols
        f_ok = f < F
        gate = tl.load(gate_ptr + t * stride_gate + f, mask=f_ok, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + t * stride_up + f, mask=f_ok, other=0.0).to(tl.float32)
        h = _shared_glu(gate, up, SITU, BETA1, BETA2, dtype)           # act(0, 0) = 0 past F
        w = tl.load(w_sd_rows + f[None, :], mask=row_ok[:, None] & f_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * h[None, :]
    w_up_rows = w_up_ptr + rows[:, None].to(tl.int64) * stride_w_up
    for l0 in range(0, L, COLS):
        lat = l0 + cols
        l_ok = lat < L
        latent = tl.load(u_row + lat, mask=l_ok, other=0.0)
        norm_w = tl.load(norm_w_ptr + lat, mask=l_ok, other=0.0).to(tl.float32)
        y = (latent * rstd * norm_w).to(dtype).to(tl.float32)
        w = tl.load(w_up_rows + lat[None, :], mask=row_ok[:, None] & l_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * y[None, :]

    out_row = out_ptr + t * stride_out + rows
    out = tl.sum(acc, axis=1)                                        # [ROWS]
    if HAS_RESIDUAL:  # out holds the residual: read, then overwritten by this program only
        out += tl.load(out_row, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_row, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def moe_output_triton(residual: torch.Tensor | None, gate: torch.Tensor, up: torch.Tensor,
                      u: torch.Tensor, shared_down_proj: torch.Tensor, norm_weight: torch.Tensor,
                      routed_up_proj: torch.Tensor, *, norm_eps: float, hidden_act: str,
                      situ_beta1: float, situ_beta2: float) -> torch.Tensor:
    """``moe_output`` in one launch; arguments as its, already validated (unit column strides,
    u fp32). Writes into ``residual`` in place and returns it; without a residual, returns a new
    ``[N, d]`` tensor in gate's dtype. No host synchronisation, no other allocation: CUDA-graph
    safe."""
    N = gate.shape[0]
    D, L = routed_up_proj.shape
    F = shared_down_proj.shape[1]
    out = residual if residual is not None else torch.empty(N, D, device=gate.device, dtype=gate.dtype)
    if N:
        with launch_device(gate):
            _moe_output_kernel[(N, triton.cdiv(D, ROWS))](
                gate, up, u, shared_down_proj, norm_weight, routed_up_proj, out, D, F, L, norm_eps,
                gate.stride(0), up.stride(0), u.stride(0), shared_down_proj.stride(0),
                routed_up_proj.stride(0), out.stride(0),
                HAS_RESIDUAL=residual is not None, SITU=hidden_act == "situ", BETA1=situ_beta1,
                BETA2=situ_beta2, ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS)
    return out
