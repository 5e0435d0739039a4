"""DeepSeek EPLB-style greedy expert replication, the peer MoonEP is compared against.

This follows the public description of DeepSeek's Expert Parallelism Load Balancer (its global
policy): give the ``num_redundant`` extra copies one at a time to the expert with the largest
load per copy, assume every copy of an expert receives an equal share of its load, then pack all
physical copies onto ranks, heaviest first, each onto the currently least-loaded rank that still
has a free slot (every rank gets ``(E + num_redundant) / R`` copies). Unlike MoonEP it may move
home experts too and it is not exact: a rank's load is whatever the packing gives.

The assignment is fractional (float64): each copy of expert e carries ``load_e / copies_e``
pairs. Real dispatch would round these shares; keeping them fractional shows the packing's own
imbalance without rounding noise and only flatters the baseline.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EPLBPlan:
    """Fields (E experts, R ranks, P = (E + num_redundant) / R physical slots per rank):
        assignment:    [E, R] float64, expected pairs of expert e processed on rank r.
        placement:     [R, P] int64, logical expert held in each physical slot.
        replica_count: [E] int64, physical copies of each expert (>= 1).
    """

    assignment: torch.Tensor
    placement: torch.Tensor
    replica_count: torch.Tensor

    def rank_load(self) -> torch.Tensor:
        """[R] float64 expected pairs processed by each rank."""
        return self.assignment.sum(0)

    def num_replicas(self) -> int:
        """Copies beyond the first of each expert (always ``num_redundant``)."""
        return int((self.replica_count - 1).sum())


def plan_eplb(expert_load: torch.Tensor, num_ranks: int, num_redundant: int) -> EPLBPlan:
    """Greedy replication + greedy packing of ``expert_load`` [E] over ``num_ranks`` ranks.

    ``num_redundant`` extra copies in total; E + num_redundant must be divisible by R. Runs on
    the host in Python (as DeepSeek's balancer does: it plans from historical loads, off the
    critical path); the result is moved to the device of ``expert_load``.

    Example:
        >>> plan_eplb(torch.tensor([6, 0, 1, 1]), 2, 2).rank_load().tolist()
        [4.0, 4.0]
    """
    if expert_load.dim() != 1:
        raise ValueError(f"expert_load must be 1-D [E], got shape {tuple(expert_load.shape)}")
    E, R = expert_load.shape[0], num_ranks
    if E == 0:
        raise ValueError("expert_load is empty: there are no experts to place")
    if R < 1 or num_redundant < 0 or (E + num_redundant) % R != 0:
        raise ValueError(f"E + num_redundant = {E} + {num_redundant} must be divisible by "
                         f"num_ranks R={R} (R >= 1, num_redundant >= 0)")
    load = [float(x) for x in expert_load.tolist()]
    if min(load) < 0:
        raise ValueError("expert_load must be non-negative")

    copies = [1] * E
    heaviest = [(-w, e) for e, w in enumerate(load)]  # max-heap on load per copy, ties by index
    heapq.heapify(heaviest)
    for _ in range(num_redundant):
        _, e = heapq.heappop(heaviest)
        copies[e] += 1
        heapq.heappush(heaviest, (-load[e] / copies[e], e))

    slots = (E + num_redundant) // R
    items = sorted(((load[e] / copies[e], e) for e in range(E) for _ in range(copies[e])),
                   key=lambda it: (-it[0], it[1]))
    lightest = [(0.0, r) for r in range(R)]  # min-heap of ranks with a free slot
    placement = [[] for _ in range(R)]
    assignment = [[0.0] * R for _ in range(E)]
    for w, e in items:
        rank_w, r = heapq.heappop(lightest)
        placement[r].append(e)
        assignment[e][r] += w
        if len(placement[r]) < slots:
            heapq.heappush(lightest, (rank_w + w, r))

    dev = expert_load.device
    return EPLBPlan(torch.tensor(assignment, dtype=torch.float64, device=dev),
                    torch.tensor(placement, dtype=torch.int64, device=dev),
                    torch.tensor(copies, dtype=torch.int64, device=dev))
