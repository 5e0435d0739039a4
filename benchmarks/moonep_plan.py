"""MoonEP planner vs DeepSeek EPLB-style greedy replication on the same loads (CPU).

For E=896 experts over R in {8, 16, 64} ranks, both planners get the same redundancy budget:
E/R redundant slots per rank (EPLB: ``num_redundant = E`` copies, packed 2E/R per rank). Loads are
token-expert pairs of one step, ``pairs_per_rank * R`` in total:
uniform (each pair to a uniformly random expert), zipf (p_e ~ rank^-1.2, experts in random
order), one_expert (all pairs to expert 0), one_rank (all pairs to rank 0's experts, uniformly).

Run from the repository root: ``python -m benchmarks.moonep_plan [--repeats 15]`` (~1 min on one
core). Prints a markdown table: max/mean rank load, replicas used, median planning time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from openk3.parallel.eplb import plan_eplb
from openk3.parallel.moonep import plan, plan_naive

NUM_EXPERTS = 896
RANKS = (8, 16, 64)
LOADS = ("uniform", "zipf", "one_expert", "one_rank")


def make_load(kind: str, E: int, R: int, pairs_per_rank: int, seed: int = 0) -> torch.Tensor:
    """[E] int64 token-expert pairs per expert, total = pairs_per_rank * R."""
    g = torch.Generator().manual_seed(seed)
    total = pairs_per_rank * R
    p_E = torch.zeros(E, dtype=torch.float64)
    if kind == "uniform":
        p_E[:] = 1
    elif kind == "zipf":
        p_E = (torch.arange(1, E + 1, dtype=torch.float64) ** -1.2)[torch.randperm(E, generator=g)]
    elif kind == "one_expert":
        p_E[0] = 1
    elif kind == "one_rank":
        p_E[: E // R] = 1
    else:
        raise ValueError(f"unknown load kind {kind!r}")
    return torch.multinomial(p_E, total, replacement=True, generator=g).bincount(minlength=E)


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def imbalance(rank_load: torch.Tensor) -> float:
    rank_load = rank_load.double()
    return float(rank_load.max() / rank_load.mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs-per-rank", type=int, default=4096 * 16, help="S*K per rank")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    E = NUM_EXPERTS
    print(f"E={E}, S*K={args.pairs_per_rank} pairs per rank, redundancy E/R slots per rank, "
          f"median of {args.repeats} runs, 1 CPU thread, torch {torch.__version__}\n")
    print("| R | load | no replication max/mean | MoonEP max/mean | EPLB max/mean "
          "| MoonEP replicas (moves) | EPLB replicas | MoonEP ms | MoonEP naive ms | EPLB ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for R in RANKS:
        for kind in LOADS:
            load = make_load(kind, E, R, args.pairs_per_rank)
            moon, eplb = plan(load, R), plan_eplb(load, R, num_redundant=E)
            assert (moon.rank_load() == args.pairs_per_rank).all()
            t_moon = median_seconds(lambda: plan(load, R, validate=False), args.repeats)
            t_naive = median_seconds(lambda: plan_naive(load, R), args.repeats)
            t_eplb = median_seconds(lambda: plan_eplb(load, R, E), args.repeats)
            no_rep = imbalance(load.view(R, -1).sum(1))
            print(f"| {R} | {kind} | {no_rep:.4f} | {imbalance(moon.rank_load()):.4f} "
                  f"| {imbalance(eplb.rank_load()):.4f} "
                  f"| {moon.num_replicas()} ({moon.num_moves()}) | {eplb.num_replicas()} "
                  f"| {1e3 * t_moon:.2f} | {1e3 * t_naive:.2f} | {1e3 * t_eplb:.2f} |")


if __name__ == "__main__":
    main()
