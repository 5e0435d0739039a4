"""The EAGLE-3 draft in the serving engine: ``EagleDrafter`` (``docs/speculative.md``, "Engine
integration: the EAGLE-3 draft") and its reference ``eagle_propose_ref``.

The draft (``openk3/model/draft.py``: fusion ``fc`` + one ``MTPLayer``, the target's embedding and
head) at position t reads the target's features at t and the next token::

    f_t = fc( cat(bank[lo]_t, bank[mid]_t, h_t) )         from the target's forward of position t
    g_t = draft(f_t, embed(x_{t+1}))                       q = softmax(lm_head(g_t)) drafts x_{t+2}

so position t of the draft can run once the target has computed t *and* x_{t+1} is known. The
engine calls ``observe`` after ``Scheduler.postprocess``, when both hold for every position the
target kept this step (prompt chunks, plain decodes, the kept part of a verify segment: the last
token, the accepted drafts, and the corrected or bonus token as the next input): the draft runs
over them in one packed pass, writing their MLA latents into its cache and keeping ``g`` of
each sequence's last kept position, ``n - 2`` for a sequence of ``n`` tokens, whose head gives
the distribution of ``d_1 = x_n``. ``propose`` then needs no pass for ``d_1``; draft ``d_{i+1}``
comes from ``draft(g_prev, embed(d_i))`` (EAGLE's training-time test: the draft's own output
replaces f), attending over the real positions and the chain's earlier speculative latents.

Cache: the draft's one MLA layer keeps its latents in a paged tensor addressed through the
*target's* block tables (rows ``block * block_size + offset``, as a target MLA layer), so it costs
one MLA layer of memory and needs no allocator of its own; speculative latents go to ``K - 1``
scratch rows per state slot after the pages and are never kept (``observe`` writes the real
latents of accepted positions at their pages). A sequence's draft attends over positions
``[base, ..)``: ``base`` is where the target started computing it at admission, 0 unless a
prefix-cache hit skipped the target's forward (and so the features) of the cached positions.
Acceptance may then drop for that request; the output distribution does not change.
"""

from __future__ import annotations

import itertools

import torch

from openk3.model.cache import MLAState
from openk3.model.draft import Eagle3Draft, target_fingerprint
from openk3.model.fuse import fuse_projections
from openk3.model.model import _keep_fp32
from openk3.serve.config import EngineConfig
from openk3.serve.draft import DraftProposer, sample_drafts
from openk3.serve.model_runner import ModelRunner, StepResult
from openk3.serve.paged_views import PagedMLAView, PrefillBatch
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
        draft.to(device=runner.device, dtype=runner.dtype)
        _keep_fp32(draft)  # router weights and biases
        self.draft = draft.eval().requires_grad_(False)
        fuse_projections(draft.layer)  # not the draft itself: its ``fuse`` is the feature fusion
        self.runner, self.feature_blocks = runner, tuple(draft.cfg.fused_blocks)
        self.embed, self.lm_head = runner.model.model.embed_tokens, runner.model.lm_head
        attn = self.draft.layer.self_attn
        slots = config.max_num_seqs + 1  # the runner's state slots, scratch included
        self.spec_rows = max(1, config.num_speculative_tokens - 1)  # speculative latents per slot
        self.spec_offset = (runner.num_blocks + 1) * runner.block_size
        self.cache = torch.zeros(self.spec_offset + slots * self.spec_rows, attn.rank + attn.rope,
                                 device=runner.device, dtype=runner.dtype)
        self.base, self.length = [0] * slots, [0] * slots
        self.last = torch.zeros(slots, draft.cfg.hidden_size, device=runner.device, dtype=runner.dtype)

    def cache_bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    def _batch(self, segments: list[tuple[int, int, int, int, int]]) -> PrefillBatch:
        """The attention batch of one draft pass over ``segments`` (state slot, first key
        position, end of the real keys, speculative keys, queries): a segment's keys are its real
        positions ``[start, end)`` (pages of the target's block table) followed by its slot's
        first ``spec`` speculative rows, and its queries are its last ``queries`` keys, whose
        rows receive the new latents."""
        runner, bs = self.runner, self.runner.block_size
        slots, starts, ends, spec, new = (list(c) for c in zip(*segments))
        real = [e - s for s, e in zip(starts, ends)]
        num_keys = [r + p for r, p in zip(real, spec)]
        cu_k, cu_q = [0, *itertools.accumulate(num_keys)], [0, *itertools.accumulate(new)]
        slots_d, starts_d, real_d, new_d, cu_k_d, cu_q_d = runner._upload(slots, starts, real, new, cu_k, cu_q)
        dev, K, T = runner.device, cu_k[-1], cu_q[-1]
        seg = torch.arange(len(segments), device=dev)
        k_seg = torch.repeat_interleave(seg, cu_k_d.diff(), output_size=K)
        j = torch.arange(K, device=dev) - cu_k_d[k_seg]  # key index within its segment
        pos = starts_d[k_seg] + j
        table = runner.block_tables.index_select(0, slots_d).long()  # [N, max_blocks]
        paged = table[k_seg, (pos // bs).clamp(max=table.shape[1] - 1)] * bs + pos % bs
        scratch = self.spec_offset + slots_d[k_seg] * self.spec_rows + (j - real_d[k_seg])
        key_rows = torch.where(j < real_d[k_seg], paged, scratch)
        q_seg = torch.repeat_interleave(seg, new_d, output_size=T)
        q_key = cu_k_d[q_seg + 1] - new_d[q_seg] + torch.arange(T, device=dev) - cu_q_d[q_seg]
        return PrefillBatch(key_rows[q_key], key_rows, cu_q_d, cu_k_d, torch.tensor(cu_q), torch.tensor(cu_k))

    def _forward(self, states: torch.Tensor, next_ids: torch.Tensor, batch: PrefillBatch) -> torch.Tensor:
        """One packed draft pass: states [T, d] (f or the previous g), next_ids [T] -> g [T, d]."""
        return self.draft(states[None], self.embed(next_ids)[None], PagedMLAView(self.cache, batch))[0]

    @torch.inference_mode()
    def observe(self, out: SchedulerOutput, result: StepResult) -> None:
        """Run the draft over the positions the target kept this step (``result.features``),
        after ``Scheduler.postprocess`` (so every kept position's next token is known)."""
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
            kept = min(first + n, seq.num_computed_tokens) - first  # a verify segment's accepted part
            rows += range(r0, r0 + kept)
            next_ids += seq.token_ids[first + 1:first + kept + 1]
            segments.append((slot, self.base[slot], first + kept, 0, kept))
            slots.append(slot)
            self.length[slot] = first + kept
        if not segments:
            return
        rows_d, ids_d, last_d, slots_d = self.runner._upload(
            rows, next_ids, list(itertools.accumulate(s[4] for s in segments)), slots)
        states = self.draft.fc(result.features.index_select(0, rows_d))  # f [T, d]
        g = self._forward(states, ids_d, self._batch(segments))
        self.last.index_copy_(0, slots_d, g.index_select(0, last_d - 1))

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Drafts of the speculating sequences, as ``Drafter.propose`` returns them: (tokens [B, K]
        int64, probabilities [B, K, V] fp32), row b beyond its own ``k_b`` -1 / 0; None when
        nobody speculates. ``d_1`` comes from the kept output ``last``; each later draft from one
        draft pass of the rows still drafting."""
        seqs = [s for s, _ in out.scheduled if s.request_id in out.num_draft_tokens]
        if not seqs:
            return None
        for s in seqs:
            if self.length[s.state_slot] != s.num_tokens - 1:
                raise RuntimeError(f"EAGLE draft of request {s.request_id!r}: its cache ends at position "
                                   f"{self.length[s.state_slot]}, the sequence has {s.num_tokens} tokens")
        runner = self.runner
        ks = [out.num_draft_tokens[s.request_id] for s in seqs]
        (slots_d,) = runner._upload([s.state_slot for s in seqs])
        state = self.last.index_select(0, slots_d)  # g at position num_tokens - 2: drafts x_{num_tokens}

        def advance(i: int, active: list[int], more: list[int], drawn: torch.Tensor) -> torch.Tensor:
            nonlocal state  # follows the rows still drafting
            sel = torch.tensor(more, device=runner.device)
            # step i + 1 of each chain: keys = its real positions, then its speculative rows 0..i
            # (row i new), as the training-time test's attention
            batch = self._batch([(seqs[b].state_slot, self.base[seqs[b].state_slot], seqs[b].num_tokens - 1,
                                  i + 1, 1) for b in active])
            state = self._forward(state[sel], drawn[sel], batch)
            return self.lm_head(state).float()

        return sample_drafts(self.lm_head(state).float(), ks, params, generators, advance)


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
