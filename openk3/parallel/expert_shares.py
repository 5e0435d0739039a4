"""MoonEP in training: each rank's expert shares, and what FSDP would otherwise do for them.

``apply_moonep`` (``expert_parallel.py``) leaves each rank of an expert-parallel group of R ranks
with G = E/R of every layer's experts (``MoonEPExperts.w1/w2/w3``, [G, ...]). FSDP is told to
ignore these parameters, so ``ExpertShares`` does for them what FSDP does for its own: reduce
their gradients over the data-parallel replicas, add them to the global gradient norm, assemble
full ``[E, ...]`` state for checkpoints and export, and take each rank's rows back on load.
Used through ``openk3.parallel.parallelize``; all methods are collectives (every rank calls them,
in the same order).

Group layout for EP size ``ep`` over W ranks (``ep`` divides W): EP groups are consecutive
ranks ``[g*ep, (g+1)*ep)``, each holding every expert once; replica groups join the ranks that
hold the same experts (``r, r + ep, r + 2ep, ...``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from openk3.parallel.expert_parallel import MoonEPExperts, apply_moonep


def expert_parallel_groups(ep: int):
    """(ep_group, replica_group) of this rank; both None when ``ep`` is the world size (the
    default group is the one EP group and there are no replicas). Collective: every rank creates
    every group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep < 1 or world % ep:
        raise ValueError(f"expert-parallel size {ep} must divide the number of processes {world}")
    if ep == world:
        return None, None
    ep_group = replica_group = None
    for g in range(world // ep):  # every rank creates every group, in the same order
        grp = dist.new_group(list(range(g * ep, (g + 1) * ep)))
        if rank // ep == g:
            ep_group = grp
    for r in range(ep):
        grp = dist.new_group(list(range(r, world, ep)))
        if rank % ep == r:
            replica_group = grp
    return ep_group, replica_group


class ExpertShares:
    """Splits ``model``'s experts over groups of ``ep`` ranks (MoonEP, in place) and keeps the
    rank-local expert parameters (``params``: state-dict name -> [G, ...] parameter)."""

    def __init__(self, model: nn.Module, ep: int):
        self.ep_group, self.replica_group = expert_parallel_groups(ep)
        apply_moonep(model, self.ep_group)
        self.params: dict[str, nn.Parameter] = {
            f"{name}.{w}": getattr(m, w) for name, m in model.named_modules()
            if isinstance(m, MoonEPExperts) for w in ("w1", "w2", "w3")}

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """[G, ...] on each rank of the EP group -> [E, ...] (rank r's experts at rows r*G...)."""
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.ep_group))]
        dist.all_gather(parts, local.contiguous(), group=self.ep_group)
        return torch.cat(parts)

    def _home_share(self, full: torch.Tensor) -> torch.Tensor:
        """[E, ...] -> this rank's [G, ...] rows."""
        return full.chunk(dist.get_world_size(self.ep_group))[dist.get_rank(self.ep_group)]

    def reduce_gradients(self) -> None:
        """Average the expert gradients over every rank's tokens, as FSDP does for the others.

        A local expert's gradient already sums the losses of its EP group (the tokens came to it
        by all-to-all); the replica groups add the other groups' (same experts, other data), and
        the division by the world size turns the sum of per-rank means into one mean."""
        world = dist.get_world_size()
        for p in self.params.values():
            if self.replica_group is not None:
                if p.grad is None:  # every replica must join the reduction
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.replica_group)
            if p.grad is not None:
                p.grad.div_(world)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Global-norm clipping when FSDP's sharded (DTensor) gradients sit beside the rank-local
        expert gradients: squared norms of both kinds are summed (the expert ones over the EP
        group, whose ranks together hold each expert once), then every gradient is scaled by the
        same factor. Returns the total norm (a plain tensor)."""
        local_ids = {id(p) for p in self.params.values()}
        sharded = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in local_ids]
        local = [p.grad for p in self.params.values() if p.grad is not None]
        sq = torch.zeros((), device=next(model.parameters()).device)
        if sharded:
            norm = torch.nn.utils.get_total_norm(sharded)
            sq = sq + (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float() ** 2
        if local:
            local_sq = torch.stack([g.float().pow(2).sum() for g in local]).sum()
            dist.all_reduce(local_sq, group=self.ep_group)  # each rank holds different experts
            sq = sq + local_sq
        total = sq.sqrt()
        coef = min(1.0, max_norm / (total.item() + 1e-6))
        if coef < 1.0:
            for g in sharded + local:
                g.mul_(coef)
        return total

    def gather_state(self, model_sd: dict, optim_sd: dict | None = None, optimizers=()) -> None:
        """Replace the expert shares in rank 0's full state dicts by ``[E, ...]`` CPU tensors, in
        place: the weights in ``model_sd`` and, given ``optim_sd``, the optimiser moments of the
        same shape (Muon's momentum, AdamW's) under the same names."""
        main = dist.get_rank() == 0
        for fqn, p in self.params.items():  # same order on every rank: these are collectives
            full = self._gather(p.detach())
            moments = {}
            if optim_sd is not None:
                state = next((opt.state[p] for opt in optimizers if p in opt.state), {})
                moments = {k: self._gather(v) for k, v in sorted(state.items())
                           if torch.is_tensor(v) and v.shape == p.shape}
            if main:
                model_sd[fqn] = full.cpu()
                if optim_sd is not None:
                    optim_sd["state"].setdefault(fqn, {}).update({k: v.cpu() for k, v in moments.items()})

    def slice_state(self, model_sd: dict, optim_sd: dict) -> None:
        """The inverse of ``gather_state`` on every rank: full ``[E, ...]`` entries -> this rank's rows."""
        for fqn in self.params:
            E = model_sd[fqn].shape[0]
            model_sd[fqn] = self._home_share(model_sd[fqn])
            for k, v in optim_sd["state"].get(fqn, {}).items():
                if torch.is_tensor(v) and v.dim() and v.shape[0] == E:
                    optim_sd["state"][fqn][k] = self._home_share(v)
