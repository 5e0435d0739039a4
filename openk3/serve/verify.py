"""The speculative verify step as one fixed-shape pass, and the rollback after it
(``docs/speculative.md``, "The verify step").

Every speculating sequence computes exactly ``T = K + 1`` positions: its last token and K drafts;
a sequence planned fewer drafts (k < K) is padded, and the batch is padded to its bucket with
rows of the scratch state slot. So the pass has one shape per batch bucket and is captured as a
CUDA graph (``graphs.py``), like the decode step, whatever the contexts, draft counts and tokens.

* MLA: the T positions of a row are T queries of one paged decode attention (``DecodeBatch``,
  absorbed form): query j reads the cache up to position ``start + j``, written by this pass
  just before, which is the causal mask inside the segment. A padded position writes its latent
  to the scratch block and reads the context of the row's last real position; nothing reads its
  output.
* KDA: every layer runs the segment from the row's states in the pools without writing them
  (``VerifyKDAView``, ``KDAttention._pooled_verify``: ``causal_conv1d_pooled``,
  ``kda_verify_pooled``), and the view keeps the segment's inputs. Once speculative sampling
  knows how many positions each row keeps (its last token and the accepted drafts), ``commit``
  writes the states after them: the recurrent states by a second pass of the recurrence from
  the old state with the positions past the kept ones masked (the recompute strategy of
  ``openk3/ops/kda/verify.py``, ``rollback_recompute_``), all KDA layers in one call as one
  batch of L * H heads (heads are independent); the convolution states by a gather from the old
  states and the segment's inputs (``conv_state_rollback``). A padded position is never kept, so
  it changes no state.

``commit`` must follow ``forward`` before anything else runs the same sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openk3.model.cache import ModelCache
from openk3.ops.kda import conv_state_rollback, rollback_recompute_
from openk3.ops.kda.gate import a_log_heads
from openk3.serve.graphs import CapturedGraph, Graphs, bucket
from openk3.serve.paged_views import DecodeBatch, KDAPool, PagedMLAView
from openk3.serve.sequence import Sequence


@dataclass
class _Segment:
    """One KDA layer's part of a verify pass: ``layer`` (its gate parameters), q, k, v, f
    ``[B, T, H, K]``, beta's logits ``[B, T, H]`` and the short convolution's inputs (q|k|v
    ``[B, T, 3*H*K]``), as ``KDAttention._pooled_verify`` hands them to ``keep``."""

    layer: torch.nn.Module
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    f: torch.Tensor
    beta_logits: torch.Tensor
    conv_inputs: torch.Tensor


class VerifyKDAView:
    """KDA layer ``layer`` (its index among the KDA layers) of ``pool``, rows ``slots`` [B], in a
    verify pass: ``verify_pools`` hands the layer its pools, which it reads (the conv pool in
    place, the recurrent rows gathered) and does not write, and a ``keep`` that appends its
    segment to ``segments``."""

    def __init__(self, pool: KDAPool, layer: int, slots: torch.Tensor, segments: list[_Segment]):
        self._pool, self._layer, self._slots, self._segments = pool, layer, slots, segments

    def verify_pools(self):
        def keep(layer, *segment):
            self._segments.append(_Segment(layer, *segment))
        pool, i = self._pool, self._layer
        return pool.recurrent[i], pool.conv_qkv[i], self._slots, keep


class VerifyStep:
    """The verify pass of ``runner`` (a ``ModelRunner``) for ``T = K + 1`` positions per row and
    its rollback; CUDA graphs by batch bucket while ``graphs.enabled``."""

    def __init__(self, runner, num_speculative_tokens: int, graphs: Graphs):
        self.runner, self.T, self.graphs = runner, num_speculative_tokens + 1, graphs
        self._commit = None  # the rollback of the last forward: a function of num_kept [B] (device)
        self._rows = 0

    def graph(self, B: int) -> _VerifyGraphs | None:
        """The verify pass and rollback of batch bucket ``B`` as CUDA graphs, captured on first
        use; None without graphs."""
        return self.graphs.get_or_capture(B, lambda pool: _VerifyGraphs(self, B, pool))

    def forward(self, seqs: list[Sequence], ks: list[int],
                drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Verify the drafts of ``seqs``: ``ks[i]`` (1 .. K) drafts each, ``drafts`` [len(seqs), K]
        int64 on the device (the row's first ``ks[i]`` count; the rest may be -1). Returns the
        final hidden states [len(seqs), T, d] of every position (the last token's, then each
        draft's) and, with the runner's ``feature_blocks``, the EAGLE-3 draft's features
        [len(seqs), T, 3d] (``ModelRunner._features``); the rows' states are unchanged until
        ``commit``."""
        runner, n = self.runner, len(seqs)
        if drafts.shape != (n, self.T - 1):
            raise ValueError(f"verify: `drafts` must be [{n}, K={self.T - 1}], got {list(drafts.shape)}")
        graph = self.graph(bucket(n))
        B = bucket(n) if graph is not None else n
        pad = B - n
        meta = runner.host_tensor([s.state_slot for s in seqs] + [runner.scratch_slot] * pad,
                                  [s.num_tokens - 1 for s in seqs] + [0] * pad,  # the last token's position
                                  ks + [0] * pad, [s.token_ids[-1] for s in seqs] + [0] * pad)
        drafts = F.pad(drafts, (0, 0, 0, pad)) if pad else drafts
        self._rows = B
        if graph is not None:
            hidden, features = graph.verify.run(meta, drafts)
            self._commit = graph.commit.run
        else:
            meta = meta.to(runner.device, non_blocking=True)
            width = -(-(max(s.num_tokens + k for s, k in zip(seqs, ks))) // runner.block_size)
            hidden, features, segments = self._forward(meta, drafts, width)
            self._commit = lambda num_kept: self._rollback(segments, meta[0], num_kept)
        return hidden[:n], None if features is None else features[:n]

    def commit(self, num_kept: list[int] | torch.Tensor) -> None:
        """After speculative sampling: row i of the last ``forward`` keeps its first
        ``num_kept[i]`` positions (1 .. ks[i] + 1: the last token and the accepted drafts; a list,
        or an int64 tensor on the device, which nothing reads on the host); the KDA states
        (recurrent and convolution) of its slot become those after them. The MLA latents of the
        kept positions are in the cache already; those after them are stale and are overwritten
        before anything reads them."""
        if self._commit is None:
            raise RuntimeError("verify: commit without a forward to commit")
        if isinstance(num_kept, torch.Tensor):
            kept = F.pad(num_kept, (0, self._rows - len(num_kept)), value=1)  # padding rows keep 1
        else:
            (kept,) = self.runner.host_tensor(list(num_kept) + [1] * (self._rows - len(num_kept)))
            kept = kept.to(self.runner.device, non_blocking=True)
        commit, self._commit = self._commit, None
        commit(kept)

    def _forward(self, meta: torch.Tensor, drafts: torch.Tensor, width: int):
        """The pass: meta [4, B] on the device (state slots, the last token's positions, draft
        counts, last tokens), drafts [B, K]; the attention reads ``width`` block-table columns.
        Returns (hidden [B, T, d], features [B, T, 3d] or None, the KDA layers' segments)."""
        runner, T, bs = self.runner, self.T, self.runner.block_size
        slots, starts, ks, last = meta
        ids = torch.cat([last[:, None], drafts.clamp(min=0)], dim=1)                  # [B, T]
        j = torch.arange(T, device=ids.device)
        pos = starts[:, None] + torch.minimum(j, ks[:, None])  # a padded position: the last real one's
        table = runner.block_tables[slots, :width]                                    # [B, W] int32
        paged = table.gather(1, pos // bs).long() * bs + pos % bs
        new_rows = torch.where(j <= ks[:, None], paged, runner.scratch_block * bs)
        tables = table[:, None].expand(-1, T, -1).flatten(0, 1)  # [B*T, W]: one row per query
        batch = DecodeBatch(new_rows.flatten(), tables, (pos + 1).flatten(), bs)
        segments: list[_Segment] = []
        cfg = runner.cfg
        views = [PagedMLAView(runner.mla_cache[i], batch) if i in runner.mla_cache else
                 VerifyKDAView(runner.kda_state, runner.kda_index[i], slots, segments)
                 for i in range(cfg.num_hidden_layers)]
        hidden, bank = runner.model.model.hidden_and_blocks(ids, ModelCache(views))
        features = runner._features(hidden, bank)
        return hidden, None if features is None else features.view(*ids.shape, -1), segments

    def _rollback(self, segments: list[_Segment], slots: torch.Tensor, num_kept: torch.Tensor) -> None:
        """Write the KDA states of ``slots`` [B] after their first ``num_kept`` [B] positions, from
        the segments of every KDA layer (in the pool's layer order)."""
        if not segments:
            return
        pool, cfg = self.runner.kda_state, self.runner.cfg
        L = len(segments)
        B, _, H, K = segments[0].q.shape
        # every layer at once: [B, T, L * H, K] inputs, [B, L * H, K, V] states, per-head gates
        q, k, v, f, beta_logits = (torch.cat([getattr(s, name) for s in segments], dim=2)
                                   for name in ("q", "k", "v", "f", "beta_logits"))
        A_log = torch.cat([a_log_heads(s.layer.A_log, H) for s in segments])
        dt_bias = torch.cat([s.layer.dt_bias.reshape(-1) for s in segments])
        states = pool.recurrent.index_select(1, slots).transpose(0, 1).reshape(B, L * H, K, -1)
        rollback_recompute_(states, torch.arange(B, device=slots.device), num_kept, q, k, v, f,
                            torch.sigmoid(beta_logits.float()),
                            A_log, dt_bias, lower_bound=cfg.kda_gate_lower_bound)
        pool.recurrent.index_copy_(1, slots, states.view(B, L, H, K, -1).transpose(0, 1))
        # the conv states of q|k|v side by side, every layer at once
        x = torch.stack([s.conv_inputs for s in segments])                            # [L, B, T, 3C]
        new = conv_state_rollback(pool.conv_qkv.index_select(1, slots).flatten(0, 1), x.flatten(0, 1),
                                  num_kept.repeat(L))                                  # [L * B, 3C, W-1]
        pool.conv_qkv.index_copy_(1, slots, new.view(L, B, *new.shape[1:]))


class _VerifyGraphs:
    """The verify pass of B rows and its rollback, captured together: the rollback graph reads
    the segments the verify graph leaves in its static memory. Both start from padding rows
    (the scratch slot), which is all their warm-up runs touch."""

    def __init__(self, step: VerifyStep, B: int, pool):
        runner = step.runner
        dev = runner.device
        meta = torch.tensor([[runner.scratch_slot] * B, [0] * B, [0] * B, [0] * B], device=dev)
        drafts = torch.zeros(B, step.T - 1, dtype=torch.long, device=dev)
        kept: list[list[_Segment]] = []

        def verify(meta, drafts):
            hidden, features, segments = step._forward(meta, drafts, runner.max_blocks_per_seq)
            kept[:] = [segments]  # the last call is the capture: its tensors are the graph's
            return hidden, features

        self.verify = CapturedGraph(verify, [meta, drafts], pool)
        self.verify.graph.replay()  # the segments hold values (from padding rows) for the warm-up below
        segments = kept[0]
        self.commit = CapturedGraph(lambda num_kept: step._rollback(segments, meta[0], num_kept),
                                    [torch.ones(B, dtype=torch.long, device=dev)], pool)
