"""A latent MoE layer's output at decode: the fused kernel (``openk3.ops.moe_output``, one launch)
vs the unfused path of ``MoE.forward`` (four: the shared experts' GLU, their down GEMM adding into
the residual, the routed latent's RMSNorm, the up GEMM adding into it) vs the memory floor, for
one layer of ``small`` and of K3 (bf16 weights, N tokens).

Each path is captured in a CUDA graph and timed over replays with CUDA events (median), as
serving's decode step runs it. Floor: both weights read once, (d F + d L) x 2 bytes, plus per token
the residual read and written, gate, up, u (fp32), at 4.3 TB/s. ``rel_err`` is the fused output's
distance to the unfused one on the same inputs (one bf16 rounding: ~1e-3). The last lines give,
per layer, the largest measured batch at which the kernel still wins: where
``openk3.ops.moe_output.MOE_OUTPUT_MAX_TOKENS`` belongs.

``--rows R ...`` also times the kernel with ``R`` output rows per program
(``openk3.ops.moe_output_triton.ROWS``), one ``fused_us_rows_R`` column each.

Run on the device: ``python benchmarks/moe_output_bench.py [--presets small k3]
[--tokens 1 2 4 8 16] [--rows 4 16]``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from benchmarks.common import environment, rel_err, write_results
from benchmarks.moe_decode_bench import BANDWIDTH, graph_time
from openk3 import preset
from openk3.config import ModelConfig
from openk3.model.fuse import add_linear_
from openk3.model.mla import RMSNorm
from openk3.model.moe import MLP
from openk3.ops.moe_output import MOE_OUTPUT_MAX_TOKENS, moe_output
from openk3.ops.norm import rms_norm


def output_layer(name: str) -> tuple[ModelConfig, nn.ModuleDict]:
    """One MoE layer's output modules (shared experts, latent norm, up projection), bf16 on the
    GPU, allocated there directly."""
    cfg = preset(name)
    d, L = cfg.hidden_size, cfg.moe_latent_size
    with torch.device("meta"):
        parts = nn.ModuleDict(dict(shared=MLP(cfg, d, cfg.moe_intermediate_size * cfg.num_shared_experts),
                                   norm=RMSNorm(L, cfg.rms_norm_eps), up_proj=nn.Linear(L, d, bias=False)))
    parts = parts.to(torch.bfloat16).to_empty(device="cuda").requires_grad_(False)
    for p in parts.parameters():
        p.normal_(0, p.shape[-1] ** -0.5)
    parts["norm"].weight.fill_(1.0)
    return cfg, parts


def run(name: str, cfg: ModelConfig, parts: nn.ModuleDict, N: int, rows_options: list[int]) -> dict:
    shared, norm, up_proj = parts["shared"], parts["norm"], parts["up_proj"]
    d, L = cfg.hidden_size, cfg.moe_latent_size
    F = shared.down_proj.in_features
    proj = torch.randn(N, L + 2 * F, device="cuda", dtype=torch.bfloat16)  # the fused projection's output
    gate, up = proj[:, L:L + F], proj[:, L + F:]
    u = torch.randn(N, L, device="cuda")
    residual = torch.randn(N, d, device="cuda", dtype=torch.bfloat16)
    act = dict(hidden_act=cfg.hidden_act, situ_beta1=cfg.situ_beta1, situ_beta2=cfg.situ_beta2)
    from openk3.ops import moe_output_triton  # needs triton: the device

    def fused(out: torch.Tensor) -> torch.Tensor:
        return moe_output(out, gate, up, u, shared.down_proj.weight, norm.weight, up_proj.weight,
                          norm_eps=norm.eps, **act, backend="triton")

    def unfused(out: torch.Tensor) -> torch.Tensor:  # MoE.forward's inference path, after the experts
        out = shared.output(gate, up, out)
        return add_linear_(out, rms_norm(u, norm.weight, norm.eps, out_dtype=torch.bfloat16), up_proj)

    with torch.inference_mode():
        err = rel_err(fused(residual.clone()), unfused(residual.clone()))
        # both accumulate into the residual at every replay: it grows by O(1) a replay, harmlessly
        fused_s = graph_time(lambda: fused(residual))
        unfused_s = graph_time(lambda: unfused(residual))
        by_rows, default_rows = {}, moe_output_triton.ROWS
        try:
            for rows in rows_options:  # the launcher reads ROWS when it launches
                moe_output_triton.ROWS = rows
                by_rows[f"fused_us_rows_{rows}"] = 1e6 * graph_time(lambda: fused(residual))
        finally:
            moe_output_triton.ROWS = default_rows
    weights = (d * F + d * L) * 2
    per_token = 2 * F * 2 + L * 4 + 2 * d * 2
    floor = (weights + L * 2 + N * per_token) / BANDWIDTH
    return {"layer": name, "tokens": N, "fused_us": 1e6 * fused_s, "unfused_us": 1e6 * unfused_s,
            "floor_us": 1e6 * floor, "unfused_over_fused": unfused_s / fused_s,
            "fused_over_floor": fused_s / floor, "rel_err": err, **by_rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["small", "k3"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rows", type=int, nargs="*", default=[],
                    help="also time the kernel with these rows per program (powers of two)")
    args = ap.parse_args()
    print(environment())
    rows = []
    for name in args.presets:
        cfg, parts = output_layer(name)
        for N in args.tokens:  # results are written after every row: a timeout keeps them
            rows.append(run(name, cfg, parts, N, args.rows))
            write_results("moe_output_bench", rows)
        del parts
        torch.cuda.empty_cache()
    print("\n| layer | tokens | fused us | unfused us | floor us | unfused / fused |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['tokens']} | {r['fused_us']:.2f} | {r['unfused_us']:.2f} | "
              f"{r['floor_us']:.2f} | {r['unfused_over_fused']:.2f} |")
    print(f"MOE_OUTPUT_MAX_TOKENS is {MOE_OUTPUT_MAX_TOKENS}; the largest batch where the kernel won:")
    for name in args.presets:
        won = [r["tokens"] for r in rows if r["layer"] == name and r["unfused_over_fused"] > 1]
        print(f"  {name}: {max(won) if won else 'none'}")


if __name__ == "__main__":
    main()
