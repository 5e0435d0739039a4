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

Per step (``propose``): the draft computes everything the target computes this step except the
speculating sequences' tokens; it keeps their KDA states (a snapshot pool), then decodes their
last token and ``k - 1`` drafts one position at a time, sampling ``d_1 .. d_k`` on the device
(the runner's decode pass, a CUDA graph per batch bucket; rows that have made their ``k`` draws
become padding rows). After verification (``rollback``) each speculating sequence's draft states
go back to the snapshot and the draft runs the target's verify step over the same last token
and drafts (``VerifyStep``: one fixed-shape pass, then the commit of the accepted positions), so
its caches again hold exactly the target's kept tokens.

Neither drafter reads the device while drafting: ``Drafter``'s loop (``sample_drafts``) and the
EAGLE draft's chain (one pass) draw every draft on the device, and their inputs travel to the
device once per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from openk3.serve.config import EngineConfig
from openk3.serve.graphs import bucket
from openk3.serve.model_runner import ModelRunner, StepResult
from openk3.serve.paged_views import KDAPool
from openk3.serve.sampler import SamplingParams, host_to_device, sample
from openk3.serve.scheduler import SchedulerOutput
from openk3.serve.sequence import Sequence


class DraftProposer:
    """What the engine asks of a draft, once per step (``LLMEngine.step``):

    1. ``propose(out, params, generators)`` after ``Scheduler.step``, before the target runs:
       the drafts of the speculating sequences (``out.num_draft_tokens``) and the draft's
       probabilities they were drawn from;
    2. ``rollback(result, num_kept, tokens)`` after speculative sampling, before the host reads
       its results (everything it needs is on the device): ``num_kept`` [n] the positions each
       verified sequence keeps (its last token and its accepted drafts), ``tokens`` [n, K + 1]
       the tokens it emits (row b's first ``num_kept[b]``: the accepted drafts, then the
       correction or bonus token, so ``tokens[b, j]`` follows kept position j);
    3. ``observe(out, result)`` after ``Scheduler.postprocess``: the target's output of the step
       (its features when ``feature_blocks`` is set) and every sequence's kept tokens.

    ``num_kept`` is the device's ``num_accepted + 1`` (a run cut at a stop token ends its
    sequence in this step), or, when a request of the batch has stop strings, the lengths of the
    runs as the host cut them.

    ``feature_blocks``: the target's AttnRes bank entries the draft reads (``ModelRunner.
    feature_blocks``); None for a draft that needs nothing of the target's forward."""

    feature_blocks: tuple[int, int] | None = None

    def propose(self, out: SchedulerOutput, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
        raise NotImplementedError

    def rollback(self, result: StepResult, num_kept: torch.Tensor, tokens: torch.Tensor) -> None:
        """The verified sequences' kept positions (device tensors); nothing by default."""

    def observe(self, out: SchedulerOutput, result: StepResult) -> None:
        """The step's target output, after postprocess; nothing by default."""

    def capture_graphs(self, sizes: list[int], progress: Callable[[str, int], None] | None = None) -> None:
        """Capture the draft's CUDA graphs for the batch buckets ``sizes`` now rather than on first
        use (``LLMEngine.capture_graphs``); nothing for a draft without graphs."""


def sample_drafts(logits: torch.Tensor, ks: list[int], K: int, params: list[SamplingParams],
                  generators: list[torch.Generator | None], advance) -> tuple[torch.Tensor, torch.Tensor]:
    """``Drafter``'s drafting loop, without reading the device: draw d_1 of every chain
    from ``logits`` [n, V], then ``advance(i, drawn)`` (``drawn`` [n]: the draws d_{i+1}) returns
    the logits [n, V] of d_{i+2} of every chain (fixed shapes: a chain that has made its draws is
    computed on, and ignored). Chain b makes ``ks[b]`` <= K draws; a seeded request's generator
    makes exactly those (``sampler.sample``), whatever the batch.

    Returns (tokens [n, K] int64, probabilities [n, K, V] fp32: the distributions, after
    ``sampling_probs``, the tokens were drawn from); row b beyond ``ks[b]`` is -1 / 0. A batch of
    greedy requests draws argmaxes and returns None for the probabilities (one-hot, never read:
    ``speculative.greedy_verify`` verifies from the target's logits alone)."""
    n, V = logits.shape
    tokens = torch.full((n, K), -1, dtype=torch.long, device=logits.device)
    drafting = host_to_device(ks, logits.device)  # [n]
    steps = max(ks)
    greedy = all(p.temperature == 0 for p in params)
    probs = None if greedy else torch.zeros(n, K, V, device=logits.device)
    for i in range(steps):
        live = drafting > i
        if greedy:
            drawn = logits.argmax(-1)
        else:
            drawn, _, q = sample(logits, params, [g if k > i else None for g, k in zip(generators, ks)],
                                 distribution=True)
            probs[:, i] = q * live[:, None]
        tokens[:, i] = torch.where(live, drawn, -1)
        if i + 1 < steps:
            logits = advance(i, drawn)
    return tokens, probs


class Drafter(DraftProposer):
    """A draft model with its own caches. ``num_blocks`` / ``max_model_len``: the target
    runner's, so that both runners share the scheduler's block layout."""

    def __init__(self, model, config: EngineConfig, num_blocks: int, max_model_len: int):
        self.runner = runner = ModelRunner(model, dataclasses.replace(
            config, num_blocks=num_blocks, max_model_len=max_model_len))
        self.K = config.num_speculative_tokens
        # the speculating sequences' KDA states from before their drafts
        self.snapshots = KDAPool(runner.cfg, len(runner.kda_layers), config.max_num_seqs + 1,
                                 runner.device, runner.dtype)
        self._proposal: tuple[list[Sequence], list[int], torch.Tensor, torch.Tensor] | None = None

    def capture_graphs(self, sizes: list[int], progress: Callable[[str, int], None] | None = None) -> None:
        """The draft runner's own decode, prefill and verify graphs (``ModelRunner.capture_graphs``;
        its buckets are the target's, ``sizes``)."""
        self.runner.capture_graphs(None if progress is None else lambda kind, size: progress(f"draft {kind}", size))

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run the step's work on the draft and draft for the speculating sequences (those in
        ``out.num_draft_tokens``, in ``out.scheduled`` order; ``params`` / ``generators`` theirs).

        Returns (draft tokens [n, K] int64, the draft's probabilities [n, K, V] fp32: the
        distributions, after ``sampling_probs``, that the tokens were drawn from), K =
        ``num_speculative_tokens``; row b beyond its own ``k_b`` is -1 / 0. None when nobody
        speculates. A seeded request's generator makes ``k_b`` draws (``sampler.sample``),
        whatever the batch.
        """
        runner = self.runner
        runner._before_forward(out)
        runner.advance(out)
        runner._after_forward(out)
        seqs = [s for s, _ in out.scheduled if s.request_id in out.num_draft_tokens]
        if not seqs:
            return None
        n, ks = len(seqs), [out.num_draft_tokens[s.request_id] for s in seqs]
        B = bucket(n) if runner.use_graphs else n
        pad = B - n
        # per row: the context with its last token, state slot, drafts, last token (padding: none)
        ctx, slots, ks_d, last = runner.host_tensor(
            [s.num_tokens for s in seqs] + [1] * pad, [s.state_slot for s in seqs] + [runner.scratch_slot] * pad,
            ks + [0] * pad, [s.token_ids[-1] for s in seqs] + [0] * pad).to(runner.device, non_blocking=True)
        self.snapshots.copy_(slots[:n], runner.kda_state, slots[:n])
        max_context = max(s.num_tokens for s in seqs) + self.K

        def decode(j: int, tokens: torch.Tensor) -> torch.Tensor:
            """Position j of every chain (the last token, then d_j); rows done drafting pad."""
            feeds = j < ks_d
            inputs = torch.stack([torch.where(feeds, tokens, 0), torch.where(feeds, ctx + j, 1),
                                  torch.where(feeds, slots, runner.scratch_slot)])
            return runner.decode_rows(inputs, max_context)[0][:n]

        tokens, probs = sample_drafts(decode(0, last), ks, self.K, params, generators,
                                      lambda i, drawn: decode(i + 1, F.pad(drawn, (0, pad))))
        self._proposal = (seqs, ks, slots[:n], tokens)
        return tokens, probs

    @torch.inference_mode()
    def rollback(self, result: StepResult, num_kept: torch.Tensor, tokens: torch.Tensor) -> None:
        """The snapshot back, then the verify step over the last token and the drafts,
        committing the kept positions."""
        seqs, ks, slots, drafts = self._proposal
        self._proposal = None
        if result.verified != seqs:
            raise RuntimeError("Drafter.rollback: the verified sequences differ from the proposal's")
        runner = self.runner
        runner.kda_state.copy_(slots, self.snapshots, slots)
        runner.verifier.forward(seqs, ks, drafts)
        runner.verifier.commit(num_kept)
