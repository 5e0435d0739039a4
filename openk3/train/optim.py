"""Per-head Muon, the AdamW split, and learning-rate schedules (K3_SPEC §3).

Muon (MomentUm Orthogonalized by Newton-Schulz) replaces each matrix's momentum ``M`` by the
nearest semi-orthogonal matrix ``U V^T`` (``M = U S V^T``), computed approximately by a few
Newton-Schulz iterations, and scales it so that its RMS is 0.2 — about the RMS of an AdamW
update, so both optimisers share one learning rate ("RMS-matched scaling").

K3 orthogonalises each attention head's slice on its own (**per-head Muon**): the rows of a
head in the q/k/v/g projections and its columns in ``o_proj``. Heads then get updates of equal
strength instead of the large heads' directions dominating the whole matrix's spectrum.
MLA's ``kv_b_proj`` holds, per head, the key rows then the value rows; those are two matrices.
Routed experts (stacked ``[E, F, D]``) are orthogonalised expert by expert.

Everything else — embeddings, ``lm_head``, the router, AttnRes pseudo-queries, convolution
filters (KDA's, the vision patch embedding), the vision position table, norms and other 1-D
parameters — goes to AdamW.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from openk3.model.kda import KDAttention
from openk3.model.mla import MLAttention
from openk3.model.model import AttnResQuery
from openk3.model.moe import Router
from openk3.ops import muon as muon_ops
from openk3.vision.tower import PositionEmbedding, VisionBlock

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz, a / b / c
UPDATE_RMS = 0.2  # Muon's update RMS, matched to a typical AdamW update
ADAMW_BETAS = (0.9, 0.95)  # the usual LLM-pretraining betas, not torch's (0.9, 0.999)
WSD_DECAY_FRACTION = 0.2  # share of a `wsd` run spent decaying the learning rate


def zeropower_via_newtonschulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximate ``U V^T`` of ``G = U S V^T``. G: [..., m, n], batched over leading dims.

    Quintic iteration ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``. Its coefficients are
    tuned for speed, not exactness: the singular values land in a band around 1 (about
    [0.7, 1.2]) instead of converging to 1, which Muon does not need.

    Runs in bf16 on CUDA and fp32 elsewhere. The iteration is self-correcting (each step pulls
    every singular value back towards the band), so bf16 rounding does not accumulate and the
    matmuls run at full tensor-core rate; CPUs have no fast bf16 matmul, so fp32 costs nothing
    extra there. Returns G's dtype.

    ``a X + B X`` is computed as ``(a I + B) X``: ``baddbmm(X, B, X, beta=a)`` first copies X
    into its output (cuBLAS accumulates into it), a pass over every momentum per iteration
    (5.3 of ~21 ms of ``small``'s Muon step on an H200). In bf16 the diagonal ``a + B_ii`` is
    rounded once more: ~2% relative distance from the exact (fp64) iteration instead of ~1%,
    next to the ~25% by which the iteration itself misses ``U V^T`` (docs/benchmarks.md).

    X starts as ``G / ||G||_F``, applied through the first Gram matrix (``||X||_F^2 = tr(X X^T)``):
    the norm and the division were a reduction and a broadcast pass over every momentum (2.7 ms of
    `small`'s step on an H200, sixteenth session); the m x m matrices are what the first
    iteration scales instead, each by its own factor in one vectorised pass
    (``openk3.ops.muon.scale_matrices_``: torch's broadcast multiply took 3.0 ms for them).
    """
    if G.dim() < 2 or steps < 1:
        raise ValueError(f"zeropower_via_newtonschulz: needs a matrix [..., m, n] and steps >= 1, got "
                         f"{tuple(G.shape)} and steps={steps}")
    a, b, c = NS_COEFFS
    X = G.bfloat16() if G.is_cuda else G.float()
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:  # iterate on the wide form: A = X X^T is then the smaller Gram matrix
        X = X.mT
    lead = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])  # [N, m, n]: every product below is one batched GEMM
    for step in range(steps):
        A = X @ X.mT  # [N, m, m]
        if step == 0:
            # X / ||X||_F (Frobenius >= spectral norm: every singular value starts in (0, 1])
            # without a pass over X: ||X||_F^2 = trace(X X^T), so the first A is scaled by
            # 1 / ||X||^2 and the first product by 1 / ||X||, both on the m x m matrices
            scale = 1 / (A.diagonal(dim1=-2, dim2=-1).float().sum(-1).sqrt() + eps)  # [N]
            muon_ops.scale_matrices_(A, scale.square())
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2, scaled in the GEMM's epilogue
        B.diagonal(dim1=-2, dim2=-1).add_(a)  # + a I: then a X + B X is one product, B X
        if step == 0:
            muon_ops.scale_matrices_(B, scale)
        X = B @ X
    X = X.reshape(*lead, *X.shape[-2:])
    if transposed:
        X = X.mT
    return X.to(G.dtype)


@dataclass(frozen=True)
class HeadSplit:
    """How a weight matrix splits into per-head blocks.

    ``dim``: 0 when a head owns rows (q/k/v/g projections), 1 when it owns columns (o_proj).
    ``sizes``: the lengths, along ``dim``, of the blocks one head owns, in order; the pattern
    repeats once per head. ``(K,)`` for a KDA projection; ``(qk_nope_head_dim, v_head_dim)``
    for MLA's ``kv_b_proj``, whose key and value rows are orthogonalised separately.
    """

    dim: int
    sizes: tuple[int, ...]

    def __post_init__(self):
        if self.dim not in (0, 1):
            raise ValueError(f"HeadSplit.dim must be 0 (rows) or 1 (columns), got {self.dim}")
        if not self.sizes or any(s <= 0 for s in self.sizes):
            raise ValueError(f"HeadSplit.sizes must be positive block lengths, got {self.sizes}")

    @property
    def period(self) -> int:
        return sum(self.sizes)


def head_slices(model: nn.Module) -> dict[nn.Parameter, HeadSplit]:
    """Per-head split of every attention matrix of ``model`` (KDA, MLA, the vision tower's),
    read from the attention modules' head counts and dimensions. Matrices shared by all heads (``q_a_proj``,
    ``kv_a_proj_with_mqa``, the KDA decay projections ``f_a/f_b/b_proj``) are not listed and
    are orthogonalised whole."""
    splits: dict[nn.Parameter, HeadSplit] = {}
    for m in model.modules():
        if isinstance(m, KDAttention):
            rows = HeadSplit(0, (m.head_dim,))
            gate = m.g_proj if hasattr(m, "g_proj") else m.g_b_proj  # K3 / Kimi Linear
            for proj in (m.q_proj, m.k_proj, m.v_proj, gate):
                splits[proj.weight] = rows
            splits[m.o_proj.weight] = HeadSplit(1, (m.head_dim,))
        elif isinstance(m, MLAttention):
            q = m.q_proj if hasattr(m, "q_proj") else m.q_b_proj
            splits[q.weight] = HeadSplit(0, (m.nope + m.rope,))
            splits[m.kv_b_proj.weight] = HeadSplit(0, (m.nope, m.v_dim))
            if hasattr(m, "g_proj"):
                splits[m.g_proj.weight] = HeadSplit(0, (m.v_dim,))
            splits[m.o_proj.weight] = HeadSplit(1, (m.v_dim,))
        elif isinstance(m, VisionBlock):  # wqkv's rows are [q | k | v], each head by head
            splits[m.wqkv.weight] = HeadSplit(0, (m.head_dim,))
            splits[m.wo.weight] = HeadSplit(1, (m.head_dim,))
    return splits


def _orthogonalise_scaled(X: torch.Tensor, ns_steps: int) -> torch.Tensor:
    """X: [..., r, c] -> NS(X) scaled to RMS 0.2 (a semi-orthogonal r x c matrix has RMS
    1/sqrt(max(r, c)))."""
    return zeropower_via_newtonschulz(X, ns_steps) * (UPDATE_RMS * math.sqrt(max(X.shape[-2:])))


def _blocks(M: torch.Tensor, split: HeadSplit | None) -> list[torch.Tensor]:
    """The matrices Muon orthogonalises in ``M`` [..., rows, cols], as batches ``[N, r, c]``:
    the whole matrix (or each of a leading batch, e.g. experts) without ``split``, else one
    batch per block size of the head pattern (every head's block of that size)."""
    if split is None:
        return [M.reshape(-1, *M.shape[-2:])]
    X = M.mT if split.dim == 1 else M  # a column split is a row split of the transpose
    *lead, R, C = X.shape
    if R % split.period:
        raise ValueError(f"Muon: {'columns' if split.dim else 'rows'} ({R}) of a "
                         f"{tuple(M.shape)} matrix are not a multiple of the head period {split.sizes}")
    heads = X.reshape(*lead, R // split.period, split.period, C)  # [..., H, period, C]
    return [b.reshape(-1, size, C) for b, size in zip(heads.split(split.sizes, dim=-2), split.sizes)]


def _viewed(block: torch.Tensor, M: torch.Tensor) -> bool:
    """Whether ``block`` (from ``_blocks(M, ...)``) is a view of M, not a copy: writes reach M."""
    return block.untyped_storage().data_ptr() == M.untyped_storage().data_ptr()


def _assemble(blocks: list[torch.Tensor], M: torch.Tensor, split: HeadSplit | None) -> torch.Tensor:
    """The inverse of ``_blocks``: a tensor of M's shape from (updated) blocks."""
    if split is None:
        return blocks[0].reshape(M.shape)
    X = M.mT if split.dim == 1 else M
    *lead, R, C = X.shape
    H = R // split.period
    out = torch.cat([b.reshape(*lead, H, b.shape[-2], C) for b in blocks], dim=-2)
    out = out.reshape(*lead, R, C)
    return out.mT if split.dim == 1 else out


def muon_updates(ms: list[torch.Tensor], splits: list[HeadSplit | None],
                 ns_steps: int = 5) -> list[torch.Tensor]:
    """The Muon step directions for momenta ``ms`` (each [..., rows, cols]), before the
    learning rate; each is a tensor of its momentum's shape and dtype.

    Without a split, a whole matrix (each one of a leading batch, e.g. experts) is
    orthogonalised; with one, the blocks of each head are, each scaled with its own block
    shape. Blocks of the same shape (the same projection of every layer, every expert) are
    stacked and orthogonalised in one batched Newton-Schulz, so a step costs a few dozen large
    matmul chains instead of one small chain per matrix (the per-matrix loop was ~0.5 s of
    host time per step for ``small`` on an H200)."""
    pieces = [_blocks(m, split) for m, split in zip(ms, splits)]
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for i, blocks in enumerate(pieces):
        for j, b in enumerate(blocks):
            groups.setdefault((tuple(b.shape[-2:]), b.dtype, b.device), []).append((i, j))
    done: list[list[torch.Tensor | None]] = [[None] * len(blocks) for blocks in pieces]
    for members in groups.values():
        stacked = [pieces[i][j] for i, j in members]
        out = _orthogonalise_scaled(torch.cat(stacked) if len(stacked) > 1 else stacked[0], ns_steps)
        for (i, j), o in zip(members, out.split([b.shape[0] for b in stacked])):
            done[i][j] = o
    return [_assemble(blocks, m, split) for blocks, m, split in zip(done, ms, splits)]


class Muon(torch.optim.Optimizer):
    """Muon with Nesterov momentum, optional per-head orthogonalisation and decoupled weight
    decay. Every parameter must be at least 2-D (leading dims are a batch of matrices).

    ``head_splits`` maps parameters to their ``HeadSplit`` (see ``head_slices``); it is held by
    the optimiser, not its state, so ``state_dict`` stays plain tensors and numbers. Per group:
    ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``ns_steps``. ``bucket_numel`` bounds
    how many elements are orthogonalised in one batch (memory; see ``step``).
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = 5,
                 head_splits: dict[nn.Parameter, HeadSplit] | None = None,
                 bucket_numel: int = 1 << 27):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or ns_steps < 1:
            raise ValueError(f"Muon: invalid lr={lr}, momentum={momentum}, "
                             f"weight_decay={weight_decay} or ns_steps={ns_steps}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() < 2:
                    raise ValueError(f"Muon: parameters must be matrices, got shape {tuple(p.shape)}; "
                                     "give 1-D parameters to AdamW")
        self.head_splits = dict(head_splits or {})
        # elements orthogonalised together: 2^27 fp32 momenta are 512 MB, a few GB at the peak
        # of one bucket's Newton-Schulz (stacked copy, bf16 iterates, scaled and assembled output)
        self.bucket_numel = bucket_numel
        self._grad_scale: torch.Tensor | None = None  # step()'s, for the passes below

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | None = None):
        """``grad_scale``: a 0-dim tensor the gradients are multiplied by on their way into the
        momentum (gradient clipping's coefficient, ``Parallel.clip_grads_``: the clipping then
        skips its own pass over these gradients, which are left unscaled)."""
        self._grad_scale = grad_scale
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            # Same-shape matrices side by side, then buckets of at most `bucket_numel` elements:
            # each bucket is one batched orthogonalisation per block shape, and memory stays
            # bounded (FSDP gathers whole matrices for it; a bucket's are freed before the next).
            # The order is the same on every rank, so the gathers match.
            params.sort(key=lambda p: (tuple(p.shape), self._split_key(p)))
            bucket, numel = [], 0
            for p in params:
                if bucket and numel + p.numel() > self.bucket_numel:
                    self._step_bucket(bucket, group)
                    bucket, numel = [], 0
                bucket.append(p)
                numel += p.numel()
            if bucket:
                self._step_bucket(bucket, group)
        return loss

    def _split_key(self, p: nn.Parameter) -> tuple:
        split = self.head_splits.get(p)
        return (-1, ()) if split is None else (split.dim, split.sizes)

    def _step_bucket(self, params: list[nn.Parameter], group: dict) -> None:
        mu = group["momentum"]
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
        # foreach ops take plain tensors or FSDP's DTensors, not both (MoonEP keeps the routed
        # experts plain): one pass per kind
        kinds: dict[bool, list[nn.Parameter]] = {}
        for p in params:
            kinds.setdefault(isinstance(p, DTensor), []).append(p)
        for sharded, same in kinds.items():
            if sharded:
                self._momentum(same, mu)
                self._update_gathered(same, group)
            else:  # the momentum is updated block by block on the way into Newton-Schulz
                self._update_in_place(same, group)

    def _momentum(self, params: list[nn.Parameter], mu: float) -> None:
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        grads = [p.grad for p in params]
        if self._grad_scale is not None:
            grads = torch._foreach_mul(grads, self._grad_scale)
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)

    def _update_gathered(self, params: list[nn.Parameter], group: dict) -> None:
        """The reference update, and FSDP's, on momenta already updated (``_momentum``): whole
        momenta (an FSDP shard gathered: every rank
        computes the same full update, and head blocks need not align with the shard
        boundaries) through ``muon_updates``, then each rank keeps its shard."""
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        grads = [p.grad for p in params]
        if self._grad_scale is not None and group["nesterov"]:  # as _momentum scaled them
            grads = torch._foreach_mul(grads, self._grad_scale)
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        ms = torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs
        full = [m.full_tensor() if isinstance(m, DTensor) else m for m in ms]
        updates = muon_updates(full, [self.head_splits.get(p) for p in params], group["ns_steps"])
        steps = [distribute_tensor(u.to(p.dtype), m.device_mesh, m.placements, src_data_rank=None)
                 if isinstance(m, DTensor) else u.to(p.dtype) for u, m, p in zip(updates, ms, params)]
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        if isinstance(lr, torch.Tensor):  # a 0-dim device tensor: a CUDA graph reads it there
            torch._foreach_mul_(steps, lr)
            torch._foreach_sub_(params, steps)
        else:
            torch._foreach_add_(params, steps, alpha=-lr)

    def _update_in_place(self, params: list[nn.Parameter], group: dict) -> None:
        """``_momentum`` and ``_update_gathered`` for plain tensors in fewer passes over memory
        (the step's elementwise work, not its matmuls, bounded it: ~55 of ~69 ms for ``small``
        on an H200). Block by block (``openk3.ops.muon``; one Triton kernel a pass on CUDA),
        the momentum is updated and its Nesterov combination written straight into its place
        in the stacked Newton-Schulz input (bf16 on CUDA), already in the wide orientation; then
        each block of the result is added into its slice of the decayed parameter with the
        scale and the learning rate as one factor: no fp32 momentum copy, stack, cast back,
        scaled copy or reassembly. A parameter whose head blocks, or whose momentum's, are not
        views of it (a split of a stacked 3-D tensor's columns; a momentum of another layout,
        e.g. loaded) takes ``_update_gathered``: both are written through the blocks."""
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        groups: dict[tuple, list[tuple[torch.Tensor, ...]]] = {}
        copied = []  # the parameters the reference updates
        for p in params:
            split = self.head_splits.get(p)
            buf = self.state[p]["momentum_buffer"]
            views = [_blocks(t, split) for t in (p.grad, buf, p)]
            if not all(_viewed(b, t) for t, blocks in ((buf, views[1]), (p, views[2])) for b in blocks):
                copied.append(p)
                continue
            for g, m, w in zip(*views):
                if g.shape[-2] > g.shape[-1]:  # Newton-Schulz iterates on the wide form
                    g, m, w = g.mT, m.mT, w.mT
                groups.setdefault((tuple(g.shape[-2:]), p.device), []).append((g, m, w))
        if copied:
            self._momentum(copied, mu)
            self._update_gathered(copied, group)
        for (shape, device), members in groups.items():
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as Newton-Schulz
            sizes = [g.shape[0] for g, _, _ in members]
            stacked = torch.empty(sum(sizes), *shape, dtype=dtype, device=device)
            for (g, m, _), out in zip(members, stacked.split(sizes)):
                muon_ops.momentum_(g, m, out, mu, group["nesterov"], self._grad_scale)
            X = zeropower_via_newtonschulz(stacked, group["ns_steps"])
            scale = UPDATE_RMS * math.sqrt(max(shape))
            for (_, _, w), x in zip(members, X.split(sizes)):
                muon_ops.apply_update_(w, x, lr, wd, scale)


def _classify(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(muon, adamw with weight decay, adamw without), each parameter once (tied ones too)."""
    lm_head = getattr(model, "lm_head", None)
    decayed_whole = set()  # matrices that AdamW handles, with weight decay
    no_decay = set()  # AdamW, no weight decay: gains, biases, AttnRes queries
    for m in model.modules():
        if isinstance(m, (nn.Embedding, Router, nn.Conv1d, nn.Conv2d, PositionEmbedding)):
            decayed_whole.add(m.weight)
        elif isinstance(m, AttnResQuery):
            no_decay.add(m.proj.weight)
    if isinstance(lm_head, nn.Linear):
        decayed_whole.add(lm_head.weight)
    muon, decay, nodecay = [], [], []
    # Frozen parameters are included too: they never get a gradient, so no step touches them,
    # and "every parameter is in exactly one optimiser" stays true.
    for p in model.parameters():  # deduplicates tied parameters
        if p in no_decay or p.dim() < 2:
            nodecay.append(p)
        elif p in decayed_whole:
            decay.append(p)
        else:
            muon.append(p)
    return muon, decay, nodecay


def adamw_fusable(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW (one kernel per chunk of parameters: reads parameter,
    gradient and both moments once) applies: plain CUDA tensors. FSDP's DTensors keep the
    foreach path; so does the CPU, whose tests pin the foreach numerics."""
    params = list(params)
    return bool(params) and all(p.is_cuda and not isinstance(p, DTensor) for p in params)


def build_optimizers(model: nn.Module, lr: float, weight_decay: float,
                     optimizer: str = "muon") -> list[torch.optim.Optimizer]:
    """``optimizer="muon"``: [per-head Muon for the matrices, AdamW for the rest];
    ``"adamw"``: [AdamW for everything] (the baseline). Both share the base ``lr`` and decay
    embeddings, ``lm_head`` and matrices by ``weight_decay``, never 1-D parameters or AttnRes
    queries. Muon keeps its default momentum, AdamW uses ``ADAMW_BETAS``. Every param group
    records ``initial_lr`` for ``set_lr``."""
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"optimizer must be 'muon' or 'adamw', got {optimizer!r}")
    muon, decay, nodecay = _classify(model)
    if optimizer == "adamw":
        decay, muon = decay + muon, []
    adam_groups = [dict(params=decay, weight_decay=weight_decay, initial_lr=lr),
                   dict(params=nodecay, weight_decay=0.0, initial_lr=lr)]
    adamw = torch.optim.AdamW([g for g in adam_groups if g["params"]], lr=lr, betas=ADAMW_BETAS,
                              fused=adamw_fusable(decay + nodecay))
    if not muon:
        return [adamw]
    splits = head_slices(model)
    opt = Muon([dict(params=muon, initial_lr=lr)], lr=lr, weight_decay=weight_decay,
               head_splits={p: splits[p] for p in muon if p in splits})
    return [opt, adamw]


def lr_multiplier(step: int, max_steps: int, warmup_steps: int, schedule: str = "cosine",
                  min_lr_ratio: float = 0.1) -> float:
    """Learning-rate multiplier of 0-indexed ``step`` in a run of ``max_steps`` steps.

    Linear warmup ``(step + 1) / warmup_steps``, reaching 1 at step ``warmup_steps - 1``; then
    ``"cosine"``: cosine from 1 down to ``min_lr_ratio`` at the last step, ``max_steps - 1``;
    ``"wsd"`` (warmup-stable-decay): 1 until the last ``WSD_DECAY_FRACTION`` of the run, then linear
    down to ``min_lr_ratio`` at the last step. Steps past the end keep ``min_lr_ratio``.
    """
    if schedule not in ("cosine", "wsd"):
        raise ValueError(f"schedule must be 'cosine' or 'wsd', got {schedule!r}")
    if max_steps < 1 or not 0 <= warmup_steps < max_steps:
        raise ValueError(f"need max_steps >= 1 and 0 <= warmup_steps < max_steps, "
                         f"got {max_steps}, {warmup_steps}")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    last = max_steps - 1
    if schedule == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, last - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = max(warmup_steps, last - round(WSD_DECAY_FRACTION * max_steps))
    if step <= decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, last - decay_start))
    return 1 - (1 - min_lr_ratio) * progress


@dataclass(frozen=True)
class LRSchedule:
    """The learning-rate multiplier of every 0-indexed step of a run, and how a resumed run with
    another ``max_steps`` continues it: never with a jump up.

    ``lr_multiplier`` until an extension. Extending (or shortening) at step ``s0`` records
    ``anchor = (s0, m0)``, the multiplier the run had reached; from there the run continues:
    ``cosine`` with a cosine from ``m0`` down to ``min_lr_ratio`` at the new last step; ``wsd``
    still in its stable phase (``m0 == 1``) keeps it until the new run's decay, and one already
    decaying decays linearly from ``m0`` to ``min_lr_ratio`` over the steps left. A run resumed
    during warm-up needs no anchor: warm-up does not depend on ``max_steps``.
    """

    max_steps: int
    warmup_steps: int
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    anchor: tuple[int, float] | None = None

    def __call__(self, step: int) -> float:
        if self.anchor is None or step < self.anchor[0]:
            return lr_multiplier(step, self.max_steps, self.warmup_steps, self.schedule, self.min_lr_ratio)
        s0, m0 = self.anchor
        if self.schedule == "wsd" and m0 >= 1.0:
            return lr_multiplier(step, self.max_steps, self.warmup_steps, "wsd", self.min_lr_ratio)
        progress = min(1.0, (step - s0) / max(1, self.max_steps - 1 - s0))
        if self.schedule == "cosine":
            return self.min_lr_ratio + (m0 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return m0 - (m0 - self.min_lr_ratio) * progress

    def extended(self, max_steps: int, at_step: int) -> LRSchedule:
        """This schedule with ``max_steps`` changed at 0-indexed step ``at_step`` (the next to run)."""
        if max_steps == self.max_steps:
            return self
        anchor = None if at_step < self.warmup_steps else (at_step, self(at_step))
        return dataclasses.replace(self, max_steps=max_steps, anchor=anchor)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LRSchedule:
        return cls(**{**d, "anchor": tuple(d["anchor"]) if d.get("anchor") is not None else None})


def set_lr(optimizers: Iterable[torch.optim.Optimizer], multiplier: float) -> None:
    """``lr = initial_lr * multiplier`` for every param group of every optimiser."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
