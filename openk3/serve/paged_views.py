"""What the model's layers see of the serving engine's cache: view objects with the interface of
the generate path's ``KDAState`` / ``MLAState`` (``openk3/model/cache.py``), so the model code is
the same for both paths.

* ``KDAPool``: recurrent and conv states of every KDA layer for ``n`` entries (state slots or
  checkpoints); ``PagedKDAView``: one layer's view of this batch's state slots (reading an
  attribute gathers the rows, assigning scatters them back).
* ``PagedMLAView``: stores the batch's new latents in the paged cache, then attends with the
  forms that read the cache in place, MLA's math as in ``MLAttention``:

  - ``DecodeBatch`` (one token per row, or a speculative verify step's ``K + 1`` tokens per
    sequence, each with its own context): the absorbed form; ``paged_mla_decode`` reads each
    query's blocks through the block table;
  - ``PrefillBatch`` (packed chunks): the expanded form over every chunk's cached prefix plus
    the chunk, gathered in one go, and one ``varlen_causal_attention`` for all chunks.

  ``MLAttention``'s absorbed and expanded methods are the references (``tests/serve``).
* ``prefix_kv_weight``: ``kv_b_proj`` widened so that one GEMM over cache rows writes the
  prefill's keys and values as the attention reads them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openk3.ops.paged_mla import paged_mla_decode
from openk3.ops.varlen_attention import varlen_causal_attention


class KDAPool:
    """State tensors of ``num_layers`` KDA layers x ``n`` entries: recurrent
    ``[num_layers, n, H, K, K]`` fp32 and the conv states of q, k and v side by side,
    ``conv_qkv`` ``[num_layers, n, 3*H*K, W-1]`` (what one fused convolution reads and writes);
    ``conv_q``, ``conv_k``, ``conv_v`` are views of its three parts.

    One tensor per field for all layers, so an instruction (restore, reset, save) is one
    indexed copy per field however many layers there are."""

    FIELDS = ("recurrent", "conv_qkv")  # the storage
    NAMES = (*FIELDS, "conv_q", "conv_k", "conv_v")  # what a layer's view reads and writes

    def __init__(self, cfg, num_layers: int, n: int, device, dtype):
        H, K, W = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_size
        self.recurrent = torch.zeros(num_layers, n, H, K, K, device=device, dtype=torch.float32)
        self.conv_qkv = torch.zeros(num_layers, n, 3 * H * K, W - 1, device=device, dtype=dtype)
        self.conv_q, self.conv_k, self.conv_v = self.conv_qkv.split(H * K, dim=2)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f) for f in self.FIELDS]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def copy_(self, dst: torch.Tensor, src_pool: KDAPool, src: torch.Tensor) -> None:
        """Entries ``dst`` [n] of every layer := ``src_pool``'s entries ``src`` [n]."""
        for t, s in zip(self.tensors(), src_pool.tensors()):
            t.index_copy_(1, dst, s.index_select(1, src))

    def zero_(self, entries: torch.Tensor) -> None:
        for t in self.tensors():
            t.index_fill_(1, entries, 0)


class PagedKDAView:
    """KDA layer ``layer`` (its index among the KDA layers) of ``pool``, rows ``slots`` [B]:
    reading a state attribute (``KDAPool.NAMES``) gathers the rows, assigning scatters them back;
    ``decode_pools`` hands a decode step the pools themselves, to update in place."""

    def __init__(self, pool: KDAPool, layer: int, slots: torch.Tensor, cu_seqlens: torch.Tensor | None,
                 cu_seqlens_cpu: torch.Tensor | None, static_varlen: bool = False):
        self._pool, self._layer, self._slots = pool, layer, slots
        self.cu_seqlens, self.cu_seqlens_cpu = cu_seqlens, cu_seqlens_cpu
        # a graphed prefill: cu_seqlens padded with empty sequences, no host copy (``kda``)
        self.static_varlen = static_varlen

    def __getattr__(self, name):
        if name in KDAPool.NAMES:
            return getattr(self._pool, name)[self._layer].index_select(0, self._slots)
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name in KDAPool.NAMES:
            t = getattr(self._pool, name)[self._layer]
            t.index_copy_(0, self._slots, value.to(t.dtype))
        else:
            super().__setattr__(name, value)

    def decode_pools(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(this layer's recurrent pool [n, H, K, V], conv pool [n, 3*H*K, W-1], the rows'
        slots [B]) for a one-token-per-row step that updates them in place
        (``KDAttention._pooled_decode``); None for a packed prefill batch."""
        if self.cu_seqlens is not None:
            return None
        return self._pool.recurrent[self._layer], self._pool.conv_qkv[self._layer], self._slots


@dataclass
class DecodeBatch:
    """T new tokens per row of a [B, T] batch (T = 1: a decode step; T = K + 1: a speculative
    verify step), each a query of its own, in row-major order (query ``b * T + j``):
    ``slot_mapping`` [B*T] their cache rows; ``block_table`` [B*T, W] int32 and ``context_lens``
    [B*T] (the query's own token included, so a verify query reads the segment up to itself:
    the causal mask) what ``paged_mla_decode`` reads; ``first_pos`` [B*T] the first position
    each query reads (None: 0; the EAGLE-3 draft's ``base``)."""

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    first_pos: torch.Tensor | None = None


@dataclass
class PrefillBatch:
    """Chunks packed into one row. ``slot_mapping`` [T] the cache row of every new token;
    ``key_rows`` [K] the cache rows of every chunk's whole prefix (past + chunk), chunk after
    chunk; ``cu_seqlens_q`` / ``cu_seqlens_k`` [N+1] their offsets, on the device and the host."""

    slot_mapping: torch.Tensor
    key_rows: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    cu_seqlens_q_cpu: torch.Tensor
    cu_seqlens_k_cpu: torch.Tensor


_WIDE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # MLA layer -> (weight's version, wide)


def prefix_kv_weight(layer) -> torch.Tensor:
    """``layer.kv_b_proj``'s weight widened to [H * (nope + rope + v), rank + rope]: one GEMM
    over cache rows [c | k_r] gives every head's key [k_nope | k_r] and value side by side, each
    a strided view the attention reads as is. Per head, the nope and value rows are kv_b_proj's
    (zeros against k_r) and the rope rows an identity on k_r (exact). Replaces a GEMM into
    [k_nope | v] and two copies assembling the keys (0.76 ms of a 1,024-token chunk after a
    31,744-token prefix, six layers; the GEMM grows 41%: docs/benchmarks.md, twenty-second
    session). Rebuilt when the weight changes in place (``LLMEngine.load_weights``)."""
    w = layer.kv_b_proj.weight
    key = (w._version, w.data_ptr())
    cached = _WIDE.get(layer)
    if cached is not None and cached[0] == key:
        return cached[1]
    H, nope, rope, v_dim, R = layer.num_heads, layer.nope, layer.rope, layer.v_dim, layer.rank
    w_k, w_v = w.detach().view(H, nope + v_dim, R).split([nope, v_dim], dim=1)
    wide = w.new_zeros(H, nope + rope + v_dim, R + rope)
    wide[:, :nope, :R] = w_k
    wide[:, nope:nope + rope, R:] = torch.eye(rope, dtype=w.dtype, device=w.device)
    wide[:, nope + rope:, :R] = w_v
    wide = wide.flatten(0, 1)
    _WIDE[layer] = (key, wide)
    return wide


class PagedMLAView:
    """``pieces`` (a graphed prefill, ``openk3.serve.graphs.PiecewiseGraph``): ``attend`` is an
    eager part of it, which reads ``batch`` when it runs (the runner sets it before each replay);
    the queries beyond ``batch``'s tokens are the graph's padding (their rows of the result are
    left undefined)."""

    def __init__(self, cache: torch.Tensor, batch: DecodeBatch | PrefillBatch, pieces=None):
        self.cache, self.batch, self.pieces = cache, batch, pieces

    def attend(self, layer, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """q [B, T, H, qk_head_dim], latent [B, T, R], k_rope [B, T, P] -> [B, T, H, v_head_dim]."""
        if self.pieces is not None:
            return self.pieces.eager(lambda: self._attend(layer, q, latent, k_rope),
                                     (*q.shape[:3], layer.v_dim), q.dtype, q.device)
        return self._attend(layer, q, latent, k_rope)

    def _attend(self, layer, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        rows = torch.cat([latent, k_rope], dim=-1).flatten(0, 1).to(self.cache.dtype)
        self.cache.index_copy_(0, self.batch.slot_mapping, rows)
        if isinstance(self.batch, DecodeBatch):
            return self._absorbed_decode(layer, q)
        return self._expanded_prefill(layer, q)

    def _absorbed_decode(self, layer, q: torch.Tensor) -> torch.Tensor:
        """``kv_b_proj``'s key half folded into the query, its value half into the output."""
        b, H, nope = self.batch, layer.num_heads, layer.nope
        B, T = q.shape[:2]
        w = layer.kv_b_proj.weight.view(H, nope + layer.v_dim, layer.rank)
        q_nope, q_rope = q.flatten(0, 1).split([nope, layer.rope], dim=-1)  # [B*T, H, 128], [B*T, H, 64]
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w[:, :nope])  # [B*T, H, 512]
        o_lat = paged_mla_decode(q_lat, q_rope, self.cache, b.block_table, b.context_lens,
                                 b.block_size, layer.scale, b.first_pos)  # [B*T, H, 512]
        return torch.einsum("bhc,hdc->bhd", o_lat, w[:, nope:]).view(B, T, H, -1)  # [B, T, H, 128]

    def _expanded_prefill(self, layer, q: torch.Tensor) -> torch.Tensor:
        """Keys and values expanded from every chunk's prefix latents by one ``kv_b_proj``."""
        b, H = self.batch, layer.num_heads
        ctx = self.cache[b.key_rows]  # [K, R + P]
        kv = F.linear(ctx, prefix_kv_weight(layer)).view(ctx.shape[0], H, -1)  # [K, H, 192 + 128]
        k, v = kv.split([layer.nope + layer.rope, layer.v_dim], dim=-1)
        T = int(b.cu_seqlens_q_cpu[-1])  # q's rows past T are a graph's padding
        o = varlen_causal_attention(q[0, :T], k, v, b.cu_seqlens_q, b.cu_seqlens_k,
                                    b.cu_seqlens_q_cpu, b.cu_seqlens_k_cpu, layer.scale)
        return o[None]  # [1, T, H, 128]
