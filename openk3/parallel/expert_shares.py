"""MoonEP in training: each rank's expert shares, and what FSDP would otherwise do for them.

``apply_moonep`` (``expert_parallel.py``) leaves each rank of an expert-parallel group of R ranks
with G = E/R of every layer's experts (``MoonEPExperts.w1/w2/w3``, [G, ...]). FSDP is told to
ignore these parameters, so ``ExpertShares`` does for them what FSDP does for its own: reduce
their gradients over the data-parallel replicas, add them to the global gradient norm, present
them to checkpoints as shards of the full ``[E, ...]`` tensors, and gather them for export.
Used through ``openk3.parallel.parallelize``; all methods are collectives (every rank calls them,
in the same order).

Layout for EP size ``ep`` over W ranks (``ep`` divides W), the device mesh ``[replica, ep]`` of
shape ``(W/ep, ep)``: EP groups (mesh rows) are consecutive ranks ``[g*ep, (g+1)*ep)``, each
holding every expert once; replica groups (mesh columns) join the ranks that hold the same
experts (``r, r + ep, r + 2ep, ...``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from openk3.parallel.expert_parallel import MoonEPExperts, apply_moonep


def expert_mesh(ep: int, device_type: str) -> DeviceMesh:
    """The ``[replica, ep]`` mesh of this layout (see the module docstring). Collective."""
    world = dist.get_world_size()
    if ep < 1 or world % ep:
        raise ValueError(f"expert-parallel size {ep} must divide the number of processes {world}")
    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("replica", "ep"))


class ExpertShares:
    """Splits ``model``'s experts over groups of ``ep`` ranks (MoonEP, in place) and keeps the
    rank-local expert parameters (``params``: state-dict name -> [G, ...] parameter) and the
    ``[replica, ep]`` device ``mesh`` they are laid out on."""

    def __init__(self, model: nn.Module, ep: int, replicate: bool = True):
        self.mesh = expert_mesh(ep, next(model.parameters()).device.type)
        self.ep_group = self.mesh.get_group("ep")
        # without replicas there is nothing to reduce over
        self.replica_group = self.mesh.get_group("replica") if self.mesh.size(0) > 1 else None
        apply_moonep(model, self.ep_group, replicate)
        self.params: dict[str, nn.Parameter] = {
            f"{name}.{w}": getattr(m, w) for name, m in model.named_modules()
            if isinstance(m, MoonEPExperts) for w in ("w1", "w2", "w3")}

    def _dtensor(self, local: torch.Tensor) -> DTensor:
        """This rank's [G, ...] rows as its shard of the full [E, ...] tensor (no copy)."""
        return DTensor.from_local(local.detach(), self.mesh, [Replicate(), Shard(0)], run_check=False)

    def reduce_gradients(self) -> None:
        """Average the expert gradients over every rank's tokens, as FSDP does for the others.

        A local expert's gradient already sums the losses of its EP group (the tokens came to it
        by all-to-all); the replica groups add the other groups' (same experts, other data), and
        the division by the world size turns the sum of per-rank means into one mean."""
        world = dist.get_world_size()
        for p in self.params.values():
            # a rank whose experts got no tokens has no gradient: zeros, as one process's stack
            # has for them, so every replica joins the reduction, every rank the clipping's
            # all-reduce, and the optimiser steps the same parameters everywhere
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.replica_group is not None:
                dist.all_reduce(p.grad, group=self.replica_group)
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

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every expert weight as a full ``[E, ...]`` CPU tensor, keyed by state-dict name (on
        every rank: each all-gathers within its EP group)."""
        return {fqn: self._dtensor(p).full_tensor().cpu() for fqn, p in self.params.items()}

    def to_dtensors(self, model_sd: dict, optim_sd: dict) -> None:
        """Present the expert shares in sharded (DCP) state dicts as what they are, shards of
        full ``[E, ...]`` tensors: DTensors on the ``[replica, ep]`` mesh, ``[Replicate(),
        Shard(0)]``; the weights and the optimiser moments of their shape (Muon's momentum,
        AdamW's averages; not AdamW's step count). The entries of ``model_sd`` and
        ``optim_sd["state"]`` are replaced, never the optimiser's own per-parameter dicts. The
        DTensors share storage with the parameters and optimiser state, so ``dcp.save`` writes
        each expert once and ``dcp.load`` fills them, re-slicing a checkpoint saved with another
        ``ep`` or number of processes."""
        for fqn, p in self.params.items():
            model_sd[fqn] = self._dtensor(model_sd[fqn])
            if fqn in optim_sd["state"]:
                optim_sd["state"][fqn] = {k: self._dtensor(v) if torch.is_tensor(v) and v.shape == p.shape
                                          else v for k, v in optim_sd["state"][fqn].items()}

    def to_local(self, model_sd: dict, optim_sd: dict) -> None:
        """The inverse of ``to_dtensors``: each DTensor back to this rank's ``[G, ...]`` rows."""
        for fqn in self.params:
            model_sd[fqn] = model_sd[fqn].to_local()
            if fqn in optim_sd["state"]:
                optim_sd["state"][fqn] = {k: v.to_local() if isinstance(v, DTensor) else v
                                          for k, v in optim_sd["state"][fqn].items()}
