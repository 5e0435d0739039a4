"""Routed experts straight from MXFP4-packed weights (K3_SPEC §2, §5 "MXFP4 inference"): the
serving path of ``openk3.model.packed_experts.PackedRoutedExperts``.

Each expert matrix W ``[rows, cols]`` stays packed, 4.25 bits per weight (``MXFP4Weight``: two
E2M1 codes per byte plus one E8M0 byte per 32 inputs), and is dequantised inside the kernels
(``openk3.ops.mx_kernels``; Hopper has no FP4 tensor cores):

* ``mxfp4_moe_gemv``: a few (token, slot) pairs (decode), each reading its expert by id, as
  ``openk3.ops.moe.moe_gemv`` does for bf16 weights; all arithmetic fp32.
* ``mxfp4_grouped_experts``: rows sorted by expert (prefill, large batches), as
  ``openk3.model.moe.run_experts``: weights dequantised to the activations' dtype in registers and
  multiplied on the tensor cores; fp32 accumulation, ``h`` in the activations' dtype, fp32 output.

Each has a plain PyTorch reference beside it (``*_ref``: ``mxfp4_dequantize``, then the bf16 paths'
own math in fp32), which is also the CPU path, and a ``backend`` argument like ``moe_gemv``'s.
Inference only: inputs that need gradients are refused.

``mxfp8_inputs=True`` rounds each projection's input to MXFP8 E4M3 (blocks of 32 along its
width: ``x`` before the gate/up projections, ``h`` before the down projection) with
``openk3.ops.mx.fake_quant_mxfp8_e4m3``, the quantiser of the QAT forward
(``openk3.model.moe.run_experts(qat="mxfp4")``): a QAT model served packed computes what it was
trained to compute. The rounding runs as PyTorch ops between the kernels (``h`` is in memory
between them anyway), so the kernels are the same with and without it.

Bytes one pair reads (W1, W3, W2 of its expert), packed vs bf16: ``3 F D (1/2 + 1/32)`` vs
``3 F D 2``, 3.76x fewer (``small``: 0.21 vs 0.79 MB; K3: 17.6 vs 66.1 MB).

Example::

    >>> E, F, D, N, k = 5, 64, 96, 3, 2
    >>> w1, w3, w2 = (MXFP4Weight.quantize(torch.randn(E, r, c)) for r, c in ((F, D), (F, D), (D, F)))
    >>> topk_idx, topk_weight = torch.rand(N, E).topk(k).indices, torch.rand(N, k)
    >>> y = mxfp4_moe_gemv(torch.randn(N, D), w1, w3, w2, topk_idx, topk_weight,
    ...                    hidden_act="situ", situ_beta1=4.0, situ_beta2=25.0)
    >>> y.shape, y.dtype, w1.shape
    (torch.Size([3, 96]), torch.float32, (5, 64, 96))
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from openk3.ops.fast import use_fast_path
from openk3.ops.moe import _glu_fp32, moe_gemv_ref, needs_grad
from openk3.ops.mx import MX_BLOCK_SIZE, fake_quant_mxfp8_e4m3, mxfp4_dequantize, mxfp4_quantize


class MXFP4Weight(NamedTuple):
    """E stacked MXFP4 matrices of ``rows x cols``: ``packed`` uint8 ``[E, rows, cols/2]`` (low
    nibble = even input), ``scale`` uint8 E8M0 ``[E, rows, cols/32]``."""

    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, rows, cols)`` of the matrices these bytes hold."""
        E, rows, half = self.packed.shape
        return E, rows, 2 * half

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[E, rows, cols]`` in ``dtype`` (exact in fp32 and bf16)."""
        return mxfp4_dequantize(self.packed, self.scale, dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> MXFP4Weight:
        """``openk3.ops.mx.mxfp4_quantize`` of ``w`` ``[E, rows, cols]``, ``cols % 32 == 0``."""
        return cls(*mxfp4_quantize(w))


@functools.cache
def mx_triton_available() -> bool:
    """Whether the MXFP4 Triton kernels import (CPU installs have no triton)."""
    try:
        import openk3.ops.mx_kernels  # noqa: F401
    except ImportError:
        return False
    return True


def check_mxfp4_weight(name: str, w: MXFP4Weight, rows: int | None = None,
                       cols: int | None = None) -> None:
    """ValueError naming ``name`` unless ``w`` is a well-formed ``MXFP4Weight`` (of ``rows`` x
    ``cols`` matrices, where given)."""
    packed, scale = w
    for part, t in (("packed", packed), ("scale", scale)):
        if t.dtype != torch.uint8:
            raise ValueError(f"`{name}.{part}` must be uint8, got {t.dtype}")
    if packed.dim() != 3:
        raise ValueError(f"`{name}.packed` must be [E, rows, cols/2], got {list(packed.shape)}")
    E, r, c = w.shape
    if c % MX_BLOCK_SIZE:
        raise ValueError(f"`{name}.packed` [E, rows, cols/2] = {list(packed.shape)} holds cols = {c}, "
                         f"not a multiple of the MX block ({MX_BLOCK_SIZE})")
    if tuple(scale.shape) != (E, r, c // MX_BLOCK_SIZE):
        raise ValueError(f"`{name}.scale` must be [E, rows, cols/32] = {[E, r, c // MX_BLOCK_SIZE]} "
                         f"for `{name}.packed` {list(packed.shape)}, got {list(scale.shape)}")
    if scale.device != packed.device:
        raise ValueError(f"`{name}.scale` is on {scale.device}, `{name}.packed` on {packed.device}")
    if (rows is not None and r != rows) or (cols is not None and c != cols):
        raise ValueError(f"`{name}` must hold [E, {rows}, {cols}] matrices, got [E, {r}, {c}] "
                         f"(packed {list(packed.shape)})")


def _check_experts(x, w1, w3, w2, hidden_act: str) -> None:
    """Shared checks of both entry points: x [rows, D]; w1, w3 [E, F, D]; w2 [E, D, F]."""
    if x.dim() != 2:
        raise ValueError(f"`x` must be [N, D], got {list(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"`x` must be floating, got {x.dtype}")
    D = x.shape[1]
    check_mxfp4_weight("w1", w1, cols=D)
    E, F, _ = w1.shape
    check_mxfp4_weight("w3", w3, rows=F, cols=D)
    check_mxfp4_weight("w2", w2, rows=D, cols=F)
    for name, w in (("w3", w3), ("w2", w2)):
        if w.shape[0] != E:
            raise ValueError(f"`{name}` holds {w.shape[0]} experts, w1 {E}")
    if w3.packed.stride() != w1.packed.stride() or w3.scale.stride() != w1.scale.stride():
        raise ValueError("`w3` must be laid out like `w1` (the gate/up kernel reads both with one "
                         f"set of strides): packed strides {w3.packed.stride()} vs "
                         f"{w1.packed.stride()}, scale strides {w3.scale.stride()} vs {w1.scale.stride()}")
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if w.packed.device != x.device:
            raise ValueError(f"`{name}` is on {w.packed.device}, x on {x.device}")
    if hidden_act not in ("situ", "silu"):
        raise ValueError(f"`hidden_act` must be 'situ' or 'silu', got {hidden_act!r}")


def _resolve_backend(backend: str, x: torch.Tensor) -> str:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"`backend` must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "auto":
        return "triton" if use_fast_path(x) and mx_triton_available() else "torch"
    if backend == "triton":
        if not x.is_cuda:
            raise ValueError(f"backend='triton' needs CUDA tensors, got x on {x.device}")
        if not mx_triton_available():
            raise ValueError("backend='triton' needs triton (CUDA builds of torch install it)")
    return backend


def _refuse_grad(fn: str, *tensors: torch.Tensor) -> None:
    if needs_grad(*tensors):
        raise ValueError(f"{fn} has no backward (packed experts serve only): call it under "
                         "torch.no_grad() or torch.inference_mode(), or load the experts "
                         "dequantised to train them")


def mxfp4_moe_gemv_ref(x: torch.Tensor, w1: MXFP4Weight, w3: MXFP4Weight, w2: MXFP4Weight,
                       topk_idx: torch.Tensor, topk_weight: torch.Tensor, *, hidden_act: str,
                       situ_beta1: float, situ_beta2: float, mxfp8_inputs: bool = False) -> torch.Tensor:
    """``mxfp4_moe_gemv`` in plain PyTorch: every expert decoded to fp32 (``mxfp4_dequantize``),
    then ``openk3.ops.moe.moe_gemv_ref`` (with the MXFP8 rounding of its inputs when
    ``mxfp8_inputs``). Reference-sized inputs only."""
    return moe_gemv_ref(x, w1.dequantize(), w3.dequantize(), w2.dequantize(), topk_idx, topk_weight,
                        hidden_act=hidden_act, situ_beta1=situ_beta1, situ_beta2=situ_beta2,
                        quant_inputs=fake_quant_mxfp8_e4m3 if mxfp8_inputs else None)


def mxfp4_moe_gemv(x: torch.Tensor, w1: MXFP4Weight, w3: MXFP4Weight, w2: MXFP4Weight,
                   topk_idx: torch.Tensor, topk_weight: torch.Tensor, *, hidden_act: str,
                   situ_beta1: float, situ_beta2: float, backend: str = "auto",
                   mxfp8_inputs: bool = False) -> torch.Tensor:
    """Routed experts of a few tokens from packed weights, each (token, slot) pair reading its
    expert by id (``openk3.ops.moe.moe_gemv`` with MXFP4 weights).

    Args:
        x: ``[N, D]`` token activations (any float dtype).
        w1, w3: ``MXFP4Weight`` of ``[E, F, D]`` (gate, up; the same layout); w2: of ``[E, D, F]``.
        topk_idx: ``[N, k]`` integer expert ids in ``[0, E)``; topk_weight: ``[N, k]``.
        hidden_act: ``"situ"`` (with ``situ_beta1``, ``situ_beta2``) or ``"silu"``.
        backend: ``"triton"`` (CUDA), ``"torch"`` (the reference) or ``"auto"``.
        mxfp8_inputs: round ``x`` and the GLU output to MXFP8 E4M3 (module docstring).

    Returns:
        ``[N, D]`` fp32 ``sum_j topk_weight[t, j] E_{topk_idx[t, j]}(x_t)``; products, the
        activation and all sums fp32. Deterministic. No autograd.
    """
    _check_experts(x, w1, w3, w2, hidden_act)
    N = x.shape[0]
    if topk_idx.dim() != 2 or topk_idx.shape[0] != N:
        raise ValueError(f"`topk_idx` must be [N, k] with N = {N}, got {list(topk_idx.shape)}")
    if topk_idx.is_floating_point() or topk_idx.is_complex() or topk_idx.dtype == torch.bool:
        raise ValueError(f"`topk_idx` must hold integer expert ids, got {topk_idx.dtype}")
    if topk_weight.shape != topk_idx.shape:
        raise ValueError(f"`topk_weight` must be [N, k] = {list(topk_idx.shape)}, "
                         f"got {list(topk_weight.shape)}")
    for name, t in (("topk_idx", topk_idx), ("topk_weight", topk_weight)):
        if t.device != x.device:
            raise ValueError(f"`{name}` is on {t.device}, x on {x.device}")
    _refuse_grad("mxfp4_moe_gemv", x, topk_weight)
    act = {"hidden_act": hidden_act, "situ_beta1": situ_beta1, "situ_beta2": situ_beta2,
           "mxfp8_inputs": mxfp8_inputs}
    if _resolve_backend(backend, x) == "torch":
        return mxfp4_moe_gemv_ref(x, w1, w3, w2, topk_idx, topk_weight, **act)
    from openk3.ops.mx_kernels import mxfp4_moe_gemv_triton

    return mxfp4_moe_gemv_triton(x, w1, w3, w2, topk_idx, topk_weight, **act)


def mxfp4_grouped_experts_ref(xs: torch.Tensor, counts: torch.Tensor, w1: MXFP4Weight,
                              w3: MXFP4Weight, w2: MXFP4Weight, *, hidden_act: str,
                              situ_beta1: float, situ_beta2: float,
                              mxfp8_inputs: bool = False) -> torch.Tensor:
    """``mxfp4_grouped_experts`` in plain PyTorch, all math fp32: the experts that received rows
    are decoded (``mxfp4_dequantize``, one call per projection) and multiplied in a loop, as
    ``run_experts``' loop does (with ``mxfp8_inputs``, also its QAT rounding of xs and h). Syncs
    once (``counts.tolist()``): the CPU path and the tests' reference."""
    rows = counts.tolist()
    used = [e for e, n in enumerate(rows) if n]
    if not used:
        return xs.new_zeros(xs.shape, dtype=torch.float32)
    quant = fake_quant_mxfp8_e4m3 if mxfp8_inputs else (lambda t: t)
    xs = quant(xs)
    W1, W3, W2 = (mxfp4_dequantize(w.packed[used], w.scale[used], torch.float32) for w in (w1, w3, w2))
    outs, start = [], 0
    for i, e in enumerate(used):
        xe = xs[start:start + rows[e]].float()
        h = quant(_glu_fp32(xe @ W1[i].T, xe @ W3[i].T, hidden_act, situ_beta1, situ_beta2))
        outs.append(h @ W2[i].T)
        start += rows[e]
    return torch.cat(outs)


def mxfp4_grouped_experts(xs: torch.Tensor, counts: torch.Tensor, w1: MXFP4Weight,
                          w3: MXFP4Weight, w2: MXFP4Weight, *, hidden_act: str,
                          situ_beta1: float, situ_beta2: float,
                          backend: str = "auto", mxfp8_inputs: bool = False) -> torch.Tensor:
    """GLU experts over expert-sorted rows from packed weights (``run_experts`` with MXFP4).

    Args:
        xs: ``[P, D]``: ``counts[0]`` rows for expert 0, then ``counts[1]`` for expert 1, ...
            (bf16 on the tensor cores; fp16, and fp32 without TF32, also work).
        counts: ``[E]`` integer rows per expert, summing to P (not checked: that would sync).
        w1, w3, w2, hidden_act, situ_beta1, situ_beta2, backend, mxfp8_inputs: as
            ``mxfp4_moe_gemv``'s.

    Returns:
        ``[P, D]`` fp32 expert outputs, unweighted, in xs' row order. The Triton path
        accumulates in fp32 and rounds ``h`` to xs.dtype before the down projection (the
        reference keeps it fp32). No host sync on the Triton path; no autograd.
    """
    _check_experts(xs, w1, w3, w2, hidden_act)
    E = w1.shape[0]
    if counts.shape != (E,) or counts.is_floating_point() or counts.dtype == torch.bool:
        raise ValueError(f"`counts` must be [E] = [{E}] integers, got {list(counts.shape)} {counts.dtype}")
    if counts.device != xs.device:
        raise ValueError(f"`counts` is on {counts.device}, xs on {xs.device}")
    _refuse_grad("mxfp4_grouped_experts", xs)
    act = {"hidden_act": hidden_act, "situ_beta1": situ_beta1, "situ_beta2": situ_beta2,
           "mxfp8_inputs": mxfp8_inputs}
    if _resolve_backend(backend, xs) == "torch":
        return mxfp4_grouped_experts_ref(xs, counts, w1, w3, w2, **act)
    if xs.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"`xs` must be bf16, fp16 or fp32 for the Triton path, got {xs.dtype}")
    from openk3.ops.mx_kernels import mxfp4_grouped_triton

    return mxfp4_grouped_triton(xs, counts, w1, w3, w2, **act)
