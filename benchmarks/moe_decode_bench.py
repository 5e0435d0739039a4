"""Routed experts of a few tokens (decode): the Triton GEMVs (``openk3.ops.moe.moe_gemv``) vs the
grouped-matmul path (``RoutedExperts.forward_sorted``: sort, counts, three ``grouped_mm``) vs the
memory floor, for one MoE layer of ``small`` and of K3 (bf16 weights, uniform random routing).

Each path is captured in a CUDA graph, as serving's decode step is, and timed over replays with
CUDA events (median). Floor: every expert the batch uses read once (3 F D x 2 bytes) at 4.3 TB/s.
The GEMVs read an expert once per pair that chose it (``per_pair_floor_us``); below that, L2
served the repeats. The last lines give, per layer, the largest measured batch at which the
GEMVs still win: where ``openk3.ops.moe.GEMV_MAX_PAIRS`` belongs.

``--router`` times the router of the same layers instead (``Router``'s logits and top-k on
bf16 tokens): its logits by the Triton GEMV (``openk3.ops.router.router_logits``) against the
cast and cuBLAS's fp32 GEMM, and against the split bf16 GEMM on the weight's two halves
(``backend="split"``, what more than ``LOGITS_GEMV_MAX_TOKENS`` tokens take: seven kernels where
the fp32 GEMM takes two); it prints the largest batch at which the GEMV still won (where
``openk3.ops.router.LOGITS_GEMV_MAX_TOKENS`` belongs) and the smallest at which the split GEMM
beat the fp32 one without autograd (serving's batches between the two could keep the fp32 GEMM).

``--rows R ...`` also times the GEMVs with ``R`` output rows per program
(``openk3.ops.moe_kernels.ROWS``, 16 by default; fewer rows give more, shorter programs), one
``gemv_us_rows_R`` column each: the data for choosing it.

Run on the device (K3's layer holds 59 GB of bf16 experts):
``python benchmarks/moe_decode_bench.py [--presets small k3] [--tokens 1 8 32 128] [--rows 4 8 32]
[--router [--logits-blocks 1x1024 2x512]]``.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time, environment, write_results
from openk3 import preset
from openk3.model.moe import RoutedExperts
from openk3.ops import router
from openk3.ops.moe import GEMV_MAX_PAIRS, moe_gemv
from openk3.ops.router import LOGITS_GEMV_MAX_TOKENS, router_logits, router_topk

BANDWIDTH = 4.3e12  # bytes/s: the H200's device-to-device copy (shared/NOTES.md)


def experts_layer(name: str) -> RoutedExperts:
    """One MoE layer's routed experts, bf16 on the GPU, allocated there directly (K3's would
    not fit in host memory as fp32)."""
    cfg = preset(name)
    with torch.device("meta"):
        ex = RoutedExperts(cfg, cfg.moe_latent_size or cfg.hidden_size)
    ex = ex.to(torch.bfloat16).to_empty(device="cuda").requires_grad_(False)
    for w in (ex.w1, ex.w3, ex.w2):
        w.normal_(0, w.shape[-1] ** -0.5)
    return ex


def graph_time(fn) -> float:
    """Median seconds per replay of ``fn`` captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compilation and allocator warm-up stay out of the graph
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time(graph.replay, warmup=3, iters=20)


def run(name: str, ex: RoutedExperts, N: int, rows_options: list[int]) -> dict:
    cfg = ex.cfg
    E, F, D = ex.w1.shape
    k = cfg.num_experts_per_token
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    topk_idx = torch.rand(N, E, device="cuda").topk(k).indices
    topk_weight = torch.rand(N, k, device="cuda")
    act = dict(hidden_act=cfg.hidden_act, situ_beta1=cfg.situ_beta1, situ_beta2=cfg.situ_beta2)
    used = topk_idx.unique().numel()
    from openk3.ops import moe_kernels  # needs triton: the device

    def gemv_fn():
        return moe_gemv(x, ex.w1, ex.w3, ex.w2, topk_idx, topk_weight, **act)

    with torch.inference_mode():
        gemv = graph_time(gemv_fn)
        grouped = graph_time(lambda: ex.forward_sorted(x, topk_idx, topk_weight))
        by_rows, default_rows = {}, moe_kernels.ROWS
        try:
            for rows in rows_options:  # the kernels read ROWS when launched
                moe_kernels.ROWS = rows
                by_rows[f"gemv_us_rows_{rows}"] = 1e6 * graph_time(gemv_fn)
        finally:
            moe_kernels.ROWS = default_rows
    expert_s = 3 * F * D * 2 / BANDWIDTH  # one expert's W1, W3, W2 in bf16
    floor = used * expert_s
    return {"layer": name, "tokens": N, "pairs": N * k, "experts_used": used,
            "gemv_us": 1e6 * gemv, "grouped_us": 1e6 * grouped, "floor_us": 1e6 * floor,
            "per_pair_floor_us": 1e6 * N * k * expert_s, "gemv_over_floor": gemv / floor,
            "grouped_over_gemv": grouped / gemv, **by_rows}


def run_router(name: str, N: int, logits_blocks: list[tuple[int, int]] = ()) -> dict:
    """One MoE layer's router on N bf16 tokens: logits by the GEMV, by cuBLAS's fp32 GEMM and by
    the split bf16 GEMM, then top-k; and the GEMV with each (experts, columns) per program of
    ``logits_blocks`` (``openk3.ops.router.LOGITS_ROWS``, ``LOGITS_COLS``)."""
    cfg = preset(name)
    E, d, k = cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_token
    weight = torch.randn(E, d, device="cuda") * d ** -0.5  # fp32, as K3's router
    bias = torch.zeros(E, device="cuda")
    x = torch.randn(N, d, device="cuda", dtype=torch.bfloat16)
    times = {}
    with torch.inference_mode():
        for backend in ("triton", "torch", "split"):
            times[backend] = graph_time(lambda: router_topk(
                router_logits(x, weight, backend=backend), bias, k, cfg.moe_renormalize,
                cfg.routed_scaling_factor))
        default_blocks = router.LOGITS_ROWS, router.LOGITS_COLS
        try:
            for blocks in logits_blocks:  # the launch reads them
                router.LOGITS_ROWS, router.LOGITS_COLS = blocks
                times[blocks] = graph_time(lambda: router_topk(
                    router_logits(x, weight, backend="triton"), bias, k, cfg.moe_renormalize,
                    cfg.routed_scaling_factor))
        finally:
            router.LOGITS_ROWS, router.LOGITS_COLS = default_blocks
    floor = E * d * 4 / BANDWIDTH  # the fp32 weight read once
    return {"layer": name, "tokens": N, "gemv_us": 1e6 * times["triton"],
            **{f"gemv_us_blocks_{r}x{c}": 1e6 * times[r, c] for r, c in logits_blocks},
            "cublas_us": 1e6 * times["torch"], "split_us": 1e6 * times["split"], "floor_us": 1e6 * floor,
            "cublas_over_gemv": times["torch"] / times["triton"],
            "cublas_over_split": times["torch"] / times["split"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["small", "k3"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--rows", type=int, nargs="*", default=[],
                    help="also time the GEMVs with these rows per program (powers of two)")
    ap.add_argument("--router", action="store_true", help="time the router instead of the experts")
    ap.add_argument("--logits-blocks", nargs="*", default=[], metavar="ROWSxCOLS",
                    help="with --router, also time its logits GEMV with these experts x columns per "
                         "program (e.g. 1x1024 2x512)")
    args = ap.parse_args()
    print(environment())
    rows = []
    if args.router:
        for name in args.presets:
            for N in args.tokens:
                blocks = [tuple(map(int, b.split("x"))) for b in args.logits_blocks]
                rows.append(run_router(name, N, blocks))
                write_results("moe_router_bench", rows)
        print(f"LOGITS_GEMV_MAX_TOKENS is {LOGITS_GEMV_MAX_TOKENS}; the largest batch where the GEMV won:")
        for name in args.presets:
            won = [r["tokens"] for r in rows if r["layer"] == name and r["cublas_over_gemv"] > 1]
            print(f"  {name}: {max(won) if won else 'none'}")
        print("the smallest batch where the split bf16 GEMM beat the fp32 one (no autograd):")
        for name in args.presets:
            won = [r["tokens"] for r in rows if r["layer"] == name and r["cublas_over_split"] > 1]
            print(f"  {name}: {min(won) if won else 'none'}")
        return
    for name in args.presets:
        ex = experts_layer(name)
        for N in args.tokens:  # results are written after every row: a timeout keeps them
            rows.append(run(name, ex, N, args.rows))
            write_results("moe_decode_bench", rows)
        del ex
        torch.cuda.empty_cache()
    print(f"GEMV_MAX_PAIRS is {GEMV_MAX_PAIRS}; pairs at the largest batch where the GEMVs won:")
    for name in args.presets:
        won = [r["pairs"] for r in rows if r["layer"] == name and r["grouped_over_gemv"] > 1]
        print(f"  {name}: {max(won) if won else 'none'}")


if __name__ == "__main__":
    main()
