"""MoonEP planner (K3_SPEC §3): exact expert-parallel load balance with E/R replicas per rank.

E experts live on R ranks, ``G = E // R`` per rank: expert e's *home* is rank ``e // G``. Each
rank also has G *redundant slots* that may hold a copy (replica) of another rank's expert for one
step. Given the routed load of every expert (token-expert pairs, [E]), ``plan`` decides how many
pairs of each expert each rank processes so that every rank processes exactly ``total / R``
pairs. Static per-rank sizes let dispatch use preallocated buffers and ``all_to_all_single``.

- ``plan``: the constructive planner, vectorised over experts and ranks; a fixed loop of R - 1
  moves, no host read (runs on the device of ``expert_load``).
- ``plan_home``: the baseline without replication: every pair is processed on its expert's home
  rank, so rank loads are ragged (what expert parallelism does without MoonEP).
- ``plan_naive``: the same algorithm in plain Python integers with an early stop; the reference
  the tests compare ``plan`` against.

The proof that the guarantees hold for any load is in ``docs/moonep.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoonEPPlan:
    """A balanced expert-parallel plan for one MoE layer and one step.

    Fields (E experts, R ranks, G = E // R slots of each kind per rank; all int64, on the device
    of the load):
        assignment:   [E, R] pairs of expert e that rank r processes. Rows sum to the loads,
                      every column sums to total / R.
        replicas:     [R, G] expert held in each redundant slot of each rank, -1 if unused. Used
                      slots come first. A rank's replicas all share one home rank.
        replica_load: [R, G] pairs processed in each redundant slot (0 where unused).
        moves:        [R - 1, 3] the planner's moves as (donor h, receiver u, pairs). Rows with
                      0 pairs are no-ops (the loads were balanced before the loop ended).
    """

    assignment: torch.Tensor
    replicas: torch.Tensor
    replica_load: torch.Tensor
    moves: torch.Tensor

    def rank_load(self) -> torch.Tensor:
        """[R] pairs processed by each rank (home plus replica slots); all equal to total / R."""
        return self.assignment.sum(0)

    def num_replicas(self) -> int:
        """Replicas in use over all ranks (reads one value to the host)."""
        return int((self.replicas >= 0).sum())

    def num_moves(self) -> int:
        """Moves that moved pairs; at most R - 1 (reads one value to the host)."""
        return int((self.moves[:, 2] > 0).sum())


def _check(expert_load: torch.Tensor, num_ranks: int, read_values: bool) -> None:
    if expert_load.dim() != 1:
        raise ValueError(f"expert_load must be 1-D [E], got shape {tuple(expert_load.shape)}")
    if expert_load.dtype.is_floating_point or expert_load.dtype.is_complex \
            or expert_load.dtype == torch.bool:
        raise ValueError(f"expert_load must be an integer tensor, got {expert_load.dtype}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    E = expert_load.shape[0]
    if E == 0 or E % num_ranks != 0:
        raise ValueError(f"the number of experts E={E} must be a positive multiple of "
                         f"num_ranks R={num_ranks}")
    if read_values:
        if bool((expert_load < 0).any()):
            raise ValueError("expert_load must be non-negative")
        total = int(expert_load.sum())
        if total % num_ranks != 0:
            raise ValueError(f"the total load {total} must be divisible by num_ranks "
                             f"R={num_ranks}")


def _assemble(home_left_RG, replicas_RG, replica_load_RG, moves) -> MoonEPPlan:
    """Build the dense [E, R] assignment from home-held and replica-held pairs (no host read)."""
    R, G = home_left_RG.shape
    E, dev = R * G, home_left_RG.device
    home_E = torch.arange(E, device=dev) // G
    assignment = torch.zeros(E, R, dtype=torch.int64, device=dev)
    assignment.scatter_(1, home_E[:, None], home_left_RG.reshape(E, 1))
    # Unused slots add 0 pairs to expert 0, so no boolean mask (and no host sync) is needed.
    rank_RG = torch.arange(R, device=dev)[:, None].expand(R, G)
    assignment.index_put_((replicas_RG.clamp_min(0).reshape(-1), rank_RG.reshape(-1)),
                          replica_load_RG.reshape(-1), accumulate=True)
    return MoonEPPlan(assignment, replicas_RG, replica_load_RG, moves)


def plan(expert_load: torch.Tensor, num_ranks: int, *, validate: bool = True) -> MoonEPPlan:
    """Plan exact expert-parallel balance: every rank processes ``total / R`` pairs.

    Args:
        expert_load: [E] integer tensor, token-expert pairs routed to each expert this step
            (E divisible by R, total divisible by R, non-negative). Any device.
        num_ranks: R. Expert e's home rank is ``e // (E // R)``.
        validate: check the values (non-negative, total divisible by R). This is the only place
            the planner reads tensor values to the host; pass False on the training hot path,
            where routing guarantees both (total = R * S * K). Shape and dtype are always checked.

    Returns:
        ``MoonEPPlan`` on the device of ``expert_load``.

    Algorithm (K3_SPEC §3): excess ``b_r = home load of r - total / R``. R - 1 times: h = argmax b,
    u = argmin b; h gives ``-b_u`` of its home-held pairs to u, largest remaining experts first
    (fewest replicas), each touched expert taking one of u's redundant slots; ``b_h += b_u``,
    ``b_u = 0``. Once all b are 0 the remaining iterations move 0 pairs. Each iteration is
    O(R + G log G) work in a fixed number of tensor ops, so the whole plan is
    O(R^2 + E log G) plus O(E R) to write the dense assignment, with no data-dependent control flow
    (CUDA-graph capturable).

    Example:
        >>> p = plan(torch.tensor([6, 0, 1, 1]), num_ranks=2)
        >>> p.assignment.tolist(), p.replicas.tolist()
        ([[4, 2], [0, 0], [0, 1], [0, 1]], [[-1, -1], [0, -1]])
    """
    _check(expert_load, num_ranks, validate)
    R = num_ranks
    E = expert_load.shape[0]
    G = E // R
    dev = expert_load.device
    load_E = expert_load.to(torch.int64)

    home_left_RG = load_E.reshape(R, G).clone()  # pairs each home expert still processes at home
    excess_R = home_left_RG.sum(1) - load_E.sum() // R  # b_r
    replicas_RG = torch.full((R, G), -1, dtype=torch.int64, device=dev)
    replica_load_RG = torch.zeros(R, G, dtype=torch.int64, device=dev)
    moves = torch.zeros(max(R - 1, 0), 3, dtype=torch.int64, device=dev)
    expert_RG = torch.arange(E, device=dev).view(R, G)

    for i in range(R - 1):
        h = excess_R.argmax().view(1)  # [1] tensors, never Python ints: no host sync
        u = excess_R.argmin().view(1)
        need = -excess_R.index_select(0, u)  # [1], >= 0; 0 once balanced
        # Take `need` pairs from h's home experts, largest remaining first. Stable sort keeps
        # ties in expert order so that plan_naive reproduces the same choice.
        left_G, order_G = home_left_RG.index_select(0, h)[0].sort(descending=True, stable=True)
        before_G = left_G.cumsum(0) - left_G
        take_G = torch.minimum(left_G, (need - before_G).clamp_min(0))  # nonzero on a prefix
        row_G = torch.empty_like(left_G).scatter_(0, order_G, left_G - take_G)
        home_left_RG.index_copy_(0, h, row_G[None])
        # u is fresh when need > 0 (see docs/moonep.md), so its slots are all free; when
        # need == 0, u may be an earlier receiver and its row must be kept.
        received = need > 0
        donor_experts_G = expert_RG.index_select(0, h)[0].index_select(0, order_G)
        new_rep_G = torch.where(take_G > 0, donor_experts_G, -1)
        replicas_RG.index_copy_(
            0, u, torch.where(received, new_rep_G, replicas_RG.index_select(0, u)[0])[None])
        replica_load_RG.index_add_(0, u, take_G[None])
        excess_R.index_add_(0, h, -need)
        excess_R.index_fill_(0, u, 0)
        moves[i] = torch.cat([h, u, need])
    return _assemble(home_left_RG, replicas_RG, replica_load_RG, moves)


def plan_home(expert_load: torch.Tensor, num_ranks: int) -> MoonEPPlan:
    """Baseline: no replicas, each expert's pairs stay on its home rank (ragged rank loads).

    Same result type as ``plan`` (no host read); only the rows-sum-to-loads guarantee holds.
    """
    _check(expert_load, num_ranks, False)
    R, G = num_ranks, expert_load.shape[0] // num_ranks
    dev = expert_load.device
    empty = torch.full((R, G), -1, dtype=torch.int64, device=dev)
    return _assemble(expert_load.to(torch.int64).view(R, G), empty, torch.zeros_like(empty),
                     torch.zeros(max(R - 1, 0), 3, dtype=torch.int64, device=dev))


def plan_naive(expert_load: torch.Tensor, num_ranks: int) -> MoonEPPlan:
    """Reference planner: the same moves in Python integers, stopping once balanced.

    Same arguments and result as ``plan`` (always validates). It reads the loads to the host, so
    it suits tests and CPU planning, not a GPU step.
    """
    _check(expert_load, num_ranks, True)
    R, E = num_ranks, expert_load.shape[0]
    G = E // R
    load = [int(x) for x in expert_load.tolist()]
    capacity = sum(load) // R
    home_left = [load[r * G:(r + 1) * G] for r in range(R)]
    excess = [sum(row) - capacity for row in home_left]
    replicas = [[-1] * G for _ in range(R)]
    replica_load = [[0] * G for _ in range(R)]
    moves = [[0, 0, 0] for _ in range(max(R - 1, 0))]
    for i in range(R - 1):
        h = max(range(R), key=lambda r: (excess[r], -r))  # first index among ties, like argmax
        u = min(range(R), key=lambda r: (excess[r], r))
        need = -excess[u]
        if need == 0:
            break
        assert excess[h] > 0 and sum(home_left[h]) >= need and replicas[u][0] == -1
        remaining, slot = need, 0
        for j in sorted(range(G), key=lambda j: -home_left[h][j]):
            take = min(home_left[h][j], remaining)
            if take == 0:
                break
            home_left[h][j] -= take
            replicas[u][slot], replica_load[u][slot] = h * G + j, take
            remaining, slot = remaining - take, slot + 1
        excess[h] += excess[u]
        excess[u] = 0
        moves[i] = [h, u, need]

    def as_tensor(x, shape):
        return torch.tensor(x, dtype=torch.int64, device=expert_load.device).view(shape)

    return _assemble(as_tensor(home_left, (R, G)), as_tensor(replicas, (R, G)),
                     as_tensor(replica_load, (R, G)), as_tensor(moves, (max(R - 1, 0), 3)))
