"""The MoE router's choice (K3_SPEC §1.5): sigmoid scores, top-k on the biased scores, weights
from the unbiased ones.

    s = sigmoid(logits)                      fp32 [N, E]
    topk_idx = topk(s + bias, k)             the balancing bias only picks the experts
    w = s[topk_idx] / (sum + 1e-20)          with ``renormalize``; then times ``scale``

* ``router_topk_ref``: plain PyTorch (differentiable: training's router).
* ``router_topk``: the entry point; without autograd on CUDA one Triton kernel per call
  (``router_triton.py``) instead of six (a decode step pays them in every MoE layer); with
  autograd the kernel picks the experts and the weights are gathered by autograd's ops.
* ``router_logits``: the fp32 logits ``x W^T`` before it; without autograd on CUDA, for up to
  ``LOGITS_GEMV_MAX_TOKENS`` tokens, one Triton kernel reading x in its own dtype instead of a
  cast and cuBLAS's two fp32 GEMV kernels; for more tokens of bf16 x, bf16 GEMMs on the fp32
  weight split in two bf16 halves (``backend="split"``, below).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.fast import compile_disabled, needs_grad, use_fast_path
from openk3.ops.moe import triton_available

RENORM_EPS = 1e-20
# The most tokens whose router logits take the Triton GEMV (each program re-reads its rows of
# the weight per token, from L2 after the first); larger batches run cuBLAS, whose GEMM reads the
# weight once. Measured in `small`'s decode step on one H200 (eleventh session, docs/benchmarks.md):
# at 32 tokens the router's two kernels took 183 us per step against 290 us for the cast, cuBLAS's
# two kernels and top-k; 128 tokens is not measured alone (the step at 128 was slower with other
# changes in it), so it stays on cuBLAS.
LOGITS_GEMV_MAX_TOKENS = 32
LOGITS_ROWS, LOGITS_COLS = 4, 256  # experts per program (>= 16 programs per `small` token), columns per step
TOPK_TILE = 1024  # router_topk_kernel's tokens x experts per program
# kth_largest_kernel unrolls k rounds over a row: up to this k (and rows up to 4 tiles) it is
# the kernel; beyond, kth_largest_long_kernel's 32 counts over a row held in registers (rows up
# to KTH_LONG_MAX: Quantile Balancing's per-expert thresholds over 16,384 tokens)
KTH_UNROLL_MAX = 32
KTH_LONG_MAX = 16384


def router_logits(x: torch.Tensor, weight: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """The router's fp32 logits: ``F.linear(x.float(), weight.float())``.

    Args:
        x: ``[N, d]`` activations, any float dtype.
        weight: ``[E, d]`` router weight (fp32 in K3).
        backend: ``"triton"`` (CUDA), ``"split"`` (bf16 x, fp32 weight), ``"torch"`` the
            reference, ``"auto"``: on CUDA (unless ``OPENK3_REFERENCE=1``) Triton for inputs
            that need no gradient and at most ``LOGITS_GEMV_MAX_TOKENS`` tokens, "split" for
            more tokens of bf16 x and an fp32 weight, else the reference.

    Returns:
        ``[N, E]`` fp32 (products and sums in fp32, under autocast too; the kernel sums in its
        own order; "split" is within ~2^-16 of them, see ``_SplitLogits``).
    """
    if backend not in ("auto", "torch", "triton", "split"):
        raise ValueError(f"`backend` must be 'auto', 'torch', 'triton' or 'split', got {backend!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: `x` must be [N, d] and `weight` [E, d], got "
                         f"{list(x.shape)} and {list(weight.shape)}")
    if backend == "auto":
        if not use_fast_path(x):
            backend = "torch"
        elif x.shape[0] <= LOGITS_GEMV_MAX_TOKENS and not needs_grad(x, weight) and triton_available():
            backend = "triton"
        else:
            backend = "split" if x.dtype == torch.bfloat16 and weight.dtype == torch.float32 else "torch"
    if backend == "split":
        if x.dtype != torch.bfloat16 or weight.dtype != torch.float32:
            raise ValueError(f"router_logits: backend='split' takes bf16 `x` and an fp32 `weight`, got "
                             f"{x.dtype} and {weight.dtype}")
        with torch.autocast(x.device.type, enabled=False):
            return _SplitLogits.apply(x, weight)
    if backend == "torch":
        # autocast would run this linear in bf16 (training's step is under it): K3_SPEC §1.5
        # asks for fp32 logits, which bf16 rounds to 8 bits
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), weight.float())
    if needs_grad(x, weight):
        raise ValueError("router_logits: the Triton kernel has no backward (use backend='torch')")
    return _router_logits_triton(x, weight)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 matrices with fp32 products, sums and output: cuBLAS's bf16 GEMM
    writing fp32 on CUDA; on the CPU (the tests) the same values from an fp32 matmul (bf16
    values are exact in fp32)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _halves(t: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor as two bf16 ones side by side along dim 0, ``hi = bf16(t)`` then
    ``lo = bf16(t - hi)``: ``hi + lo`` is t to within ~2^-17 of |t| (16 of fp32's 24 bits)."""
    hi = t.bfloat16()
    return torch.cat([hi, (t - hi.float()).bfloat16()])


class _SplitLogits(torch.autograd.Function):
    """Training's router logits without fp32 GEMMs. ``x`` is bf16, so ``x W^T`` in fp32 is
    ``x W_hi^T + x W_lo^T`` up to the ~2^-16 of W that the halves drop: one bf16 GEMM against
    ``[W_hi; W_lo]`` (fp32 sums and output) and one add of its halves. Backward: the weight's
    gradient ``g^T x`` with g (fp32) split the same way; x's gradient ``g W`` as one bf16 GEMM
    of bf16(g) and ``W_hi``: x's gradient is bf16, and rounding g and W to bf16 first adds
    ~2^-9 of ``sum |g W|`` per entry, about its own rounding unless the sum cancels (this is only
    the router's share of x's gradient; the weight's gradient keeps the halves).
    cuBLAS has no fp32 GEMM at tensor-core rate without TF32, whose 10-bit inputs would lose
    more than the halves do; the three fp32 GEMMs per MoE layer took ~4 ms of `small`'s training
    step on an H200 (docs/benchmarks.md, sixteenth session)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        E = weight.shape[0]
        w2 = _halves(weight)  # [2E, d]
        out = _mm_fp32(x, w2.t())  # [N, 2E]
        # what the backward reads: x for the weight's gradient, W_hi for x's
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None,
                              w2[:E] if ctx.needs_input_grad[0] else None)
        return out[:, :E] + out[:, E:]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        x, w_hi = ctx.saved_tensors
        E = g.shape[1]
        dx = dw = None
        with torch.autocast(g.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = g.bfloat16() @ w_hi
            if ctx.needs_input_grad[1]:
                halves = _mm_fp32(_halves(g.t().contiguous()), x)  # [2E, d]
                dw = halves[:E] + halves[E:]
        return dx, dw


@compile_disabled("a Triton kernel launched as it is")
def _router_logits_triton(x, weight):
    import triton

    from openk3.ops.router_triton import router_logits_kernel

    N, D = x.shape
    E = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(N, E, device=x.device, dtype=torch.float32)
    if N:
        router_logits_kernel[(N, triton.cdiv(E, LOGITS_ROWS))](
            x, weight, out, E, D, x.stride(0), weight.stride(0), ROWS=LOGITS_ROWS, COLS=LOGITS_COLS)
    return out


def router_topk_ref(logits: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool = True,
                    scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``router_topk`` in plain PyTorch; arguments and results as its."""
    scores = torch.sigmoid(logits.float())
    topk_idx = (scores + bias).topk(k, dim=-1).indices
    return scores, topk_idx, _weights(scores, topk_idx, renormalize, scale)


def _weights(scores: torch.Tensor, topk_idx: torch.Tensor, renormalize: bool, scale: float) -> torch.Tensor:
    """The chosen experts' weights from the (unbiased) scores [N, E], differentiable."""
    weight = scores.gather(1, topk_idx)
    if renormalize:
        weight = weight / (weight.sum(-1, keepdim=True) + RENORM_EPS)
    if scale != 1.0:  # K3's is 1: one kernel less per layer and step
        weight = weight * scale
    return weight


def router_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool = True,
                scale: float = 1.0, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights.

    Args:
        logits: ``[N, E]`` router logits (fp32 for K3's router; any float dtype).
        bias: ``[E]`` fp32 balancing bias (``e_score_correction_bias``), or ``[N, E]`` per token
            (group-limited routing masks the dropped groups with -inf; the reference runs it).
        k: experts per token, ``1 <= k <= E``.
        renormalize: divide the chosen scores by their sum (+ 1e-20).
        scale: ``routed_scaling_factor``.
        backend: ``"triton"`` (CUDA), ``"torch"`` the reference, ``"auto"``: Triton for CUDA
            inputs with one bias [E] (unless ``OPENK3_REFERENCE=1``). With autograd (training)
            the kernel only picks the experts (no gradient flows through the choice) and the
            scores and weights are the reference's ops on them: ``torch.topk`` of 16,384 rows of
            64 took ~100 us a `small` layer on the H200 (issue P7).

    Returns:
        scores ``[N, E]`` fp32, topk_idx ``[N, k]`` int64 (largest biased score first; the
        kernel takes the first index among equal values, ``torch.topk`` any), weights ``[N, k]``
        fp32.

    Example::

        >>> logits, bias = torch.tensor([[0.0, 2.0, -1.0, 1.0]]), torch.tensor([0.0, 0.0, 5.0, 0.0])
        >>> scores, idx, w = router_topk(logits, bias, k=2)
        >>> idx.tolist(), round(w.sum().item(), 6)
        ([[2, 1]], 1.0)
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"`backend` must be 'auto', 'torch' or 'triton', got {backend!r}")
    if logits.dim() != 2 or bias.shape not in (logits.shape[1:], logits.shape):
        raise ValueError(f"router_topk: `logits` must be [N, E] and `bias` [E] or [N, E], got "
                         f"{list(logits.shape)} and {list(bias.shape)}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"router_topk: k = {k} must be in 1..E = 1..{logits.shape[1]}")
    if backend == "auto":
        backend = ("triton" if use_fast_path(logits) and triton_available() and bias.dim() == 1
                   else "torch")
    if backend == "torch":
        return router_topk_ref(logits, bias, k, renormalize, scale)
    if bias.dim() != 1:
        raise ValueError("router_topk: the Triton kernel takes one bias [E] (use backend='torch')")
    if needs_grad(logits, bias):
        _, topk_idx, _ = _router_topk_triton(logits.detach(), bias.detach(), k, renormalize, scale,
                                             write_scores=False)
        scores = torch.sigmoid(logits.float())
        return scores, topk_idx, _weights(scores, topk_idx, renormalize, scale)
    return _router_topk_triton(logits, bias, k, renormalize, scale)


@compile_disabled("a Triton kernel launched as it is")
def _router_topk_triton(logits, bias, k, renormalize, scale, write_scores: bool = True):
    import triton

    from openk3.ops.router_triton import router_topk_kernel

    N, E = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    # without write_scores (training: autograd computes the scores) nothing is written there
    scores = torch.empty(N if write_scores else 0, E, device=logits.device, dtype=torch.float32)
    idx = torch.empty(N, k, device=logits.device, dtype=torch.int64)
    weight = torch.empty(N, k, device=logits.device, dtype=torch.float32)
    if N:
        block_e = triton.next_power_of_2(E)
        # a [TOKENS, BLOCK_E] tile of ~1K values per program (16 of `small`'s tokens, one of
        # K3's): one token per program left most of 4 warps idle on 64 experts (~39 us for
        # training's 16,384 tokens on the H200)
        tokens = min(max(1, TOPK_TILE // block_e), triton.next_power_of_2(N))
        router_topk_kernel[(triton.cdiv(N, tokens),)](
            logits, bias.contiguous(), scores, idx, weight, N, E, logits.stride(0), RENORM_EPS,
            float(scale), K=k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k), TOKENS=tokens,
            RENORMALIZE=renormalize, WRITE_SCORES=write_scores)
    return scores, idx, weight


def kth_largest(x: torch.Tensor, k: int, *, backend: str = "auto") -> torch.Tensor:
    """The k-th largest of ``x`` along its last dimension, in fp32 (Quantile Balancing's
    per-token threshold: ``x`` the biased scores, ``openk3.train.balance.qb_margins``; and its
    per-expert one, the (q+1)-th largest margin over the batch's tokens, ``qb_update_exact``).

    Args:
        x: ``[..., E]``, any float dtype (e.g. several routers' biased scores side by side).
        k: ``1 <= k <= E``.
        backend: ``"triton"`` (CUDA; rows of at most ``KTH_LONG_MAX``), ``"torch"`` the
            reference (``kthvalue``), ``"auto"`` Triton for CUDA inputs whose rows it takes
            (unless ``OPENK3_REFERENCE=1``): ``torch.topk`` of `small`'s 23 x 16,384 rows of 64
            took 1.15 ms of the training step on the H200, ``kthvalue`` of its 23 x 64 rows of
            16,384 0.61 ms.

    Returns:
        ``[...]`` fp32; the same values as ``topk(k).values[..., k-1]`` (ties count; a NaN
        ranks first and gives +inf where topk gives NaN).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"`backend` must be 'auto', 'torch' or 'triton', got {backend!r}")
    if x.dim() < 1 or not 1 <= k <= x.shape[-1]:
        raise ValueError(f"kth_largest: k = {k} must be in 1..E for `x` [..., E], got {list(x.shape)}")
    if backend == "auto":
        backend = "triton" if use_fast_path(x) and triton_available() and x.shape[-1] <= KTH_LONG_MAX else "torch"
    if backend == "triton" and x.shape[-1] > KTH_LONG_MAX:
        raise ValueError(f"kth_largest: backend='triton' takes rows of at most {KTH_LONG_MAX}, got {list(x.shape)}")
    if backend == "torch":  # topk(k).values[..., k - 1], without sorting the k largest
        return x.float().kthvalue(x.shape[-1] - k + 1, dim=-1).values
    return _kth_largest_triton(x.detach(), k)


@compile_disabled("a Triton kernel launched as it is")
def _kth_largest_triton(x: torch.Tensor, k: int) -> torch.Tensor:
    import triton

    from openk3.ops.router_triton import kth_largest_kernel, kth_largest_long_kernel

    E = x.shape[-1]
    out = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    R = out.numel()
    block_e = triton.next_power_of_2(E)
    if not R:
        return out
    if k > KTH_UNROLL_MAX or block_e > 4 * TOPK_TILE:
        x = x.float().contiguous()
        kth_largest_long_kernel[(R,)](x, out, E, k, BLOCK_E=block_e, num_warps=16 if block_e >= 8192 else 8)
        return out
    x = x.contiguous()
    rows = max(1, TOPK_TILE // block_e)
    kth_largest_kernel[(triton.cdiv(R, rows),)](x, out, R, E, K=k, BLOCK_E=block_e, ROWS=rows)
    return out
