"""MLPs, the sigmoid router, and Stable LatentMoE (K3_SPEC §1.4–1.5).

K3:          y = W_up(RMSNorm_latent(sum_j w_j E_j(W_down x))) + Shared(x)
Kimi Linear: y = sum_j w_j E_j(x) + Shared(x)         (full width, SwiGLU, scaling 2.446)

Routed experts are stored stacked (``w1``/``w3``: [E, F, D], ``w2``: [E, D, F]) and run as one
grouped matmul over expert-sorted tokens on CUDA (``torch.nn.functional.grouped_mm``); the
reference loops over the experts that received tokens. A few tokens without autograd (decode)
skip the sort: each (token, expert) pair reads its expert by id (``openk3.ops.moe.moe_gemv``).

Quantisation-aware training (``RoutedExperts.qat``, set by ``set_qat``; docs/mxfp4.md): with
``qat="mxfp4"`` the experts run on MXFP4 weights and MXFP8 (E4M3) inputs, fake-quantised in the
forward with straight-through gradients (``openk3.ops.mx``), in ``run_experts``, which every
layout (one device, MoonEP) calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk3.config import ModelConfig
from openk3.model.branch import Fork
from openk3.model.fuse import add_linear_, add_normed_linear_, fuse_weights, is_fused, project
from openk3.model.mla import RMSNorm
from openk3.ops.fast import use_fast_path
from openk3.ops.moe import combine_rows, group_pairs, moe_gemv, needs_grad, use_grouped_triton, use_moe_gemv
from openk3.ops.mx import (
    MX_BLOCK_SIZE,
    QAT_MODES,
    fake_quant_mxfp4,
    fake_quant_mxfp8_e4m3,
)
from openk3.ops.router import router_logits, router_topk
from openk3.ops.situ import situ_glu, swiglu_ref


def glu_act(cfg: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if cfg.hidden_act == "situ":
        return situ_glu(gate, up, cfg.situ_beta1, cfg.situ_beta2)
    return swiglu_ref(gate, up)


class MLP(nn.Module):
    """Dense GLU MLP: ``down(act(gate(x), up(x)))``."""

    def __init__(self, cfg: ModelConfig, dim: int, width: int):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.up_proj = nn.Linear(dim, width, bias=False)
        self.down_proj = nn.Linear(width, dim, bias=False)
        self.fused_proj: torch.Tensor | None = None  # gate|up, set by ``fuse()`` (inference)

    def input_projections(self) -> list[nn.Linear]:
        """The projections of x, in the row order of ``fused_proj``."""
        return [self.gate_proj, self.up_proj]

    def fuse(self) -> None:
        """One GEMM for ``input_projections()`` from now on (``openk3.model.fuse``)."""
        self.fused_proj = fuse_weights(self.input_projections(), self.fused_proj)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x, plus ``residual`` when given: the caller's own tensor of x's shape,
        which may be accumulated into in place (``openk3.model.fuse.add_linear_``)."""
        return self.output(*project(x, self.input_projections(), self.fused_proj), residual)

    def output(self, gate: torch.Tensor, up: torch.Tensor,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """``down(act(gate, up))`` of the input projections ``gate(x)``, ``up(x)`` (plus
        ``residual``, as in ``forward``)."""
        h = glu_act(self.cfg, gate, up)
        return self.down_proj(h) if residual is None else add_linear_(residual, h, self.down_proj)


class Router(nn.Module):
    """Sigmoid scores in fp32; top-k chosen on ``s + bias``; weights from the unbiased ``s``.

    ``e_score_correction_bias`` is the balancing bias (Quantile Balancing updates it during
    training; frozen at inference). It only affects *which* experts are chosen. The MoE layer
    uses only the choice and its weights; the scores are returned for load balancing, which
    reads them through a forward hook on this module (``openk3.train.balance.Balancer``).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, d] -> (scores [N, E] fp32, topk_idx [N, k], topk_weight [N, k] fp32)."""
        cfg = self.cfg
        logits = router_logits(x, self.weight)  # fp32 logits: one kernel when decoding on CUDA, bf16 halves past 32 tokens
        bias = self.e_score_correction_bias
        if cfg.num_expert_group > 1:  # group-limited routing: keep the best topk_group groups
            biased = torch.sigmoid(logits) + bias
            N, G = biased.shape[0], cfg.num_expert_group
            grouped = biased.view(N, G, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
            dropped = ~keep.unsqueeze(-1).expand_as(grouped).reshape(N, -1)
            bias = bias.masked_fill(dropped, float("-inf"))  # [N, E]: the dropped groups never win
        # on CUDA without autograd one kernel after the GEMM (openk3.ops.router)
        return router_topk(logits, bias, cfg.num_experts_per_token, cfg.moe_renormalize,
                           cfg.routed_scaling_factor)


def run_experts(cfg: ModelConfig, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                xs: torch.Tensor, counts: torch.Tensor, qat: str = "none",
                ends: torch.Tensor | None = None) -> torch.Tensor:
    """GLU experts over expert-sorted rows: xs [P, D] holds ``counts[e]`` rows for expert e in
    order; w1, w3: [E, F, D], w2: [E, D, F]; ``ends``: ``counts.cumsum(0)`` as int32 when the
    caller has it. Returns [P, D] in xs.dtype.

    One grouped matmul per projection on CUDA in bf16 (``grouped_mm``); the reference loops over
    the experts that received rows.

    ``qat="mxfp4"``: every weight is fake-quantised to MXFP4 in blocks of 32 along its input
    dimension (D for w1/w3, F for w2: the last one), and so are the inputs of each projection to
    MXFP8 E4M3 (xs in blocks of 32 along D, the GLU output along F); straight-through gradients.
    The quantised weights are exactly what ``save_pretrained(..., experts="mxfp4")`` packs."""
    if qat == "mxfp4":
        # fp32 masters are quantised as they are (before any cast to bf16, which is exact on
        # the MXFP4 grid), so the forward sees what the export writes, bit for bit
        w1, w3, w2 = fake_quant_mxfp4(w1), fake_quant_mxfp4(w3), fake_quant_mxfp4(w2)
        xs = fake_quant_mxfp8_e4m3(xs)
        quant_in = fake_quant_mxfp8_e4m3
    elif qat == "none":
        quant_in = None
    else:
        raise ValueError(f"run_experts: qat={qat!r}, choose one of {QAT_MODES}")

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        h = glu_act(cfg, gate, up)  # [rows, F]
        return h if quant_in is None else quant_in(h)

    if use_fast_path(xs) and xs.dtype == torch.bfloat16:
        offs = counts.cumsum(0).to(torch.int32) if ends is None else ends  # end of each expert's rows in xs
        if quant_in is None and not needs_grad(xs, w1, w3, w2) and use_grouped_triton(xs.shape[0]):
            from openk3.ops.moe_grouped_triton import grouped_experts_triton

            return grouped_experts_triton(xs, offs, w1, w3, w2, hidden_act=cfg.hidden_act,
                                          situ_beta1=cfg.situ_beta1, situ_beta2=cfg.situ_beta2)
        mm = getattr(F, "grouped_mm", None) or torch._grouped_mm  # public from torch 2.10
        # grouped_mm is not autocast-aware: fp32 master weights are cast here (a no-op under
        # FSDP's bf16 parameters or a bf16 model)
        w1, w3, w2 = (w.to(xs.dtype).transpose(-2, -1) for w in (w1, w3, w2))
        return mm(glu(mm(xs, w1, offs=offs), mm(xs, w3, offs=offs)), w2, offs=offs)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            xe = xs[start:start + n]
            outs.append(glu(xe @ w1[e].T, xe @ w3[e].T) @ w2[e].T)
            start += n
    # no rows at all: still an output of xs, so autograd runs the same graph on every rank (the
    # expert-parallel collectives around this call must be matched in backward)
    return torch.cat(outs) if outs else xs * 0


class RoutedExperts(nn.Module):
    """E GLU experts of input width D and hidden width F, stored stacked.

    ``qat``: ``"none"``, or ``"mxfp4"`` for the quantisation-aware forward (``run_experts``);
    not a ModelConfig field (the checkpoint format does not change), set with ``set_qat``."""

    def __init__(self, cfg: ModelConfig, dim: int):
        super().__init__()
        self.cfg = cfg
        E, Fw = cfg.num_experts, cfg.moe_intermediate_size
        self.w1 = nn.Parameter(torch.empty(E, Fw, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(E, Fw, dim))  # up
        self.w2 = nn.Parameter(torch.empty(E, dim, Fw))  # down
        self.qat = "none"

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """x: [N, D]; topk_idx, topk_weight: [N, k]. Returns sum_j w_j E_j(x) in fp32, [N, D].

        A few pairs without autograd (decode) run as GEMVs by expert id (``use_moe_gemv``);
        everything else through ``forward_sorted``, as does every batch under QAT (the GEMV
        kernels do not quantise the GLU output between their two GEMMs)."""
        if (self.qat == "none" and use_moe_gemv(x, topk_idx.numel())
                and not needs_grad(x, topk_weight, *self.parameters())):
            cfg = self.cfg
            return moe_gemv(x, self.w1, self.w3, self.w2, topk_idx, topk_weight,
                            hidden_act=cfg.hidden_act, situ_beta1=cfg.situ_beta1,
                            situ_beta2=cfg.situ_beta2)
        return self.forward_sorted(x, topk_idx, topk_weight)

    def forward_sorted(self, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weight: torch.Tensor) -> torch.Tensor:
        """``forward`` with the pairs sorted by expert and one grouped matmul per projection
        (``run_experts``): training, and batches too large for the GEMVs."""
        position, token_of_row, counts, ends = group_pairs(topk_idx, self.cfg.num_experts)
        ys = run_experts(self.cfg, self.w1, self.w3, self.w2, x[token_of_row], counts, self.qat, ends)
        return combine_rows(ys, position, topk_weight)


def set_qat(model: nn.Module, qat: str) -> None:
    """Run every routed-expert layer of ``model`` (``RoutedExperts``, including the MTP layer's)
    with ``qat``: ``"mxfp4"`` fake-quantises expert weights to MXFP4 and expert inputs to MXFP8
    in the forward (``run_experts``), ``"none"`` turns it off. Packed experts
    (``openk3.model.packed_experts.PackedRoutedExperts``, already MXFP4) take the same setting
    for their inputs. Call it before ``openk3.parallel.parallelize``: MoonEP's expert shares
    copy the setting.

    Raises ValueError for an unknown mode, or when an expert's input width (D, or F for w2) is
    not a multiple of the MX block of 32, naming the config field."""
    if qat not in QAT_MODES:
        raise ValueError(f"qat={qat!r}: choose one of {QAT_MODES}")
    from openk3.model.packed_experts import PackedRoutedExperts  # it builds on this module

    for module in model.modules():
        if isinstance(module, (RoutedExperts, PackedRoutedExperts)):
            if qat != "none":
                check_qat_dims(module.cfg)
            module.qat = qat


def check_qat_dims(cfg: ModelConfig) -> None:
    """MX blocks of 32 run along each expert projection's input: D (``moe_latent_size``, or
    ``hidden_size`` without a latent) and F (``moe_intermediate_size``)."""
    dim_field = "moe_latent_size" if cfg.moe_latent_size is not None else "hidden_size"
    for field in (dim_field, "moe_intermediate_size"):
        if getattr(cfg, field) % MX_BLOCK_SIZE:
            raise ValueError(f"MXFP4 experts (QAT, packing) need ModelConfig.{field}={getattr(cfg, field)} "
                             f"divisible by {MX_BLOCK_SIZE} (one MX block per 32 expert inputs)")


class MoE(nn.Module):
    """Stable LatentMoE (K3) or full-width MoE (Kimi Linear), plus shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, latent = cfg.hidden_size, cfg.moe_latent_size
        self.gate = Router(cfg)
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(d, latent, bias=False)
            self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(latent, d, bias=False)
        self.experts = RoutedExperts(cfg, latent or d)
        self.shared_experts = MLP(cfg, d, cfg.moe_intermediate_size * cfg.num_shared_experts)
        # set by ``fuse()`` (inference, latent MoE): routed down | shared gate | shared up
        self.fused_proj: torch.Tensor | None = None

    def input_projections(self) -> list[nn.Linear]:
        """The projections of x besides the router's, in the row order of ``fused_proj``: the
        latent MoE's ``routed_expert_down_proj``, then the shared experts' gate and up."""
        latent = [self.routed_expert_down_proj] if self.cfg.moe_latent_size is not None else []
        return [*latent, *self.shared_experts.input_projections()]

    def fuse(self) -> None:
        """One GEMM for ``input_projections()`` from now on (``openk3.model.fuse``); the shared
        experts' own fused gate|up is then a view of the last rows (fusing them is a no-op).
        Without a latent (Kimi Linear) the experts read x itself: only the shared experts fuse."""
        if self.cfg.moe_latent_size is None:
            return
        fused = fuse_weights(self.input_projections(), self.fused_proj)
        if fused is not self.fused_proj:  # fusing twice is a no-op
            shared_rows = sum(m.out_features for m in self.shared_experts.input_projections())
            self.fused_proj, self.shared_experts.fused_proj = fused, fused[fused.shape[0] - shared_rows:]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE of x [..., d], plus ``residual`` when given: the caller's own tensor of x's
        shape, which may be accumulated into in place (``openk3.model.fuse.add_linear_``: at
        inference the latent MoE's two output GEMMs add into it, no add kernel)."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])  # [N, d]
        if self.cfg.moe_latent_size is None:
            _, topk_idx, topk_weight = self.gate(xf)
            routed = self.experts(xf, topk_idx, topk_weight).to(x.dtype).view(shape)
            return self.shared_experts(x, routed if residual is None else routed + residual)
        # in a captured decode graph, the router runs beside the input GEMM and the shared
        # experts beside the routed ones (``openk3.model.branch``; elsewhere in order)
        fork = Fork(xf)
        with fork.side():
            _, topk_idx, topk_weight = self.gate(xf)
        out = None if residual is None else residual.view(xf.shape)
        if is_fused(self.fused_proj, self.input_projections()):  # inference: one GEMM for three
            down, gate, up = project(xf, self.input_projections(), self.fused_proj)
            fork.join()
            with fork.side():
                out = self.shared_experts.output(gate, up, out)
        else:  # training: the shared experts' own forward on x's shape, as the dense MLPs' (one
            # compiled graph for both: openk3.parallel.compile)
            fork.join()
            down = self.routed_expert_down_proj(xf)
            out = self.shared_experts(x, residual)
        u = self.experts(down, topk_idx, topk_weight)
        fork.join()
        # the norm in fp32 (u is), cast to x's dtype; for a few rows the up GEMV's prologue
        out = add_normed_linear_(out, u.view(*out.shape[:-1], u.shape[-1]), self.routed_expert_norm,
                                 self.routed_expert_up_proj, x.dtype)
        # training's sum is a tensor of x's shape, returned as it is: a view of it would make FSDP2
        # warn that the layer returns a view (an in-place op on one would skip its all-gather)
        return out if out.shape == shape else out.view(shape)
