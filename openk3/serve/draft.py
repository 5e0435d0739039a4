"""The draft side of speculative decoding: a drafter proposes ``k`` tokens per speculating
sequence and keeps its own state in step with the target's (``docs/speculative.md``, "Engine
integration").

Two drafters share the interface of ``DraftProposer`` (``propose``, ``rollback``, ``observe``):

* ``Drafter`` (here): a separate small openk3/Kimi model sharing the target's vocabulary;
* ``EagleDrafter`` (``openk3/serve/eagle.py``): the EAGLE-3 draft (``openk3/model/draft.py``, or
  the target's own MTP layer), which reads the target's hidden states (``observe``).

``Drafter`` owns a second ``ModelRunner`` with the target runner's layout (the same number of
MLA blocks, one KDA state slot per sequence slot), so the scheduler's block tables, state slots,
resets, prefix-cache restores and KDA checkpoint saves apply to both models unchanged: the
draft's caches hold, for every running sequence, exactly the tokens the target's hold.

Per step (``propose``): the draft computes everything the target computes this step, except that
a speculating sequence feeds only its last token; the draft's state after that token is kept
(the runner's KDA snapshot pool), then the draft decodes ``k - 1`` more positions, sampling
``d_1 .. d_k``. After verification (``rollback``) each speculating sequence's draft state is
restored to that snapshot and its accepted drafts are run again, so the draft state again covers
exactly the target's kept tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from openk3.serve.config import EngineConfig
from openk3.serve.model_runner import ModelRunner, StepResult, _cdiv
from openk3.serve.sampler import SamplingParams, sample
from openk3.serve.scheduler import SchedulerOutput
from openk3.serve.sequence import Sequence
from openk3.serve.speculative import sampling_probs


class DraftProposer:
    """What the engine asks of a draft, once per step (``LLMEngine.step``):

    1. ``propose(out, params, generators)`` after ``Scheduler.step``, before the target runs:
       the drafts of the speculating sequences (``out.num_draft_tokens``) and the draft's
       probabilities they were drawn from;
    2. ``rollback(kept)`` after speculative sampling, before ``Scheduler.postprocess``;
    3. ``observe(out, result)`` after ``Scheduler.postprocess``: the target's output of the step
       (its features when ``feature_blocks`` is set) and every sequence's kept tokens.

    ``feature_blocks``: the target's AttnRes bank entries the draft reads (``ModelRunner.
    feature_blocks``); None for a draft that needs nothing of the target's forward."""

    feature_blocks: tuple[int, int] | None = None

    def propose(self, out: SchedulerOutput, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
        raise NotImplementedError

    def rollback(self, kept: list[tuple[Sequence, list[int]]]) -> None:
        """(sequence, its accepted drafts) for every verified sequence; nothing by default."""

    def observe(self, out: SchedulerOutput, result: StepResult) -> None:
        """The step's target output, after postprocess; nothing by default."""


def sample_drafts(logits: torch.Tensor, ks: list[int], params: list[SamplingParams],
                  generators: list[torch.Generator | None], advance) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafting loop of both drafters: draw d_1 of every chain from ``logits`` [B, V], then
    ``advance(i, active, more, drawn)`` returns the logits [len(active), V] of d_{i+2} for the
    chains ``active`` still drafting (``more``: their rows in the previous ``active``, ``drawn``
    the previous draws). Chain b makes ``ks[b]`` draws.

    Returns (tokens [B, K] int64, probabilities [B, K, V] fp32: the distributions, after
    ``sampling_probs``, the tokens were drawn from), K = max(ks); row b beyond ``ks[b]`` is -1 / 0."""
    B, K, V = len(ks), max(ks), logits.shape[-1]
    tokens = torch.full((B, K), -1, dtype=torch.long, device=logits.device)
    probs = torch.zeros(B, K, V, device=logits.device)
    active = list(range(B))  # rows still drafting; ``logits`` follows them
    for i in range(K):
        p, g = [params[b] for b in active], [generators[b] for b in active]
        drawn, _ = sample(logits, p, g)
        idx = torch.tensor(active, device=logits.device)
        tokens[idx, i] = drawn
        probs[idx, i] = sampling_probs(logits[:, None], p)[:, 0]
        more = [j for j, b in enumerate(active) if ks[b] > i + 1]
        if not more:
            break
        active = [active[j] for j in more]
        logits = advance(i, active, more, drawn)
    return tokens, probs


class Drafter(DraftProposer):
    """A draft model with its own caches. ``num_blocks`` / ``max_model_len``: the target
    runner's, so that both runners share the scheduler's block layout."""

    def __init__(self, model, config: EngineConfig, num_blocks: int, max_model_len: int):
        # eager: the draft decodes a few rows at a time, with host-side control between them
        self.runner = ModelRunner(model, dataclasses.replace(
            config, num_blocks=num_blocks, max_model_len=max_model_len, cuda_graphs=False))

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run the step's work on the draft and draft for the speculating sequences (those in
        ``out.num_draft_tokens``, in ``out.scheduled`` order; ``params`` / ``generators`` theirs).

        Returns (draft tokens [B, K] int64, the draft's probabilities [B, K, V] fp32: the
        distributions, after ``sampling_probs``, that the tokens were drawn from), K the step's
        largest ``k``; row b beyond its own ``k_b`` is -1 / 0. None when nobody speculates. A
        seeded request's generator makes ``k_b`` draws (``sampler.sample``), whatever the batch.
        """
        runner = self.runner
        runner._before_forward(out)
        segments, rows, seqs, T = [], [], [], 0
        for seq, n in out.scheduled:
            if seq.request_id in out.num_draft_tokens:  # only the last token: the drafts come next
                segments.append((seq.state_slot, seq.num_tokens - 1, seq.token_ids[-1:]))
                seqs.append(seq)
                rows.append(T)
                T += 1
            else:
                end = seq.num_computed_tokens
                segments.append((seq.state_slot, end - n, seq.token_ids[end - n:end]))
                T += n
        hidden, rows, _, _ = runner._forward_segments(segments, rows)
        runner._after_forward(out)
        if not seqs:
            return None
        runner.snapshot_kda([s.state_slot for s in seqs])
        ks = [out.num_draft_tokens[s.request_id] for s in seqs]

        def advance(i: int, active: list[int], more: list[int], drawn: torch.Tensor) -> torch.Tensor:
            # d_{i+1} sits at position num_tokens + i: the context then holds num_tokens + i + 1
            ctx = [seqs[b].num_tokens + i + 1 for b in active]
            inputs = torch.stack([drawn[more], torch.tensor(ctx, device=runner.device),
                                  torch.tensor([seqs[b].state_slot for b in active], device=runner.device)])
            return runner._decode_forward(inputs, _cdiv(max(ctx), runner.block_size))

        return sample_drafts(runner.model.lm_head(hidden[rows]).float(), ks, params, generators, advance)

    @torch.inference_mode()
    def rollback(self, kept: list[tuple[Sequence, list[int]]]) -> None:
        """(sequence, its accepted drafts) for every verified sequence, before
        ``Scheduler.postprocess``: back to the snapshot after the last token, then the accepted
        drafts again (from position ``num_tokens``)."""
        self.runner.rollback([(seq.state_slot, seq.num_tokens, accepted) for seq, accepted in kept])
