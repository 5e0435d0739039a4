"""The one place where parallelism is applied to a training model (as in torchtitan).

``parallelize(model, env, ep=...)`` takes the single-device model and returns a ``Parallel``:
everything the trainer needs that depends on how the model is laid out over processes. The
trainer calls the same methods whatever the layout; with one process each is the plain
single-device operation.

Layout over W = ``env.world_size`` processes, each reading its own data:

- W > 1: FSDP2 shards the parameters over all W ranks (``fsdp.py``); its gradients are averaged
  in backward.
- ``ep`` > 1 (dividing W): MoonEP splits every MoE layer's routed experts over groups of ``ep``
  consecutive ranks (``expert_parallel.py``); FSDP leaves these shares alone and
  ``ExpertShares`` (``expert_shares.py``) reduces, clips and gathers them.

Before FSDP wraps the layers, each decoder layer may be activation-checkpointed and its
attention and MLPs compiled (``compile.py``), as torchtitan orders them.

- ``cp`` > 1 (dividing W): context parallelism (``context_parallel.py``) splits every sequence
  over groups of ``cp`` consecutive ranks, which read the same batch (``dp_rank``) and each
  keep their shard of it (``shard_sequence``); W / cp groups are data parallel. FSDP's mean of
  the per-rank gradients stays the gradient of the global mean loss (equal shards).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

from openk3.model import build_model
from openk3.parallel.compile import checkpoint_layers, compile_layers
from openk3.parallel.context_parallel import ContextParallel, apply_context_parallel
from openk3.parallel.expert_shares import ExpertShares
from openk3.parallel.fsdp import apply_fsdp


def parallelize(model: nn.Module, env, ep: int = 1, compile: bool | None = None,
                activation_checkpointing: bool = False, cp: int = 1,
                ep_replicate: bool = True) -> Parallel:
    """Apply the parallel layout to ``model`` in place and return its ``Parallel``.

    env: the trainer's ``Env`` (``rank``, ``world_size``, ``device``, ``dtype``); the process
    group is already initialised when ``world_size > 1``. ep: expert-parallel size
    (``RunConfig.ep``); 1 keeps every expert on every rank. compile, activation_checkpointing:
    as ``RunConfig``'s fields (``compile.py``); MoonEP's experts stay eager (their dispatch
    reads split sizes on the host). cp: context-parallel size (``RunConfig.cp``). Collective
    when ``world_size > 1``. ep_replicate: ``RunConfig.ep_replicate`` (False: plain expert
    parallelism, no replicas; the baseline MoonEP is measured against).
    """
    if env.world_size % ep:
        raise ValueError(f"RunConfig.ep={ep}: must divide the number of processes "
                         f"({env.world_size}); each group of ep ranks holds the experts once")
    if model.cfg.num_experts % ep:
        raise ValueError(f"RunConfig.ep={ep}: must divide num_experts={model.cfg.num_experts}")
    if env.world_size % cp:
        raise ValueError(f"RunConfig.cp={cp}: must divide the number of processes "
                         f"({env.world_size}); each group of cp ranks shares its sequences")
    context = None
    if cp > 1:
        context = ContextParallel(dist.new_subgroups(group_size=cp)[0])
        apply_context_parallel(model, context)
    experts = ExpertShares(model, ep, ep_replicate) if ep > 1 else None
    if activation_checkpointing:
        checkpoint_layers(model)
    if compile is None:  # on CPU the references' host reads leave little to compile
        compile = env.device.type == "cuda"
    if compile:
        compile_layers(model)
    if env.world_size > 1:
        apply_fsdp(model, env, ignored_params=set(experts.params.values()) if experts else None)
    return Parallel(model, env.rank, env.world_size, experts, context)


class Parallel:
    """A model after ``parallelize``, and the operations that depend on its layout.

    Methods that move data between ranks are collectives: every rank calls them in the same
    order. State dicts are sharded as the layout is, in the form ``torch.distributed.checkpoint``
    reshards, so a checkpoint loads on another number of processes or ``ep``.
    """

    def __init__(self, model: nn.Module, rank: int, world_size: int,
                 experts: ExpertShares | None = None, context: ContextParallel | None = None):
        self.model, self.rank, self.world_size, self.experts = model, rank, world_size, experts
        self.context = context
        cp = 1 if context is None else context.size
        # the data-parallel index and count: the ranks of a CP group read the same batch
        self.dp_rank, self.dp_size = rank // cp, world_size // cp

    def shard_sequence(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of each [B, T, ...] batch tensor: the tensors as they are without
        context parallelism, else this rank's contiguous slice of the sequence
        (``ContextParallel.split``, which the CP layers then read)."""
        return tensors if self.context is None else self.context.split(*tensors)

    def reduce_gradients(self) -> None:
        """Finish the gradient reduction after the last backward of a step. FSDP's gradients
        are reduced during backward; MoonEP's rank-local expert gradients are reduced here."""
        if self.experts is not None:
            self.experts.reduce_gradients()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale all gradients so that their global L2 norm is at most ``max_norm``; returns the
        norm before clipping as a plain 0-dim tensor (the same value on every rank)."""
        return self.clip_grads_(max_norm)[0]

    def clip_grads_(self, max_norm: float, unscaled: Collection[nn.Parameter] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``clip_grad_norm_``, returning ``(norm, coefficient)``. Where the gradients are plain
        tensors (one process), those of ``unscaled`` parameters are left as they are and the
        caller applies the coefficient (a 0-dim tensor: torch's ``min(1, max_norm / (norm +
        1e-6))``), e.g. in Muon's momentum kernel, saving a pass over them; elsewhere (FSDP,
        MoonEP) every gradient is scaled here and the coefficient is None."""
        if self.experts is not None:
            return self.experts.clip_grad_norm_(self.model, max_norm), None
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not unscaled or any(isinstance(p.grad, DTensor) for p in params):
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            return (norm.full_tensor() if isinstance(norm, DTensor) else norm), None
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch's clipping computes it
        skip = {id(p) for p in unscaled}
        torch._foreach_mul_([p.grad for p in params if id(p) not in skip], coef)
        return norm, coef

    def state_dict(self, optimizers) -> dict:
        """The training state as ``torch.distributed.checkpoint`` saves and loads it:
        ``{"model": ..., "optim": ...}`` keyed by parameter name, each rank holding only its own
        shards (FSDP's DTensors; MoonEP's experts as DTensors of the full ``[E, ...]`` tensors,
        ``ExpertShares.to_dtensors``), which share storage with the model and optimisers.
        ``dcp.save`` of it writes each shard once from the rank that holds it; ``dcp.load``
        into it (taken from a fresh model: it names the shards this layout wants) reads them
        from a checkpoint of any layout, then ``load_state_dict``. A fresh optimiser's state is
        first made by a step of zero gradients at learning rate 0 (``get_state_dict``).
        Collective."""
        model_sd, optim_sd = get_state_dict(self.model, optimizers)
        if self.experts is not None:
            self.experts.to_dtensors(model_sd, optim_sd)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict, optimizers) -> None:
        """Load ``state`` (as ``state_dict`` returns it, filled by ``dcp.load``) into the model
        and ``optimizers``. Collective."""
        model_sd, optim_sd = state["model"], state["optim"]
        if self.experts is not None:
            self.experts.to_local(model_sd, optim_sd)
        set_state_dict(self.model, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def gathered_model(self) -> nn.Module | None:
        """The model as one single-device module, for ``save_pretrained`` and sampling: the
        model itself with one process, else a CPU copy of the gathered weights on rank 0 and
        None on the other ranks. Collective."""
        if self.world_size == 1:
            return self.model
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
        if self.experts is not None:
            full.update(self.experts.full_weights())
        if self.rank != 0:
            return None
        plain = build_model(self.model.cfg, device="meta")
        plain.load_state_dict(full, assign=True)
        return plain
