"""GPU time of one Quantile Balancing update of every router (issue P7): the k-th value down the
strided token dimension, router by router (the update until the fourteenth session), against
the same along contiguous rows, router by router and all routers at once (``Balancer.update``);
and the margins' per-token thresholds, the (k+1)-th largest biased score, by ``topk`` (until the
fifteenth session), by a sort, and by the Triton kernel ``qb_margins`` now runs
(``openk3.ops.router.kth_largest``).

    python benchmarks/qb_speed.py [--tokens 16384 --experts 64 --k 4 --layers 23]

Defaults: ``small`` at batch 4 x 4096. Floor: the margins are read once by the k-th value
(layers x tokens x experts x 4 bytes) at the copy bandwidth (~4.3 TB/s).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time, environment, write_results
from openk3.ops.router import kth_largest
from openk3.train.balance import qb_margins, qb_update_exact, target_load


def strided(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """The earlier update: the k-th value along dim 0 of the [N, E] margins."""
    r = qb_margins(scores, bias, k)
    N, E = r.shape
    new = bias.float() - r.kthvalue(N - target_load(N, k, E), dim=0).values
    return new - new.mean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=23)
    args = ap.parse_args()
    print(environment())
    L, N, E, k = args.layers, args.tokens, args.experts, args.k
    scores = torch.rand(L, N, E, device="cuda").sigmoid()
    bias = torch.randn(L, E, device="cuda") * 0.01
    ref = torch.stack([strided(s, b, k) for s, b in zip(scores, bias)])
    new = qb_update_exact(scores, bias, k)
    max_diff = (new - ref).abs().max().item()
    variants = {
        "kthvalue down tokens, per router": lambda: [strided(s, b, k) for s, b in zip(scores, bias)],
        "kthvalue along rows, per router": lambda: [qb_update_exact(s, b, k) for s, b in zip(scores, bias)],
        "kthvalue along rows, all routers": lambda: qb_update_exact(scores, bias, k),
        "thresholds: topk(k+1)": lambda: kth_largest(scores + bias[:, None], k + 1, backend="torch"),
        "thresholds: sort": lambda: (scores + bias[:, None]).sort(dim=-1).values[..., -(k + 1)],
        "thresholds: Triton k-th largest": lambda: kth_largest(scores + bias[:, None], k + 1),
    }
    floor_ms = L * N * E * 4 / 4.3e12 * 1e3
    rows = [{"variant": name, "ms": cuda_time(fn) * 1e3, "floor_ms": floor_ms, "max_diff_vs_first": max_diff}
            for name, fn in variants.items()]
    for r in rows:
        print(f"{r['variant']:36s} {r['ms']:8.3f} ms  (floor {floor_ms:.3f} ms)")
    write_results("qb_speed", rows)


if __name__ == "__main__":
    main()
