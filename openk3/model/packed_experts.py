"""Routed experts kept MXFP4-packed in memory for serving (K3_SPEC §2, §5 "MXFP4 inference").

``PackedRoutedExperts`` replaces ``openk3.model.moe.RoutedExperts`` in an inference model: the same
forward (x ``[N, D]``, topk_idx, topk_weight ``[N, k]`` -> fp32 ``[N, D]``), but its weights are
uint8 buffers, 4.25 bits per weight instead of 16 (3.76x less memory and fewer bytes per decode
step), in the checkpoint's own layout, stacked over the experts:

    w1_packed, w3_packed [E, F, D/2]   w1_scale, w3_scale [E, F, D/32]   (gate, up)
    w2_packed [E, D, F/2]              w2_scale [E, D, F/32]             (down)

On CUDA they run through the Triton kernels of ``openk3.ops.mx_moe`` (decode GEMVs for up to
``PACKED_GEMV_MAX_PAIRS`` (token, expert) pairs, else a grouped GEMM over expert-sorted rows), which
dequantise in registers; on the CPU (or with ``OPENK3_REFERENCE=1``) each used expert is decoded and
multiplied as ``RoutedExperts`` does, so a CPU model gives the same outputs either way.

``qat``: ``"none"``, or ``"mxfp4"`` (set by ``openk3.model.moe.set_qat``, as for
``RoutedExperts``): the expert inputs are then rounded to MXFP8 E4M3 as the QAT forward rounds
them, so a model trained with ``--qat mxfp4`` gives the same outputs packed as in training (its
weights are already the packed bytes). ``openk3.runtime.load_model`` sets it from the run.

Buffers, not parameters: nothing to train (a forward that needs gradients is refused), nothing
for an optimizer, and ``model.to(dtype)`` leaves the bytes alone. ``load_pretrained(...,
experts="packed")`` builds a model with these modules; ``pack_experts`` converts a built one.

Example::

    >>> from openk3 import build_model, preset
    >>> model = pack_experts(build_model(preset("debug")).eval())
    >>> model.model.layers[1].mlp.experts
    PackedRoutedExperts(experts=8, dim=96, hidden=64, mxfp4)
    >>> with torch.no_grad():
    ...     model(torch.tensor([[1, 2, 3]])).logits.shape
    torch.Size([1, 3, 4096])
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.model.moe import MoE, RoutedExperts
from openk3.ops.fast import use_fast_path
from openk3.ops.moe import combine_rows, group_pairs, needs_grad
from openk3.ops.mx import MX_BLOCK_SIZE
from openk3.ops.mx_moe import (
    MXFP4Weight,
    mx_triton_available,
    mxfp4_grouped_experts,
    mxfp4_moe_gemv,
)

PROJECTIONS = ("w1", "w3", "w2")

# The most pairs whose packed experts run as GEMVs: the bf16 kernels' threshold from when their
# grouped path was grouped_mm behind a sort (benchmarks/moe_decode_bench.py, 2026-11-30: the
# GEMVs won at 512 pairs); the packed grouped path is not the bf16 one's Triton kernels, so it
# was not lowered with openk3.ops.moe.GEMV_MAX_PAIRS (not re-measured: benchmarks/mxfp4_bench.py)
PACKED_GEMV_MAX_PAIRS = 512


def expert_shapes(cfg: ModelConfig, dim: int) -> dict[str, tuple[int, int]]:
    """(rows, cols) of each expert matrix: w1, w3 ``[F, D]``, w2 ``[D, F]``."""
    F = cfg.moe_intermediate_size
    return {"w1": (F, dim), "w3": (F, dim), "w2": (dim, F)}


class PackedRoutedExperts(nn.Module):
    """E GLU experts of input width D (``dim``) and hidden width F, MXFP4-packed (module docstring)."""

    def __init__(self, cfg: ModelConfig, dim: int, device: torch.device | str | None = None):
        super().__init__()
        self.cfg, self.dim = cfg, dim
        F = cfg.moe_intermediate_size
        if dim % MX_BLOCK_SIZE or F % MX_BLOCK_SIZE:
            raise ValueError(f"MXFP4 experts need their widths divisible by {MX_BLOCK_SIZE}: expert "
                             f"input width {dim}, moe_intermediate_size {F}")
        for name, (rows, cols) in expert_shapes(cfg, dim).items():
            self.register_buffer(f"{name}_packed", torch.empty(
                cfg.num_experts, rows, cols // 2, dtype=torch.uint8, device=device))
            self.register_buffer(f"{name}_scale", torch.empty(
                cfg.num_experts, rows, cols // MX_BLOCK_SIZE, dtype=torch.uint8, device=device))
        self.qat = "none"

    @classmethod
    def from_experts(cls, experts: RoutedExperts) -> PackedRoutedExperts:
        """Quantise ``experts``' weights with ``openk3.ops.mx.mxfp4_quantize`` (the quantiser of
        export and QAT), on their device; a meta module gives a meta module."""
        w1 = experts.w1
        packed = cls(experts.cfg, w1.shape[2], device=w1.device)
        if w1.device.type != "meta":
            with torch.no_grad():
                for name in PROJECTIONS:
                    q = MXFP4Weight.quantize(getattr(experts, name).detach())
                    getattr(packed, f"{name}_packed").copy_(q.packed)
                    getattr(packed, f"{name}_scale").copy_(q.scale)
        return packed

    def weight(self, name: str) -> MXFP4Weight:
        """The packed ``w1``, ``w3`` or ``w2``."""
        return MXFP4Weight(getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"))

    def extra_repr(self) -> str:
        return (f"experts={self.cfg.num_experts}, dim={self.dim}, "
                f"hidden={self.cfg.moe_intermediate_size}, mxfp4"
                + (", mxfp8 inputs" if self.qat == "mxfp4" else ""))

    def _act(self) -> dict:
        cfg = self.cfg
        return {"hidden_act": cfg.hidden_act, "situ_beta1": cfg.situ_beta1, "situ_beta2": cfg.situ_beta2,
                "mxfp8_inputs": self.qat == "mxfp4"}

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """x: [N, D]; topk_idx, topk_weight: [N, k]. Returns sum_j w_j E_j(x) in fp32, [N, D].

        On CUDA, up to ``PACKED_GEMV_MAX_PAIRS`` pairs run as GEMVs by expert id (CUDA-graph
        safe), more through ``forward_sorted``; on the CPU always ``forward_sorted``."""
        if needs_grad(x, topk_weight):
            raise ValueError("PackedRoutedExperts (MXFP4 experts) serve only: run the model under "
                             "torch.no_grad() or torch.inference_mode(), or load the checkpoint with "
                             "experts='dequantize' to train")
        if use_fast_path(x) and topk_idx.numel() <= PACKED_GEMV_MAX_PAIRS and mx_triton_available():
            w1, w3, w2 = (self.weight(n) for n in PROJECTIONS)
            return mxfp4_moe_gemv(x, w1, w3, w2, topk_idx, topk_weight, **self._act(),
                                  backend="triton")
        return self.forward_sorted(x, topk_idx, topk_weight)

    def forward_sorted(self, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weight: torch.Tensor) -> torch.Tensor:
        """``forward`` with the pairs sorted by expert, as ``RoutedExperts.forward_sorted``, and
        ``mxfp4_grouped_experts`` in place of ``run_experts`` (no host sync on CUDA)."""
        position, token_of_row, counts, _ = group_pairs(topk_idx, self.cfg.num_experts)
        w1, w3, w2 = (self.weight(n) for n in PROJECTIONS)
        ys = mxfp4_grouped_experts(x[token_of_row], counts, w1, w3, w2, **self._act())
        return combine_rows(ys, position, topk_weight)


def pack_experts(model: nn.Module) -> nn.Module:
    """Replace every MoE layer's ``RoutedExperts`` in ``model`` (MTP layers included) by
    ``PackedRoutedExperts`` quantised from its weights (``from_experts``; on the meta device, empty
    ones for a checkpoint to fill). Returns ``model``; already packed layers stay as they are."""
    for module in model.modules():
        if isinstance(module, MoE) and isinstance(module.experts, RoutedExperts):
            module.experts = PackedRoutedExperts.from_experts(module.experts)
    return model
