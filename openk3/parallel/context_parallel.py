"""Context parallelism (CP): one sequence split over the P ranks of a group, applied from outside
the model like FSDP and MoonEP (``docs/long_context.md``).

``apply_context_parallel(model, cp)`` turns every decoder layer's attention into its CP form,
in place: the module's class becomes ``KDAttentionCP`` or ``MLAttentionCP`` (a subclass; the
same parameters, names and hooks, as ``torch.nn.utils.parametrize`` does it), which reads the
layout of the current batch from the ``ContextParallel`` object ``cp``. The trainer splits each
batch with ``cp.split(inputs, targets)``; every other part of the model works per token.

Rank r of P holds the contiguous tokens ``[start, end)`` of each sequence (``split_sizes``: the
first ``T % P`` ranks hold one token more when P does not divide T).

* KDA layers (``KDAttentionCP``): the short convolution reads the last ``W-1`` projected
  inputs of the previous rank (a halo, all-gathered and masked at document starts); the
  recurrence runs KCP (``kcp.py``): one all-gather of the fixed-size ``[S~ | M]`` per layer.
* MLA layers (``MLAttentionCP``): the 576-wide latent (``kv_lora_rank`` normalised latent +
  ``qk_rope_head_dim`` shared key, what the serving cache stores) of every rank is
  all-gathered; each rank expands the latents of positions ``< end`` into keys and values and
  attends causally over global positions (bottom-right aligned: local query i sits at global
  position ``start + i``). NoPE: positions enter nowhere else.

Packed documents: ``cp.split(..., cu_seqlens=...)`` with the global document offsets of a
packed batch (B = 1). A document crossing into this rank carries its KDA state, conv inputs
and MLA keys over; a document starting on this rank starts from zero.

Every collective has an autograd backward (``_AllGather``: all-gather forward, reduce-scatter
of the gradients backward), so gradients reach the ranks whose tokens produced the gathered
values. Every rank runs the same collectives in the same order, forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from openk3.model.kda import KDAttention
from openk3.model.mla import MLAttention
from openk3.ops.conv import causal_conv1d
from openk3.ops.fast import compile_disabled
from openk3.parallel.kcp import kcp_kda


def split_sizes(total: int, parts: int) -> list[int]:
    """Tokens per rank for a sequence of ``total`` split over ``parts`` ranks: contiguous, the
    first ``total % parts`` ranks one token more."""
    base, extra = divmod(total, parts)
    return [base + (r < extra) for r in range(parts)]


@dataclass
class SequenceShard:
    """This rank's part of the current batch's sequences.

    Fields:
        start, end: the global positions ``[start, end)`` this rank holds.
        sizes: tokens per rank, in rank order.
        cu_seqlens, cu_seqlens_cpu: local segment offsets ``[N+1]`` of a packed batch (B = 1),
            or None: every row is one sequence.
        segment_starts: the global position where the document of each local segment begins
            (``[N]``; the first is ``< start`` when it continues from the previous rank).
        continues: the first local segment (every row, without documents) continues a
            sequence begun on an earlier rank.
    """

    start: int
    end: int
    sizes: list[int]
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    segment_starts: tuple[int, ...] = (0,)
    continues: bool = False


class _AllGather(torch.autograd.Function):
    """[*s] on each of P ranks -> [P, *s] on every rank; backward: the gradient of each rank's
    slot summed over all ranks (reduce-scatter) back to the rank that sent it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group), *x.shape))
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter(out, list(grad.unbind(0)), group=ctx.group)
        return out, None


class ContextParallel:
    """The CP group and the layout of the batch in flight; the CP layers read it.

    ``group``: the ranks that share each sequence (None: the default group, stored as
    ``dist.group.WORLD`` so that libraries which need an explicit group, such as fla's
    ``build_cp_context``, can take it). Built by ``parallelize`` (``RunConfig.cp``), or directly
    in tests and benchmarks."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.shard: SequenceShard | None = None

    def split(self, *tensors: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, ...]:
        """This rank's slice along dim 1 of each ``[B, T, ...]`` tensor (the whole batch on
        every rank of the group), recording the layout for the layers' next forward.

        cu_seqlens: ``[N+1]`` global document offsets of a packed batch (B = 1, ``0`` first
        and ``T`` last); None: every row is one sequence."""
        B, T = tensors[0].shape[:2]
        for t in tensors:
            if t.shape[:2] != (B, T):
                raise ValueError(f"cp.split: every tensor must be [B, T, ...] = [{B}, {T}, ...], "
                                 f"got {list(t.shape)}")
        if T < self.size:
            raise ValueError(f"cp.split: a sequence of {T} tokens cannot be split over "
                             f"{self.size} ranks")
        sizes = split_sizes(T, self.size)
        start = sum(sizes[:self.rank])
        end = start + sizes[self.rank]
        self.shard = self._shard(start, end, sizes, T, B, cu_seqlens, tensors[0].device)
        return tuple(t[:, start:end] for t in tensors)

    @staticmethod
    def _shard(start, end, sizes, T, B, cu_seqlens, device) -> SequenceShard:
        if cu_seqlens is None:
            return SequenceShard(start, end, sizes, continues=start > 0)
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if B != 1 or bounds[0] != 0 or bounds[-1] != T or any(
                a >= b for a, b in pairwise(bounds)):
            raise ValueError(f"cp.split: cu_seqlens must rise strictly from 0 to T={T} over a "
                             f"packed batch (B = 1), got {bounds} with B={B}")
        doc_start = max(b for b in bounds if b <= start)
        local = [start] + [b for b in bounds if start < b < end] + [end]
        cu_cpu = torch.tensor([b - start for b in local], dtype=torch.int32)
        return SequenceShard(start, end, sizes, cu_cpu.to(device), cu_cpu,
                             segment_starts=(doc_start, *local[1:-1]), continues=doc_start < start)

    def current(self, T: int) -> SequenceShard:
        """The layout of the batch in flight, checked against a local length T."""
        if self.shard is None:
            raise ValueError("a context-parallel layer ran before ContextParallel.split: split "
                             "each batch over the CP ranks first (the trainer does)")
        if self.shard.end - self.shard.start != T:
            raise ValueError(f"context-parallel layer got {T} tokens, but this rank's shard of "
                             f"the batch in flight holds {self.shard.end - self.shard.start}")
        return self.shard

    @compile_disabled("a collective with a collective backward, run as it is")
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[*s] -> [P, *s], differentiable (collective: every rank of the group calls it)."""
        return _AllGather.apply(x, self.group)

    def gather_prefix(self, x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
        """The sequence's positions ``[0, end)`` of ``x`` [B, T_r, D] from this and the
        earlier ranks: [B, end, D] (shards of unequal length are padded for the gather)."""
        longest = max(shard.sizes)
        gathered = self.all_gather(F.pad(x, (0, 0, 0, longest - x.shape[1])))  # [P, B, Tmax, D]
        return torch.cat([gathered[r, :, :n] for r, n in enumerate(shard.sizes[:self.rank + 1])],
                         dim=1)


def conv_halo(x: torch.Tensor, width: int, cp: ContextParallel, shard: SequenceShard,
              ) -> torch.Tensor:
    """The conv state of this rank's first segment: the previous rank's last ``width - 1``
    inputs ``x`` [B, T_r, C] of the short convolution, zero where they precede the segment's
    document (and everywhere on a rank that starts its sequences). Returns [N, C, width - 1]
    (N = B, or the local segments of a packed batch; segments after the first get zeros)."""
    W1 = width - 1
    tails = cp.all_gather(x[:, x.shape[1] - W1:])                  # [P, B, W-1, C]
    prev = tails[(cp.rank - 1) % cp.size]                          # rank 0: masked out below
    positions = torch.arange(shard.start - W1, shard.start, device=x.device)
    keep = ((positions >= shard.segment_starts[0]) if shard.continues
            else torch.zeros(W1, dtype=torch.bool, device=x.device))
    state = (prev * keep[None, :, None].to(prev.dtype)).transpose(1, 2)  # [B, C, W-1]
    if shard.cu_seqlens is not None:
        state = torch.cat([state, state.new_zeros(shard.cu_seqlens.numel() - 2, *state.shape[1:])])
    return state


class KDAttentionCP(KDAttention):
    """``KDAttention`` over this rank's shard of the sequence (see the module docstring)."""

    cp: ContextParallel
    kcp_method = "correct"  # or "rerun" (``kcp.kcp_kda``)

    def forward(self, x: torch.Tensor, state=None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T_r, d], this rank's tokens of the batch in flight (plus ``residual``, as
        ``KDAttention.forward``). Collective."""
        if state is not None:
            raise ValueError("a context-parallel KDA layer runs whole training sequences; "
                             "decoding state is not supported")
        B, T, _ = x.shape
        H, K, W = self.num_heads, self.head_dim, self.cfg.linear_conv_kernel_size
        shard = self.cp.current(T)
        if min(shard.sizes) < W - 1:
            raise ValueError(f"context parallelism needs at least linear_conv_kernel_size - 1 = "
                             f"{W - 1} tokens per rank (the conv halo), got shards {shard.sizes}")
        q, k, v, gate, f, b = (m(x) for m in self.input_projections())
        qkv = torch.cat([q, k, v], dim=-1)                         # [B, T, 3*H*K]
        weight = torch.cat([conv.weight for conv in self.short_convs()])  # [3*H*K, 1, W]
        qkv, _ = causal_conv1d(qkv, weight, conv_halo(qkv, W, self.cp, shard),
                               shard.cu_seqlens, shard.cu_seqlens_cpu)
        q, k, v = (t.view(B, T, H, K) for t in qkv.split(H * K, dim=-1))
        o, _ = kcp_kda(q, k, v, self.f_b_proj(f).view(B, T, H, K), torch.sigmoid(b.float()),
                       self.A_log, self.dt_bias, cp=self.cp,
                       lower_bound=self.cfg.kda_gate_lower_bound, cu_seqlens=shard.cu_seqlens,
                       cu_seqlens_cpu=shard.cu_seqlens_cpu, continues=shard.continues,
                       method=self.kcp_method)
        return self._output(o, gate, residual)


class _GlobalCausalAttention:
    """What ``MLAttention.forward`` hands its queries and latents to under CP (the role the
    decoding cache plays at inference): gathers the earlier positions' latents and attends."""

    def __init__(self, cp: ContextParallel):
        self.cp = cp

    def attend(self, layer: MLAttention, q: torch.Tensor, c: torch.Tensor,
               k_r: torch.Tensor) -> torch.Tensor:
        """q [B, T_r, H, 192], c [B, T_r, 512], k_r [B, T_r, 64] -> [B, T_r, H, v_head_dim]."""
        B, T, H, _ = q.shape
        shard = self.cp.current(T)
        latent = self.cp.gather_prefix(torch.cat([c, k_r], dim=-1), shard)  # [B, end, 576]
        first = shard.segment_starts[0]  # no query reads a key before it
        c_all, k_r_all = latent[:, first:].split([layer.rank, layer.rope], dim=-1)
        Tk = c_all.shape[1]
        kv = layer.kv_b_proj(c_all).view(B, Tk, H, layer.nope + layer.v_dim)
        k_nope, v = kv.split([layer.nope, layer.v_dim], dim=-1)
        k = torch.cat([k_nope, k_r_all.unsqueeze(2).expand(B, Tk, H, layer.rope)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))        # [B, H, T, dim]
        if shard.cu_seqlens is None:  # query i at global position start + i
            return _causal(q, k, v, layer.scale).transpose(1, 2)
        bounds = [shard.start + b for b in shard.cu_seqlens_cpu.tolist()]
        outs = [_causal(q[:, :, a - shard.start:b - shard.start], k[:, :, d - first:b - first],
                        v[:, :, d - first:b - first], layer.scale)
                for a, b, d in zip(bounds[:-1], bounds[1:], shard.segment_starts)]
        return torch.cat(outs, dim=2).transpose(1, 2)


@compile_disabled("torch 2.11 fails to compile the memory-efficient attention's backward")
def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last Tq of Tk positions: q [B, H, Tq, D], k [B, H, Tk, D],
    v [B, H, Tk, Dv] -> [B, H, Tq, Dv] (the mask aligned bottom right).

    MLA's v (128) is narrower than q/k (192). SDPA takes a bottom-right causal mask only with
    flash attention (which needs one width for q, k and v) or the memory-efficient kernel, and
    with the latter, `--cp 2` trained `small` at 131,072 tokens 7.2x slower in tokens/s than
    `--cp 1` (a whole sequence per GPU, a square causal mask; docs/benchmarks.md, seventh
    session).
    So v is zero-padded to q's width, which lets SDPA pick flash attention on the GPU, and the
    padding is sliced off the output (its gradient is zero). Outside the compiled MLA body:
    on the H200 (torch 2.11) compiling the memory-efficient kernel's backward fails in its
    fake-tensor rule ("meta__efficient_attention_backward() got multiple values for argument
    'scale'")."""
    Dv = v.shape[-1]
    if Dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - Dv))
    from torch.nn.attention.bias import causal_lower_right  # imports dynamo (~1 s): not at start-up

    mask = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[..., :Dv]


class MLAttentionCP(MLAttention):
    """``MLAttention`` over this rank's shard of the sequence (see the module docstring)."""

    cp: ContextParallel

    def forward(self, x: torch.Tensor, state=None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T_r, d], this rank's tokens of the batch in flight (plus ``residual``, as
        ``MLAttention.forward``). Collective."""
        if state is not None:
            raise ValueError("a context-parallel MLA layer runs whole training sequences; "
                             "decoding state is not supported")
        return super().forward(x, _GlobalCausalAttention(self.cp), residual)


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> None:
    """Make every decoder layer's attention of ``model`` (``KimiForCausalLM``) context-parallel
    over ``cp``, in place. MTP layers are refused: their inputs shift by one token, across the
    ranks' boundaries."""
    if len(getattr(model, "mtp", ())):
        raise ValueError("context parallelism does not support MTP layers (their next-token "
                         "inputs cross the ranks' boundaries): set mtp_layers=0")
    for layer in model.model.layers:
        make_context_parallel(layer.self_attn, cp)


def make_context_parallel(attn: nn.Module, cp: ContextParallel) -> nn.Module:
    """One attention module (``KDAttention`` or ``MLAttention``) made context-parallel in place;
    returns it."""
    for plain, cp_class in ((KDAttention, KDAttentionCP), (MLAttention, MLAttentionCP)):
        if type(attn) is plain:
            attn.__class__ = cp_class
            attn.cp = cp
            return attn
    raise ValueError(f"make_context_parallel: expected a KDAttention or MLAttention, got "
                     f"{type(attn).__name__}")
