"""The EAGLE-3 draft in the serving engine: ``EagleDrafter`` (``docs/speculative.md``, "Engine
integration: the EAGLE-3 draft") and its reference ``eagle_propose_ref``.

The draft (``openk3/model/draft.py``: fusion ``fc`` + one ``MTPLayer``, the target's embedding and
head) at position t reads the target's features at t and the next token::

    f_t = fc( cat(bank[lo]_t, bank[mid]_t, h_t) )         from the target's forward of position t
    g_t = draft(f_t, embed(x_{t+1}))                       q = softmax(lm_head(g_t)) drafts x_{t+2}

so position t of the draft can run once the target has computed t *and* x_{t+1} is known. For
the kept part of a verify segment (the last token, the accepted drafts, and the corrected or
bonus token as the next input) that is right after speculative sampling, on the device: the
engine calls ``rollback``; for prompt chunks and plain decodes, ``observe`` after
``Scheduler.postprocess``. The draft runs over those positions, writing their MLA latents into
its cache and keeping ``g`` of each sequence's last kept position, ``n - 2`` for a sequence of
``n`` tokens, whose head gives the distribution of ``d_1 = x_n``. ``propose`` then needs no pass for ``d_1``; draft ``d_{i+1}`` comes from
``draft(g_prev, embed(d_i))`` (EAGLE's training-time test: the draft's own output replaces f),
attending over the real positions and the chain's earlier speculative latents.

Fixed shapes (CUDA graphs by batch bucket, as the target's decode and verify passes): a chain
step runs every speculating row, a row that has made its ``k`` draws as a padding row (the
scratch slot); ``rollback`` runs the verified sequences as ``[B, K + 1]`` (the verify segment's
positions, those past the kept ones writing to the scratch block). A batch runs its whole chain
as one pass (one graph): greedy, the argmax of each step; with sampled requests, each draw by the
inverse CDF from a uniform hashed on the host from the request's seed and length
(``sampler.counter_uniforms``), since a request's own generator cannot be replayed in a graph.
Prompt chunks and plain decodes go through one packed pass (eager).

Cache: the draft's one MLA layer keeps its latents in a paged tensor addressed through the
*target's* block tables (rows ``block * block_size + offset``, as a target MLA layer), so it costs
one MLA layer of memory and needs no allocator of its own. The chain's speculative latents go to
the pages of their positions (``n - 1 ..``, which the step's verify positions have blocks for),
past the sequence's kept positions: ``observe`` overwrites them with the real latents of the
accepted positions, and the rest is never read before being written again. A sequence's draft
attends over positions ``[base, ..)``: ``base`` is where the target started computing it at
admission, 0 unless a prefix-cache hit skipped the target's forward (and so the features) of the
cached positions. Acceptance may then drop for that request; the output distribution does not
change.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from openk3.model.cache import MLAState
from openk3.model.draft import Eagle3Draft, target_fingerprint
from openk3.model.fuse import fuse_projections
from openk3.model.model import cast_model
from openk3.serve.config import EngineConfig
from openk3.serve import sampler
from openk3.serve.draft import DraftProposer
from openk3.serve.graphs import CapturedGraph, Graphs, bucket
from openk3.serve.model_runner import ModelRunner, StepResult
from openk3.serve.paged_views import DecodeBatch, PagedMLAView, PrefillBatch
from openk3.serve.sampler import SamplingParams
from openk3.serve.scheduler import SchedulerOutput
from openk3.serve.sequence import SequenceStatus


class EagleDrafter(DraftProposer):
    """An ``Eagle3Draft`` of the target that ``target_runner`` runs, cast to its dtype.

    Per state slot (host): ``base`` (first position of the draft's cache) and ``length`` (its end:
    after ``observe``, the sequence's ``num_computed_tokens``); on the device ``last`` [slots, d],
    the draft's output at position ``length - 1``."""

    def __init__(self, draft: Eagle3Draft, target_runner: ModelRunner, config: EngineConfig):
        runner = target_runner
        have = target_fingerprint(runner.cfg)
        if draft.cfg.target_fingerprint != have:
            raise ValueError(f"EAGLE draft: trained for a target with config fingerprint "
                             f"{draft.cfg.target_fingerprint} ({draft.cfg.target_path!r}); this target's is {have}")
        cast_model(draft, runner.dtype, runner.device)  # the router stays fp32, values intact
        self.draft = draft.eval().requires_grad_(False)
        fuse_projections(draft.layer)  # not the draft itself: its ``fuse`` is the feature fusion
        self.runner, self.feature_blocks = runner, tuple(draft.cfg.fused_blocks)
        self.embed, self.lm_head = runner.model.model.embed_tokens, runner.model.lm_head
        self.K = config.num_speculative_tokens
        attn = self.draft.layer.self_attn
        slots = config.max_num_seqs + 1  # the runner's state slots, scratch included
        self.cache = torch.zeros((runner.num_blocks + 1) * runner.block_size, attn.rank + attn.rope,
                                 device=runner.device, dtype=runner.dtype)
        self.base, self.length = [0] * slots, [0] * slots
        self.last = torch.zeros(slots, draft.cfg.hidden_size, device=runner.device, dtype=runner.dtype)
        # chain steps and observe passes by (kind, batch bucket); they replay in turn
        self.graphs = Graphs(runner.use_graphs, "EAGLE draft")

    def cache_bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    # the graphs by kind: the greedy chain, the sampled chain without and with top-p / top-k, the
    # update of the verified rows; each captured as capture(drafter, B, pool)
    _CAPTURES = {"greedy": lambda d, B, pool: d._capture_greedy(B, pool),
                 "sampled": lambda d, B, pool: d._capture_sampled(B, False, pool),
                 "filtered": lambda d, B, pool: d._capture_sampled(B, True, pool),
                 "observe": lambda d, B, pool: d._capture_observe(B, pool)}

    def graph(self, kind: str, B: int) -> CapturedGraph | None:
        """The CUDA graph of ``kind`` (a key of ``_CAPTURES``) for batch bucket ``B``, captured on
        first use; None without graphs."""
        return self.graphs.get_or_capture((kind, B), lambda pool: self._CAPTURES[kind](self, B, pool))

    def capture_graphs(self, sizes: list[int], progress: Callable[[str, int], None] | None = None) -> None:
        """Every graph of every batch bucket in ``sizes`` now (``LLMEngine.capture_graphs``)."""
        for B in sizes:
            for kind in self._CAPTURES:
                if progress is not None:
                    progress(f"draft {kind}", B)
                self.graph(kind, B)

    # The chain: propose.

    def _chain_layout(self, rows: torch.Tensor, steps: torch.Tensor, width: int) -> tuple[torch.Tensor, list]:
        """Where chain steps ``steps`` [S] (>= 1) of every row run, all at once: rows [4, B] each
        row's tokens n, state slot, ``base`` and draft count k (padding rows: k = 0). A row with
        k > i computes position n - 2 + i of its chain at step i, reading its cache from ``base``
        up to it (``width`` block-table columns); the others are padding rows (the scratch slot).
        Returns (live [S, B], a ``DecodeBatch`` per step)."""
        runner, bs = self.runner, self.runner.block_size
        num_tokens, slots, base, ks = rows
        live = steps[:, None] < ks                                                     # [S, B]
        pos = torch.where(live, num_tokens - 2 + steps[:, None], 0)
        # a row past its k writes its latent to the scratch block, and reads position 0 (its
        # output is ignored) through the row's own table: one [B, W] table for every step
        block = runner.block_tables[torch.where(live, slots, runner.scratch_slot), pos // bs]   # [S, B] int32
        new_rows = block.long() * bs + pos % bs
        table = runner.block_tables[slots, :width]                                     # [B, W]
        first = torch.where(live, base, 0)
        return live, [DecodeBatch(new_rows[i], table, pos[i] + 1, bs, first[i]) for i in range(len(steps))]

    def _chain_step(self, state: torch.Tensor, drawn: torch.Tensor, live: torch.Tensor,
                    batch: DecodeBatch) -> torch.Tensor:
        """One step of every chain, in place: state [B, d] the previous step's g (the new g on
        return), drawn [B] the draws d_i, ``live`` [B] and ``batch`` this step's layout
        (``_chain_layout``). Returns the logits [B, V] fp32 of d_{i+1}."""
        ids = torch.where(live, drawn, 0)
        state.copy_(self.draft(state[:, None], self.embed(ids)[:, None], PagedMLAView(self.cache, batch))[:, 0])
        return self.lm_head(state).float()

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Drafts of the speculating sequences, as ``Drafter.propose`` returns them: (tokens [n, K]
        int64, probabilities [n, K, V] fp32), row b beyond its own ``k_b`` -1 / 0; None when
        nobody speculates. ``d_1`` comes from the kept output ``last``; each later draft from one
        chain step of every row, all of them in one pass (``_greedy_chain``, ``_sampled_chain``).
        A request's generator is not advanced: its drafts' uniforms are keyed by its seed."""
        seqs = [s for s, _ in out.scheduled if s.request_id in out.num_draft_tokens]
        if not seqs:
            return None
        for s in seqs:
            if self.length[s.state_slot] != s.num_tokens - 1:
                raise RuntimeError(f"EAGLE draft of request {s.request_id!r}: its cache ends at position "
                                   f"{self.length[s.state_slot]}, the sequence has {s.num_tokens} tokens")
        runner = self.runner
        runner.update_block_tables(out)  # the chain writes latents in the blocks this step appends
        n, ks = len(seqs), [out.num_draft_tokens[s.request_id] for s in seqs]
        B = bucket(n) if self.graphs.enabled else n
        pad = B - n
        columns = ([s.num_tokens for s in seqs] + [0] * pad, [s.state_slot for s in seqs] + [runner.scratch_slot] * pad,
                   [self.base[s.state_slot] for s in seqs] + [0] * pad, ks + [0] * pad)
        width = -(-(max(s.num_tokens for s in seqs) + self.K) // runner.block_size)
        if all(p.temperature == 0 for p in params):  # the whole chain in one pass
            rows = runner.host_tensor(*columns)
            greedy = self.graph("greedy", B)
            if greedy is not None:
                return greedy.run(rows)[:n].clone(), None  # the graph pool's memory: the update may reuse it
            return self._greedy_chain(rows.to(runner.device, non_blocking=True), width)[:n], None
        # sampled: the whole chain in one pass too, each row's K uniforms hashed on the host from
        # its key (``sampler.counter_uniforms``): the request's seed (an unseeded request a fresh
        # random one) and its length, so a seeded request's drafts do not depend on the batch
        seeds = [g.initial_seed() if g is not None else int(torch.randint(0, 2**62, ())) for g in generators]
        draws = sampler.counter_uniforms(seeds + [0] * pad, columns[0], self.K)
        rows = runner.host_tensor(*columns, *draws.T.tolist())
        settings = torch.tensor([[p.temperature, p.top_p, p.top_k] for p in params] + [[0.0, 1.0, 0]] * pad,
                                dtype=torch.float32, pin_memory=rows.is_pinned())
        filtering = sampler.filters(params)
        sampled = self.graph("filtered" if filtering else "sampled", B)
        if sampled is not None:
            tokens, probs = sampled.run(rows, settings)  # the verify reads probs before the pool's next replay
            return tokens[:n].clone(), probs[:n]
        tokens, probs = self._sampled_chain(rows.to(runner.device, non_blocking=True),
                                            settings.to(runner.device, non_blocking=True), filtering, width)
        return tokens[:n], probs[:n]

    def _chain(self, rows: torch.Tensor, width: int, draw) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts of a batch, every step of every chain in one pass (one CUDA graph per bucket:
        no host work between the steps): rows [4 + ..., B], ``_chain_layout``'s first; ``draw(i,
        logits)`` gives draft i of every row from its logits [B, V] fp32: (tokens [B], the
        distribution [B, V] they were drawn from, or None). Returns (tokens [B, K] int64, the
        distributions [B, K, V] or None), -1 / 0 past a row's k (the chain always runs K - 1
        steps, those past every row's k as padding rows)."""
        state = self.last.index_select(0, rows[1])  # g at position n - 2: drafts x_n
        live, batches = self._chain_layout(rows[:4], torch.arange(1, self.K, device=rows.device), width)
        logits = self.lm_head(state).float()
        tokens, probs = [], []
        for i in range(self.K):
            drawn, q = draw(i, logits)
            drafting = rows[3] > i
            tokens.append(torch.where(drafting, drawn, -1))
            if q is not None:
                probs.append(q * drafting[:, None])
            if i + 1 < self.K:
                logits = self._chain_step(state, drawn, live[i], batches[i])
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None

    def _greedy_chain(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``_chain`` of a batch of greedy requests: rows [4, B]; each draft the argmax of its
        step's logits (what ``sample_drafts`` draws for such a batch). Returns tokens [B, K]."""
        return self._chain(rows, width, lambda i, logits: (logits.argmax(-1), None))[0]

    def _capture_greedy(self, B: int, pool) -> CapturedGraph:
        rows = torch.tensor([[0] * B, [self.runner.scratch_slot] * B, [0] * B, [0] * B], device=self.runner.device)
        return CapturedGraph(lambda rows: self._greedy_chain(rows, self.runner.max_blocks_per_seq), [rows], pool)

    def _sampled_chain(self, rows: torch.Tensor, settings: torch.Tensor, filtering: bool,
                       width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``_chain`` of a batch with sampled requests (one graph per bucket and ``filtering``:
        keys "sampled" and "filtered"): rows [4 + K, B], ``_chain_layout``'s rows and then each
        row's K uniforms (``sampler.counter_uniforms``' numerators); settings [B, 3] fp32 each
        row's temperature, top-p and top-k (a greedy row's distribution is one-hot at the
        argmax). Draft i of a row is ``inverse_cdf_sample`` of its distribution after the row's
        settings (``sampler.filtered_logprobs``) with its uniform i. Returns (tokens [B, K] int64,
        those distributions [B, K, V] fp32)."""
        temperature, top_p, top_k = settings.unbind(1)
        u = rows[4:].double() * 2.0 ** -53                                            # [K, B]

        def draw(i: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q = sampler.filtered_logprobs(logits, temperature, top_k.long(), top_p, filtering).exp()
            return sampler.inverse_cdf_sample(q, u[i]), q

        return self._chain(rows, width, draw)

    def _capture_sampled(self, B: int, filtering: bool, pool) -> CapturedGraph:
        dev, runner = self.runner.device, self.runner
        rows = torch.tensor([[0] * B, [runner.scratch_slot] * B, [0] * B, [0] * B] + [[0] * B] * self.K, device=dev)
        settings = torch.tensor([[1.0, 1.0, 0.0]] * B, device=dev)
        return CapturedGraph(lambda rows, settings: self._sampled_chain(rows, settings, filtering,
                                                                        runner.max_blocks_per_seq),
                             [rows, settings], pool)

    # Observe: the positions the target kept.

    def _observe_verified(self, features: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor,
                          rows: torch.Tensor, width: int) -> None:
        """The draft over the verify segments of B rows: features [B, T, 3d] (the target's, at
        every position of the segment), tokens [B, T] (``tokens[b, j]`` the token after position
        j of the segment, for its first ``kept[b]`` positions), kept [B] and rows [3, B]: the
        segment's first position, the state slot and ``base`` (padding rows: the scratch slot, 1
        kept). Writes the latents of the kept positions (the others' go to the scratch block) and
        ``last`` = g at the last kept one."""
        runner, bs, T = self.runner, self.runner.block_size, self.K + 1
        start, slots, base = rows
        j = torch.arange(T, device=tokens.device)
        keeps = j < kept[:, None]
        pos = start[:, None] + torch.minimum(j, kept[:, None] - 1)  # past the kept: the last kept's context
        table = runner.block_tables[slots, :width]
        paged = table.gather(1, pos // bs).long() * bs + pos % bs
        new_rows = torch.where(keeps, paged, runner.scratch_block * bs)
        batch = DecodeBatch(new_rows.flatten(), table[:, None].expand(-1, T, -1).flatten(0, 1), (pos + 1).flatten(),
                            bs, base[:, None].expand(-1, T).flatten())
        g = self.draft(self.draft.fc(features), self.embed(torch.where(keeps, tokens, 0)),
                       PagedMLAView(self.cache, batch))
        self.last.index_copy_(0, slots, g[torch.arange(len(g), device=g.device), kept - 1])

    def _capture_observe(self, B: int, pool) -> CapturedGraph:
        dev, runner, T = self.runner.device, self.runner, self.K + 1
        rows = torch.tensor([[0] * B, [runner.scratch_slot] * B, [0] * B], device=dev)
        return CapturedGraph(
            lambda features, tokens, kept, rows: self._observe_verified(features, tokens, kept, rows,
                                                                        runner.max_blocks_per_seq),
            [torch.zeros(B, T, 3 * self.draft.cfg.hidden_size, device=dev, dtype=runner.dtype),
             torch.zeros(B, T, dtype=torch.long, device=dev), torch.ones(B, dtype=torch.long, device=dev), rows],
            pool)

    @torch.inference_mode()
    def rollback(self, result: StepResult, num_kept: torch.Tensor, tokens: torch.Tensor) -> None:
        """``observe`` of the verified sequences, run as soon as the device knows what they keep
        (before the host does): one pass of fixed shape ``[B, K + 1]`` over the verify segments,
        whose features the target's pass left. Their ``length`` moves on in ``observe``."""
        runner, T = self.runner, self.K + 1
        seqs = result.verified
        n = len(seqs)
        graph = self.graph("observe", bucket(n))
        B = bucket(n) if graph is not None else n
        pad = B - n
        rows = runner.host_tensor([self.length[s.state_slot] for s in seqs] + [0] * pad,
                                  [s.state_slot for s in seqs] + [runner.scratch_slot] * pad,
                                  [self.base[s.state_slot] for s in seqs] + [0] * pad)
        tokens, kept = F.pad(tokens, (0, 0, 0, pad)), F.pad(num_kept, (0, pad), value=1)
        if graph is not None:
            graph.inputs[0][:n].copy_(result.verify_features)
            graph.run(None, tokens, kept, rows)
        else:
            end = max(self.length[s.state_slot] for s in seqs) + T
            self._observe_verified(result.verify_features, tokens, kept, rows.to(runner.device, non_blocking=True),
                                   min(-(-end // runner.block_size), runner.max_blocks_per_seq))

    def _batch(self, segments: list[tuple[int, int, int, int]]) -> PrefillBatch:
        """The attention batch of one packed draft pass over ``segments`` (state slot, first key
        position, end of the keys, queries): a segment's keys are its positions ``[start, end)``
        (pages of the target's block table) and its queries are its last ``queries`` keys, whose
        rows receive the new latents."""
        runner, bs = self.runner, self.runner.block_size
        slots, starts, ends, new = (list(c) for c in zip(*segments))
        num_keys = [e - s for s, e in zip(starts, ends)]
        cu_k, cu_q = [0, *itertools.accumulate(num_keys)], [0, *itertools.accumulate(new)]
        slots_d, starts_d, new_d, cu_k_d, cu_q_d = runner._upload(slots, starts, new, cu_k, cu_q)
        dev, K, T = runner.device, cu_k[-1], cu_q[-1]
        seg = torch.arange(len(segments), device=dev)
        k_seg = torch.repeat_interleave(seg, cu_k_d.diff(), output_size=K)
        pos = starts_d[k_seg] + torch.arange(K, device=dev) - cu_k_d[k_seg]
        table = runner.block_tables.index_select(0, slots_d).long()  # [N, max_blocks]
        key_rows = table[k_seg, pos // bs] * bs + pos % bs
        q_seg = torch.repeat_interleave(seg, new_d, output_size=T)
        q_key = cu_k_d[q_seg + 1] - new_d[q_seg] + torch.arange(T, device=dev) - cu_q_d[q_seg]
        return PrefillBatch(key_rows[q_key], key_rows, cu_q_d, cu_k_d, torch.tensor(cu_q), torch.tensor(cu_k))

    def _observe_packed(self, out: SchedulerOutput, result: StepResult) -> None:
        """``observe`` of the prompt chunks and plain decodes (``result.features``): one packed pass."""
        admitted = set(out.kda_resets) | {r.dst_state_slot for r in out.kda_restores}
        rows, next_ids, segments, slots, offset = [], [], [], [], 0
        for seq, first, n in result.feature_spans:
            r0, offset = offset, offset + n
            if seq.status is not SequenceStatus.RUNNING:  # finished: nothing to draft for
                continue
            slot = seq.state_slot
            if slot in admitted:  # a fresh cache, from the first position the target computed
                self.base[slot] = self.length[slot] = first
            if self.length[slot] != first:
                raise RuntimeError(f"EAGLE draft of request {seq.request_id!r}: its cache ends at position "
                                   f"{self.length[slot]}, but the target's step started at {first}")
            rows += range(r0, r0 + n)
            next_ids += seq.token_ids[first + 1:first + n + 1]
            segments.append((slot, self.base[slot], first + n, n))
            slots.append(slot)
            self.length[slot] = first + n
        if not segments:
            return
        rows_d, ids_d, last_d, slots_d = self.runner._upload(
            rows, next_ids, list(itertools.accumulate(s[3] for s in segments)), slots)
        states = self.draft.fc(result.features.index_select(0, rows_d))  # f [T, d]
        batch = self._batch(segments)
        g = self.draft(states[None], self.embed(ids_d)[None], PagedMLAView(self.cache, batch))[0]
        self.last.index_copy_(0, slots_d, g.index_select(0, last_d - 1))

    @torch.inference_mode()
    def observe(self, out: SchedulerOutput, result: StepResult) -> None:
        """Run the draft over the positions the target kept this step, after
        ``Scheduler.postprocess`` (so every kept position's next token is known)."""
        if result.feature_spans:
            self._observe_packed(out, result)
        for seq in result.verified:  # their kept positions ran in ``rollback``
            if seq.status is SequenceStatus.RUNNING:  # finished: its slot is free
                self.length[seq.state_slot] = seq.num_computed_tokens


@torch.no_grad()
def eagle_propose_ref(target, draft: Eagle3Draft, token_ids: list[int], draft_tokens: list[int],
                      base: int = 0) -> torch.Tensor:
    """The reference of ``EagleDrafter.propose``, recomputed from scratch without any engine
    cache: the draft's logits [k, V] fp32 of each of ``draft_tokens`` (d_1..d_k) for a sequence
    of ``token_ids`` (n tokens, positions ``0 .. n-2`` computed by the target), given the drafts
    before it.

    The target runs over ``token_ids[:n-1]``; the draft's step 0 runs causally over positions
    ``base .. n-2`` (``f_t``, ``x_{t+1}``) and the logits of its last position draft d_1; step i
    feeds the previous output and ``d_i`` through the generate path's ``MLAState``, attending over
    step 0's latents and the chain's own (the training-time test's mask for one chain)."""
    ids = torch.tensor([token_ids], device=target.lm_head.weight.device)
    n = ids.shape[1]
    hidden, bank = target.model.hidden_and_blocks(ids[:, :n - 1])
    embed, cache = target.model.embed_tokens, MLAState()
    g = draft(draft.fuse(hidden, bank)[:, base:], embed(ids[:, base + 1:]), cache)[:, -1:]
    logits = [target.lm_head(g.to(target.lm_head.weight.dtype))]
    for d in draft_tokens[:-1]:
        g = draft(g, embed(torch.tensor([[d]], device=ids.device)), cache)
        logits.append(target.lm_head(g.to(target.lm_head.weight.dtype)))
    return torch.cat(logits, dim=1)[0].float()
