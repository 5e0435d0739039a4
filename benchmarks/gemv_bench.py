"""The decode step's projections: cuBLAS (``F.linear``, ``addmm_``) against openk3's Triton GEMV
(``openk3.ops.gemv``) for each weight shape one decode step of ``small`` multiplies, at 1 and 4
rows, and the weight-read floor (issue P8).

Each timed graph runs ``reps`` calls in stream order, each on its own copy of the weight (the
copies together exceed the H200's 60 MB of L2, as a decode step's 24 layers of weights do), so
a call's time is the graph's replay time over ``reps``: the latency one projection adds to a
dependent chain. ``--sweep M ...`` also times, at those row counts, every (BLOCK_N, BLOCK_K, warps) of a small
grid against ``gemv_blocks``' pick: the data for that heuristic. ``--norms`` times the two norms
a decode step folds into its GEMVs (``openk3.ops.gemv.norm_linear``: the latent MoE's RMSNorm
before its up projection, KDA's gated output norm before ``o_proj``) against the norm kernel
followed by the GEMV (``FOLD_NORMS`` off), at each ``--rows``.

Run on the device: ``python benchmarks/gemv_bench.py [--preset small] [--rows 1 4 8] [--sweep 1 4] [--norms]``.
"""

from __future__ import annotations

import argparse
import collections

import torch

from benchmarks.common import environment, write_results
from benchmarks.moe_decode_bench import graph_time
from openk3 import build_model, preset
from openk3.model.fuse import fuse_projections
from openk3.model.moe import MoE
from openk3.ops import gemv
from openk3.ops.gemv import gemv_blocks, gemv_ref, norm_linear

BANDWIDTH = 4.3e12  # bytes/s: the H200's device-to-device copy (shared/NOTES.md)
L2_BYTES = 60 << 20


def step_shapes(name: str) -> collections.Counter:
    """(N, K) of every projection of one decode step of preset ``name`` -> calls per step:
    the fused input projections and the single ones the decode path multiplies by."""
    with torch.device("meta"):
        model = build_model(preset(name)).requires_grad_(False)
    fuse_projections(model)
    # a latent MoE multiplies its shared experts' gate|up inside its own fused projection
    inside = {id(m.shared_experts) for m in model.modules() if isinstance(m, MoE) and m.cfg.moe_latent_size}
    shapes = collections.Counter()
    for m in model.modules():
        if getattr(m, "fused_proj", None) is not None and id(m) not in inside:
            shapes[tuple(m.fused_proj.shape)] += 1
        for name_ in ("o_proj", "f_b_proj", "q_b_proj", "down_proj", "routed_expert_up_proj"):
            lin = getattr(m, name_, None)
            if lin is not None:
                shapes[tuple(lin.weight.shape)] += 1
    return shapes


def time_calls(fn, weights: list[torch.Tensor], x: torch.Tensor, reps: int) -> float:
    """Microseconds per call of ``fn(x, w)`` over ``reps`` calls cycling through ``weights``."""
    return graph_time(lambda: [fn(x, weights[i % len(weights)]) for i in range(reps)]) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=64)
    ap.add_argument("--sweep", type=int, nargs="*", default=[], metavar="M",
                    help="sweep the kernel's blocks at these row counts (of --rows)")
    ap.add_argument("--norms", action="store_true", help="only the folded norms against norm + GEMV")
    args = ap.parse_args()
    print(environment())
    if args.norms:
        write_results("gemv_norms", norm_rows(args.preset, args.rows, args.reps))
        return
    from openk3.ops.gemv_kernels import gemv_triton  # needs triton: the device

    rows = []
    shapes = step_shapes(args.preset)
    for (N, K), calls in sorted(shapes.items()):
        copies = max(2, min(64, -(-2 * L2_BYTES // (N * K * 2))))
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        for M in args.rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            out = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            bn, bk, warps = gemv_blocks(M, N, K)
            fast = gemv_triton(x, weights[0], torch.empty_like(out), False, bn, bk, warps)
            ref = gemv_ref(x, weights[0])
            row = {"N": N, "K": K, "M": M, "calls_per_step": calls,
                   "floor_us": N * K * 2 / BANDWIDTH * 1e6,
                   "err": ((fast.float() - ref.float()).norm() / ref.float().norm()).item(),
                   "cublas_us": time_calls(lambda x_, w: torch.nn.functional.linear(x_, w), weights, x, args.reps),
                   "cublas_addmm_us": time_calls(lambda x_, w: out.addmm_(x_, w.t()), weights, x, args.reps),
                   "gemv_us": time_calls(lambda x_, w: gemv_triton(x_, w, torch.empty_like(out), False, bn, bk, warps),
                                         weights, x, args.reps),
                   "gemv_add_us": time_calls(lambda x_, w: gemv_triton(x_, w, out, True, bn, bk, warps),
                                             weights, x, args.reps),
                   "blocks": [bn, bk, warps]}
            if M in args.sweep:
                best = None
                for bn_ in (1, 2, 4, 8):
                    for bk_ in (128, 256, 512, 1024):
                        for w_ in (2, 4):
                            if triton_pow2(M) * bn_ * bk_ > 8192 or bk_ > max(128, 2 * K):
                                continue
                            us = time_calls(lambda x_, w: gemv_triton(x_, w, torch.empty_like(out), False, bn_, bk_, w_),
                                            weights, x, args.reps)
                            if best is None or us < best[0]:
                                best = (us, [bn_, bk_, w_])
                row["sweep_best_us"], row["sweep_best_blocks"] = best
            print(row, flush=True)
            rows.append(row)
        del weights
    for M in args.rows:
        per = [r for r in rows if r["M"] == M]
        total = {k: sum(r[k] * r["calls_per_step"] for r in per) for k in ("cublas_us", "gemv_us", "floor_us")}
        summary = {"M": M, "per_step": True, **{f"{k}_per_step": v for k, v in total.items()}}
        print(summary, flush=True)
        rows.append(summary)
    write_results("gemv_bench", rows)


def norm_rows(name: str, row_counts: list[int], reps: int) -> list[dict]:
    """The folded norms of preset ``name``'s decode step against the norm kernel + the GEMV."""
    cfg = preset(name)
    H, V, d = cfg.linear_num_heads, cfg.linear_head_dim, cfg.hidden_size
    cases = [("kda o_proj, gated norm", d, H * V, V, torch.bfloat16)]
    if cfg.moe_latent_size is not None:
        cases.append(("moe up_proj, rms norm, add", d, cfg.moe_latent_size, None, torch.float32))
    rows = []
    for label, N, K, G, x_dtype in cases:
        copies = max(2, min(64, -(-2 * L2_BYTES // (N * K * 2))))
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        nw = torch.rand(G or K, device="cuda", dtype=torch.bfloat16) + 0.5
        for M in row_counts:
            x = torch.randn(M, K, device="cuda", dtype=x_dtype)
            gate = None if G is None else torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            out = None if G is not None else torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            row = {"case": label, "N": N, "K": K, "M": M}
            for fold in (False, True):
                gemv.FOLD_NORMS = fold
                row["folded_us" if fold else "norm_then_gemv_us"] = time_calls(
                    lambda x_, w: norm_linear(x_, w, nw, 1e-6, gate=gate, out=out), weights, x, reps)
            gemv.FOLD_NORMS = True
            print(row, flush=True)
            rows.append(row)
    return rows


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
