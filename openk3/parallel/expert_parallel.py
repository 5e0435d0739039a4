"""MoonEP dispatch and combine: expert parallelism with exactly S*K pairs per rank.

Applied from outside the model: ``apply_moonep(model, group)`` replaces every MoE layer's
``experts`` (``RoutedExperts``, all E experts) by ``MoonEPExperts`` holding only this rank's
G = E/R *home* experts, plus G redundant slots that receive replica weights for the step.
The call signature is unchanged (``experts(x [N, D], topk_idx [N, k], topk_weight [N, k])``
-> fp32 [N, D]), so the router, latent projections and shared experts stay as they are.

One forward, on every rank (R ranks, each with S tokens and K experts per token):

1. ``counts`` [E]: this rank's pairs per expert; one ``all_gather`` -> ``counts_all`` [R, E].
2. ``plan(counts_all.sum(0), R)`` (``openk3.parallel.moonep``), identical on every rank.
3. Expert e's pairs are ordered by source rank, then by position; destination rank d takes the
   slice ``[cum_a[e, d], cum_a[e, d+1])`` of that order (``cum_a``: cumulative assignment).
   The [R, R] matrix of pairs sent from each rank to each rank follows from ``counts_all`` and
   the plan alone, so send and receive sizes need no further exchange. Every rank receives
   exactly S*K pairs.
4. Replica weights travel from home ranks to the slots that hold them (``all_to_all_single``),
   tokens travel to their processing rank, the local experts run (home slots + replica slots),
   and results travel back. The autograd versions of the collectives carry gradients back the
   same way: replica weight gradients are summed into the home expert's gradient.

Where sizes are known: ``counts_all`` and the plan are device tensors; the all-to-all split
sizes are read to the host once per layer (``.tolist()`` of two [R] rows), because
``all_to_all_single`` takes Python lists. That is the one host synchronisation, and it is the
plan itself; the per-rank *total* (S*K) is static, so the receive buffer shape never changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from openk3.model.moe import MoE, RoutedExperts, run_experts
from openk3.ops.moe import combine_pairs
from openk3.parallel.moonep import plan as moonep_plan
from openk3.parallel.moonep import plan_home


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Differentiable variable-size all-to-all along dim 0."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    return all_to_all_single(out, x.contiguous(), recv, send, group=group)


def send_matrix(counts_all: torch.Tensor, assignment: torch.Tensor) -> torch.Tensor:
    """[R_src, R_dst] pairs each rank sends to each rank.

    counts_all [R, E]: pairs per (source rank, expert); assignment [E, R]: pairs per
    (expert, destination rank). Source s holds the slice [P[s, e], P[s+1, e]) of expert e's
    order, destination d takes [A[e, d], A[e, d+1]); the overlap of the two is what s sends d.
    """
    zero = counts_all.new_zeros(1, counts_all.shape[1])
    P = torch.cat([zero, counts_all.cumsum(0)])  # [R+1, E]
    A = torch.cat([zero.T, assignment.cumsum(1)], dim=1)  # [E, R+1]
    lo = torch.maximum(P[:-1, None, :], A.T[None, :-1, :])  # [R_src, R_dst, E]
    hi = torch.minimum(P[1:, None, :], A.T[None, 1:, :])
    return (hi - lo).clamp_min(0).sum(-1)


class MoonEPExperts(nn.Module):
    """This rank's share of a ``RoutedExperts``: home experts ``[G, ...]`` + G replica slots.

    ``replicate=False`` is the baseline without MoonEP: no replica slots, every pair goes to its
    expert's home rank and per-rank sizes are ragged (used by ``benchmarks/moonep_ep.py``).
    """

    def __init__(self, full: RoutedExperts, group=None, replicate: bool = True):
        super().__init__()
        self.cfg, self.group, self.replicate = full.cfg, group, replicate
        self.R = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        E = full.cfg.num_experts
        if E % self.R:
            raise ValueError(f"num_experts={E} is not divisible by the expert-parallel size {self.R}")
        self.G = E // self.R
        home = slice(self.rank * self.G, (self.rank + 1) * self.G)
        self.w1 = nn.Parameter(full.w1.detach()[home].clone())  # [G, F, D]
        self.w3 = nn.Parameter(full.w3.detach()[home].clone())
        self.w2 = nn.Parameter(full.w2.detach()[home].clone())  # [G, D, F]
        self.qat = full.qat  # quantisation-aware forward (openk3.model.moe.set_qat)
        self.last_plan = None

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        R, G, me, group = self.R, self.G, self.rank, self.group
        E = R * G
        k = topk_idx.shape[1]
        flat = topk_idx.reshape(-1)
        counts = torch.bincount(flat, minlength=E)
        counts_all = torch.empty(R, E, dtype=counts.dtype, device=counts.device)
        dist.all_gather(list(counts_all.unbind(0)), counts, group=group)
        load = counts_all.sum(0)
        p = moonep_plan(load, R, validate=False) if self.replicate else plan_home(load, R)
        self.last_plan = p

        # destination of each local pair: its index in expert e's global order, then the
        # destination whose slice of that order contains it
        order = flat.argsort(stable=True)  # local pairs sorted by expert
        e_sorted = flat[order]
        first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
        rank_in_e = torch.arange(flat.numel(), device=flat.device) - first[e_sorted]
        before = (counts_all.cumsum(0) - counts_all)[me]  # pairs of e on lower source ranks
        g = before[e_sorted] + rank_in_e
        cum_a = p.assignment.cumsum(1)  # [E, R]
        dest = (g[:, None] >= cum_a[e_sorted]).sum(1)  # [P] destination rank
        by_dest = dest.argsort(stable=True)  # send order: by destination, then expert, position
        send_idx = order[by_dest]
        M = send_matrix(counts_all, p.assignment)
        send_sizes, recv_sizes = M[me].tolist(), M[:, me].tolist()  # the one host read

        x_send = x[send_idx // k]
        x_recv = _a2a(x_send, send_sizes, recv_sizes, group)
        e_recv = _a2a(flat[send_idx], send_sizes, recv_sizes, group)
        y_recv = self._run_local(x_recv, e_recv, p)
        y_send = _a2a(y_recv, recv_sizes, send_sizes, group)  # results back to their sources
        return combine_pairs(y_send, send_idx, topk_weight)

    def _replica_weights(self, p) -> list[torch.Tensor]:
        """Weights of this step's replicas, [G, ...] per matrix (zeros in unused slots)."""
        R, G, me = self.R, self.G, self.rank
        reps = p.replicas  # [R, G]
        used = reps >= 0
        home_of = torch.where(used, reps // G, -1)
        # what this rank (as home) sends: for each receiver r, its slots holding my experts
        mine = used & (home_of == me)
        send_sizes = mine.sum(1).tolist()
        # a receiver's replicas all come from one home rank (a guarantee of the plan)
        recv_sizes = (used[me][None, :] & (home_of[me][None, :] == torch.arange(R, device=reps.device)[:, None])).sum(1).tolist()
        local_ids = reps[mine] - me * G  # receivers in rank order, their used slots in order
        out = []
        for w in (self.w1, self.w3, self.w2):
            got = _a2a(w[local_ids], send_sizes, recv_sizes, self.group)  # [n_used, ...]
            # always through `got`, even when empty: every rank must run the same collectives,
            # in backward too
            out.append(torch.cat([got, w.new_zeros((G - got.shape[0], *w.shape[1:]))]))
        return out

    def _run_local(self, xs: torch.Tensor, experts: torch.Tensor, p) -> torch.Tensor:
        """xs [S*K, D] received pairs with their expert ids -> expert outputs [S*K, D]."""
        G, me = self.G, self.rank
        if self.replicate:
            r1, r3, r2 = self._replica_weights(p)
            w1, w3, w2 = (torch.cat([h, r]) for h, r in ((self.w1, r1), (self.w3, r3), (self.w2, r2)))
            # slot of each pair: home experts first, then this rank's replica slots
            slot_of_expert = torch.full((G * self.R,), -1, dtype=torch.long, device=xs.device)
            slot_of_expert[me * G:(me + 1) * G] = torch.arange(G, device=xs.device)
            reps = p.replicas[me]
            used = reps >= 0
            slot_of_expert[reps[used]] = G + torch.nonzero(used).flatten()
            slot = slot_of_expert[experts]
        else:  # every received pair belongs to a home expert
            w1, w3, w2 = self.w1, self.w3, self.w2
            slot = experts - me * G
        order = slot.argsort(stable=True)
        ys = run_experts(self.cfg, w1, w3, w2, xs[order], torch.bincount(slot, minlength=w1.shape[0]),
                         self.qat)
        return ys[order.argsort()]


def apply_moonep(model: nn.Module, group=None, replicate: bool = True) -> None:
    """Swap every MoE layer's routed experts for this rank's MoonEP share (in place)."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.experts = MoonEPExperts(m.experts, group, replicate)
