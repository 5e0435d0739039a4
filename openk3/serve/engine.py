"""The engine loop: requests in, scheduler step, model runner, sampler, text out.

``LLMEngine`` is synchronous and single-threaded: ``add_request`` / ``abort`` / ``step``.
``AsyncEngine`` runs it on a background thread for the HTTP server; every request gets an async
iterator of ``RequestOutput`` and is aborted (everything it held freed) when its consumer stops
listening. ``openk3.LLM`` (``openk3/serve/llm.py``) is the offline API over the same engine.

Text: output ids are decoded incrementally (each step decodes only the last few ids, the
window since the previous complete character, so long outputs cost O(n), not O(n^2)); a trailing
U+FFFD (an incomplete UTF-8 sequence) waits until the next token completes it. Stop strings are searched in the generated text
(each step only where one may end: the new text and the ``max(len(stop)) - 1`` characters before it);
the text is cut before the stop string and the request finishes with ``finish_reason="stop"``.
While streaming, the last ``max(len(stop)) - 1`` characters are held back, since they may
turn out to begin a stop string.

Speculative decoding (``EngineConfig.num_speculative_tokens`` K > 0, a draft: a separate model,
an EAGLE-3 draft directory or the target's MTP layer): a decode step may emit several tokens; ``docs/speculative.md`` ("Engine integration") describes the
step. Stop strings, stop tokens and max_tokens apply token by token within the emitted run, so
the outputs are those of plain decoding with the same sampling.

Log-probabilities are those of the model's own next-token distribution (``log_softmax`` of the
logits, before temperature and filtering), as OpenAI reports them.

Images (a model with a vision tower): ``add_request(prompt, params, images=[...])``; the images
are decoded and packed here (``prepare_images``: where they go in the prompt, their content
digests), the scheduler and the block manager see only the spans of their positions
(``Sequence.image_spans``), and the model runner holds the pixels and runs the tower at prefill.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import torch

from openk3.model.draft import Eagle3Draft
from openk3.serve.block_manager import BlockManager
from openk3.serve.config import EngineConfig
from openk3.serve.draft import Drafter, DraftProposer
from openk3.serve.eagle import EagleDrafter
from openk3.serve.inputs import Checked, RequestInputs
from openk3.serve.model_runner import ModelRunner, PromptLogprobs, StepResult
from openk3.serve.multimodal import ImageLike, MultiModalInput
from openk3.serve.sampler import (
    InvalidRequest,
    SamplingParams,
    host_to_device,
    make_generator,
    sample,
    token_logprobs,
)
from openk3.serve.scheduler import Scheduler, SchedulerOutput
from openk3.serve.sequence import Sequence, SequenceStatus
from openk3.serve.speculative import greedy_verify, sampling_probs, speculative_sample


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the ``logprobs`` most likely tokens and their log-probabilities


@dataclass
class RequestOutput:
    """A request's state after a step. ``text`` / ``token_ids`` are everything generated so far
    (stop strings cut); ``delta_*`` is what is new since the previous output of this request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    logprobs: list[Logprob] | None
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort"
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (it
    # has no context); complete once the prompt is computed, i.e. from the first token on
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    cache_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_tokens_saved: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (after prefix hits)
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    step_seconds: float = 0.0  # wall time inside steps (the host's and the GPU's)
    prefill_steps: int = 0  # steps that computed prompt tokens (with or without decodes)
    prefill_step_seconds: float = 0.0
    # speculative decoding: sequence-steps verified, draft tokens proposed, and accepted
    spec_verifications: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_tokens(self) -> float:
        """Accepted draft tokens per verified sequence-step (each also emits one more token)."""
        return self.spec_accepted_tokens / self.spec_verifications if self.spec_verifications else 0.0


@dataclass
class _Request:
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    text: str = ""  # decoded output, stop strings cut
    decoded: str = ""  # decoded output up to ``read_offset`` ids
    prefix_offset: int = 0  # decode window: ids[prefix_offset:read_offset] are already text
    read_offset: int = 0
    sent_text: int = 0  # characters already returned as deltas
    stop_searched: int = 0  # characters of ``decoded`` already searched for stop strings
    hold: int = 0  # characters held back while streaming: they may begin a stop string
    sent_tokens: int = 0
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    finish_reason: str | None = None


@dataclass
class _Tokens:
    """One step's sampled tokens (or a verify step's results): ``device`` [n] and their copy to
    the host (pinned on CUDA), queued behind the sampling with an event, so that reading them
    waits for this step only, not for work queued after (an overlapped step, a verify step's
    rollback). ``rows``: the rows of ``host`` to read (an adopted step whose batch lost
    sequences), else all."""

    device: torch.Tensor
    host: torch.Tensor
    event: torch.cuda.Event | None
    rows: list[int] | None = None

    @classmethod
    def copy_of(cls, tokens: torch.Tensor) -> _Tokens:
        cuda = tokens.is_cuda
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return cls(tokens, host, event)

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        values = self.host.tolist()
        return values if self.rows is None else [values[i] for i in self.rows]


@dataclass
class _Ahead:
    """A decode step launched before the previous step's tokens reached the host: its
    sequences (rows, in order), logits and sampled tokens."""

    seqs: list[Sequence]
    logits: torch.Tensor
    tokens: _Tokens

    def adopt(self, out: SchedulerOutput) -> tuple[StepResult, _Tokens]:
        """The result of ``out``, the scheduler's step for this one (``admit=False``): its
        sequences are these, less any that finished or were aborted meanwhile, one token each,
        with no instruction for the runner (the launch checked that none would be due)."""
        row = {s.request_id: i for i, s in enumerate(self.seqs)}
        rows = [row.get(s.request_id) for s, _ in out.scheduled]
        scheduled = {s.request_id for s, _ in out.scheduled}
        if (None in rows or any(n != 1 for _, n in out.scheduled) or out.block_table_updates
                or out.block_copies or out.kda_restores or out.kda_resets or out.kda_saves
                or out.preempted_ids or out.num_draft_tokens
                or any(s.status is SequenceStatus.RUNNING and s.request_id not in scheduled for s in self.seqs)):
            raise RuntimeError("overlapped decoding: the scheduler's step differs from the one launched "
                               "ahead (an engine bug); the launch's checks must exclude this")
        sampled = [s for s, _ in out.scheduled]
        if rows == list(range(len(self.seqs))):
            return StepResult(self.logits, sampled=sampled), self.tokens
        index = torch.tensor(rows, device=self.logits.device)
        t = self.tokens
        return (StepResult(self.logits[index], sampled=sampled),
                _Tokens(t.device[index], t.host, t.event, [i if t.rows is None else t.rows[i] for i in rows]))


class LLMEngine:
    """``draft_model``: the draft for speculative decoding as a model object, a
    ``KimiForCausalLM`` (a separate draft model, ``Drafter``) or an ``Eagle3Draft`` of this target
    (``EagleDrafter``); else ``config.draft`` is loaded when ``config.num_speculative_tokens`` > 0."""

    def __init__(self, model, tokenizer, config: EngineConfig | None = None,
                 eos_token_ids: tuple[int, ...] | None = None, model_name: str = "openk3",
                 draft_model=None):
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.config = config = config or EngineConfig()
        cfg = model.cfg
        self.eos_token_ids = tuple(eos_token_ids if eos_token_ids is not None
                                   else ([cfg.eos_token_id] if cfg.eos_token_id is not None else []))
        # The runner sizes the cache for this model and machine; the policy objects get its sizes.
        self.runner = ModelRunner(model, config)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(config, self.runner.num_blocks, num_state_slots=config.max_num_seqs)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.drafter = self._make_drafter(draft_model)
        self.inputs = RequestInputs(tokenizer, cfg, config, self.max_model_len,
                                    speculative=self.drafter is not None)
        if self.drafter is not None:
            self.runner.feature_blocks = self.drafter.feature_blocks
        self.requests: dict[str, _Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._ahead: _Ahead | None = None  # a decode step in flight (overlapped decoding)
        self.overlap_decode = (config.overlap_decode if config.overlap_decode is not None
                               else self.runner.device.type == "cuda")

    def _make_drafter(self, draft_model) -> DraftProposer | None:
        config, K = self.config, self.config.num_speculative_tokens
        if K == 0:
            if draft_model is not None or config.draft is not None:
                raise ValueError("a draft model is given but EngineConfig.num_speculative_tokens=0: "
                                 "set it to the number of draft tokens per step")
            return None
        if draft_model is None:
            if config.draft is None:
                raise ValueError(f"EngineConfig.num_speculative_tokens={K} needs a draft model: "
                                 f"EngineConfig.draft (a model directory) or LLMEngine(draft_model=...)")
            from openk3.runtime import load_draft_model
            draft_model = load_draft_model(config.draft, self.runner.device, self.runner.dtype, target=self.model)
        if isinstance(draft_model, Eagle3Draft):
            return EagleDrafter(draft_model, self.runner, config)
        if draft_model.cfg.vocab_size != self.model.cfg.vocab_size:
            raise ValueError(f"draft model: vocab_size {draft_model.cfg.vocab_size} differs from the target's "
                             f"{self.model.cfg.vocab_size}; the draft must share the target's tokenizer")
        return Drafter(draft_model, config, self.runner.num_blocks, self.max_model_len)

    # Requests.

    def capture_graphs(self, progress=None) -> None:
        """Capture the runner's CUDA graphs now rather than when a request first needs each
        (``ModelRunner.capture_graphs``; a no-op without graphs), and the draft's for every decode
        bucket (``DraftProposer.capture_graphs``): ``openk3 serve`` does before it listens."""
        decode = self.runner.graph_sizes()[0]  # before a failed capture could turn the runner's off
        self.runner.capture_graphs(progress)
        if self.drafter is not None:
            self.drafter.capture_graphs(decode, progress)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.inputs.tokenize(prompt)

    def prepare_images(self, prompt: str | list[int], images: list[ImageLike]) -> tuple[list[int], MultiModalInput]:
        """``RequestInputs.prepare_images``: the prompt's ids with its images placed, and the
        images decoded and packed. Touches no engine state."""
        return self.inputs.prepare_images(prompt, images)

    def validate(self, prompt: str | list[int], params: SamplingParams,
                 images: MultiModalInput | None = None) -> list[int]:
        """Token ids of ``prompt``; raises ``InvalidRequest`` naming the parameter at fault
        (``RequestInputs.validate``). Touches no engine state."""
        return self.inputs.validate(prompt, params, images)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None,
                    images: list[ImageLike] | MultiModalInput | None = None) -> str:
        """Queue a request; returns its id. Raises ``InvalidRequest`` for bad input.

        ``images``: PIL images, file paths or encoded bytes, placed as ``prepare_images`` says;
        or its ``MultiModalInput``, with ``prompt`` the ids it returned."""
        params = params or SamplingParams()
        if images is not None and not isinstance(images, MultiModalInput):
            prompt, images = self.prepare_images(prompt, images)
        return self._add(*self.inputs.checked(prompt, params, images), params, request_id, images)

    def _add(self, ids: list[int], packed: array, params: SamplingParams, request_id: str | None,
             images: MultiModalInput | None) -> str:
        """``add_request`` of a prompt ``RequestInputs.checked`` returned (ids, packed)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidRequest("request_id", f"{rid!r} already exists")
        # max_tokens=0 still samples one token internally (the prompt's last logits are computed
        # anyway); _output reports none
        seq = Sequence(rid, ids, max(1, params.max_tokens), self.eos_token_ids + tuple(params.stop_token_ids),
                       images.spans if images is not None else (), prompt_array=packed)
        seq.wants_prompt_logprobs = params.prompt_logprobs is not None
        gen = make_generator(params.seed, self.runner.device)
        self.scheduler.add_request(seq)
        if images is not None:
            self.runner.add_images(rid, images.images)
        self.requests[rid] = _Request(
            seq, params, gen, logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] * len(ids) if seq.wants_prompt_logprobs else None,
            hold=max(map(len, params.stop), default=1) - 1)
        return rid

    def abort(self, request_id: str) -> bool:
        """Cancel a request; everything it holds is freed. False if unknown or finished."""
        self.requests.pop(request_id, None)
        self.runner.drop_images(request_id)
        return self.scheduler.abort(request_id)

    def abort_all(self) -> list[str]:
        """Cancel every request (a step failed: the asyncio engines fail them all and keep
        serving); returns their ids."""
        ids = list(self.requests)
        for rid in ids:
            self.abort(rid)
        self._ahead = None  # its sequences are gone
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy ``state_dict`` (a trainer's model's: same names, any dtype, same device or not)
        into the served model in place, and empty the prefix cache, whose latents and KDA
        checkpoints the old weights computed. Needs an idle engine. The copies keep every
        tensor's address, so the fused projections (views, ``openk3/model/fuse.py``) and
        captured CUDA graphs read the new weights."""
        if self.has_unfinished():
            raise RuntimeError("load_weights: requests are running; finish or abort them first")
        if self.drafter is not None:
            raise ValueError("load_weights: the speculative-decoding draft would keep the old "
                             "model's distribution; serve without one (num_speculative_tokens=0)")
        self.model.load_state_dict(state_dict)
        self.block_manager = BlockManager(self.config, self.runner.num_blocks,
                                          num_state_slots=self.config.max_num_seqs)
        self.scheduler = Scheduler(self.config, self.block_manager, self.max_model_len)

    # The loop.

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One scheduler step and forward pass; returns the requests that made progress."""
        return self._step(stream=True)

    def _step(self, stream: bool) -> list[RequestOutput]:
        """``step``; with ``stream`` False only the finished requests' outputs are built (the
        others advance their text and stop-string state all the same)."""
        start = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        out = self.scheduler.step() if ahead is None else self.scheduler.step(admit=False)
        if not out.scheduled:
            return []
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(out.preempted_ids)
        prompt_tokens = sum(n for s, n in out.scheduled if s.num_computed_tokens <= s.num_prompt_tokens)
        self.stats.prompt_tokens += prompt_tokens
        drafts = tokens = None
        if ahead is not None:  # this step ran already: its logits and tokens are on the way
            result, tokens = ahead.adopt(out)
        else:
            if self.drafter is not None:
                vreqs = [self.requests[s.request_id] for s, _ in out.scheduled if s.request_id in out.num_draft_tokens]
                drafts = self.drafter.propose(out, [r.params for r in vreqs], [r.generator for r in vreqs])
            result = self.runner.execute(out, None if drafts is None else drafts[0])
            for rid, piece in result.prompt_logprobs.items():
                self._record_prompt_logprobs(self.requests[rid], piece)
            if result.sampled:
                tokens = self._launch_sample(result.logits, result.sampled)
        seqs = result.sampled + result.verified
        if seqs:
            if tokens is not None:
                self._ahead = self._launch_ahead(out, result.sampled, tokens)
            new_token_ids = self._sampled(result, tokens) + (self._verify(result, out, *drafts) if result.verified else [])
            self.scheduler.postprocess([s.request_id for s in seqs], new_token_ids)
            self.stats.generation_tokens += sum(map(len, new_token_ids))
        if self.drafter is not None:  # every kept position's next token is known now
            self.drafter.observe(out, result)
        outputs = [self._output(self.requests[s.request_id], stream) for s in seqs]
        if self._ahead is not None and not any(s.status is SequenceStatus.RUNNING for s in self._ahead.seqs):
            self._ahead = None  # every sequence it ran for has finished: nothing to adopt
        elapsed = time.perf_counter() - start
        self.stats.step_seconds += elapsed
        if prompt_tokens:
            self.stats.prefill_steps += 1
            self.stats.prefill_step_seconds += elapsed
        return outputs if stream else [o for o in outputs if o is not None]

    def _launch_sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> _Tokens:
        """One token for each of ``seqs`` (rows of ``logits``), sampled on the device, its copy
        to the host queued."""
        reqs = [self.requests[s.request_id] for s in seqs]
        tokens, _ = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        return _Tokens.copy_of(tokens)

    def _sampled(self, result: StepResult, tokens: _Tokens | None) -> list[list[int]]:
        """The tokens of ``result.sampled`` (the step's one wait for the device), with their
        log-probabilities where asked for."""
        if not result.sampled:
            return []
        runs = [[t] for t in tokens.tolist()]
        self._record_logprobs([self.requests[s.request_id] for s in result.sampled], result.logits, runs)
        return runs

    def _launch_ahead(self, out: SchedulerOutput, seqs: list[Sequence], tokens: _Tokens) -> _Ahead | None:
        """Overlapped decoding (``EngineConfig.overlap_decode``): when the next step can only be
        one more token for each of ``seqs`` (this step's sampled sequences, every running one;
        nothing waits) and needs nothing but the decode pass (its token fits the sequence's
        blocks, no KDA checkpoint is due, nobody asked for log-probabilities), launch it now,
        its input tokens read on the device, and sample it. The next ``step`` adopts it: the
        scheduler schedules exactly these sequences (less any that finish now), and the outputs
        are those of plain stepping."""
        sched, bm = self.scheduler, self.block_manager
        if (not self.overlap_decode or self.drafter is not None or out.num_draft_tokens
                or len(out.scheduled) != len(seqs) or sched.num_waiting or len(sched.running) != len(seqs)
                or len(seqs) > self.config.max_num_batched_tokens):
            return None
        cap = bm.block_size
        for s in seqs:
            r = self.requests.get(s.request_id)
            L = len(s.token_ids)  # the position of this step's token
            if (r is None or r.logprobs is not None or s.wants_prompt_logprobs
                    or L + 1 > len(s.block_table) * cap or bm.next_kda_checkpoint_boundary(s, L) == L + 1):
                return None
        if all(len(s.token_ids) + 1 >= s.num_prompt_tokens + s.max_tokens for s in seqs):
            return None  # this step's token ends every sequence
        logits = self.runner.decode_ahead(seqs, tokens.device)
        return _Ahead(seqs, logits, self._launch_sample(logits, seqs))

    def _record_logprobs(self, reqs: list[_Request], logits: torch.Tensor, runs: list[list[int]]) -> None:
        """Log-probabilities of each request's new tokens ``runs[i]``; ``logits`` [B, V] (one
        token each) or [B, P, V] (row i's first ``len(runs[i])`` positions)."""
        k = max((r.params.logprobs for r in reqs if r.logprobs is not None), default=None)
        if k is None:
            return
        tokens = torch.tensor([t for run in runs for t in run], device=logits.device)
        if logits.dim() == 3:
            picked = [(i, j) for i, run in enumerate(runs) for j in range(len(run))]
            i, j = torch.tensor(picked, device=logits.device).unbind(1)
            logits = logits[i, j]
        rows = iter(token_logprobs(logits, tokens, k).tolist())  # one host copy of log-probs
        for r, run in zip(reqs, runs):
            if r.logprobs is None:
                for _ in run:
                    next(rows)
                continue
            n = r.params.logprobs
            for token_id in run:
                row = next(rows)
                r.logprobs.append(Logprob(token_id, row[0], dict(zip(map(int, row[1 + k:1 + k + n]), row[1:1 + n]))))

    def _verify(self, result: StepResult, out: SchedulerOutput, draft_tokens: torch.Tensor,
                draft_probs: torch.Tensor | None) -> list[list[int]]:
        """Speculative sampling for ``result.verified``; returns each sequence's emitted tokens
        (accepted drafts, then the correction or bonus token, cut after a stop string) and rolls
        the target's and the draft's states back to the kept tokens. ``draft_probs`` None: a
        greedy batch (its drafts argmaxes), verified from the logits alone."""
        seqs = result.verified
        reqs = [self.requests[s.request_id] for s in seqs]
        params, ks = [r.params for r in reqs], [out.num_draft_tokens[s.request_id] for s in seqs]
        if draft_probs is None:
            num_accepted, tokens = greedy_verify(draft_tokens, result.verify_logits, ks)
        else:
            target_probs = sampling_probs(result.verify_logits, params)
            num_accepted, tokens = speculative_sample(draft_tokens, draft_probs, target_probs, ks, params,
                                                      [r.generator for r in reqs])
        # the step's one device -> host copy of verify results: accepted counts, tokens, drafts
        results = _Tokens.copy_of(torch.cat([num_accepted[:, None], tokens, draft_tokens], dim=1))
        # The states follow the kept positions (the last token and the accepted drafts; the last
        # token of a run is fed next step). Queued behind the copy, the device runs them while the
        # host reads it and goes on with the step. A run cut at a stop string may leave its
        # sequence running for a step (the detokenizer holds back an incomplete character), so
        # with stop strings in the batch the kept counts are the host's, after the read.
        early = not any(p.stop for p in params)
        if early:
            self._rollback(result, num_accepted + 1, tokens)
        K = draft_tokens.shape[1]
        rows = results.tolist()
        runs = []
        for seq, r, row, k in zip(seqs, reqs, rows, ks):
            seq.draft_token_ids = row[K + 2:K + 2 + k]
            runs.append(self._cut_at_stop(r, row[1:row[0] + 2]))
        if not early:
            self._rollback(result, host_to_device([len(run) for run in runs], tokens.device), tokens)
        self.stats.spec_verifications += len(seqs)
        self.stats.spec_draft_tokens += sum(ks)
        self.stats.spec_accepted_tokens += sum(row[0] for row in rows)
        self._record_logprobs(reqs, result.verify_logits, runs)
        return runs

    def _rollback(self, result: StepResult, num_kept: torch.Tensor, tokens: torch.Tensor) -> None:
        """The target's and the draft's states after each verified sequence's first ``num_kept``
        [n] positions (device); ``tokens`` [n, K + 1] the emitted runs (``DraftProposer.rollback``)."""
        self.runner.commit_verified(num_kept)
        self.drafter.rollback(result, num_kept, tokens)

    def _cut_at_stop(self, r: _Request, run: list[int]) -> list[int]:
        """``run`` up to the first token whose text completes a stop string (or an eos), as
        plain decoding, which would stop there, would have emitted it."""
        for j, token_id in enumerate(run[:-1], 1):
            if token_id in r.seq.eos_token_ids:
                return run[:j]
            if r.params.stop:
                window = r.seq.output_token_ids[r.prefix_offset:] + run[:j]
                decode = self.tokenizer.decode
                head = decode(r.seq.output_token_ids[r.prefix_offset:r.read_offset])
                text = r.decoded + decode(window)[len(head):]
                if any(stop in text for stop in r.params.stop):
                    return run[:j]
        return run

    @staticmethod
    def _record_prompt_logprobs(r: _Request, piece: PromptLogprobs) -> None:
        k = r.params.prompt_logprobs
        token, ids, values = (piece.token.tolist(), piece.top_ids[:, :k].tolist(),
                              piece.top_values[:, :k].tolist())
        for i, (lp, top_ids, top_values) in enumerate(zip(token, ids, values)):
            pos = piece.first + i  # a recomputation after preemption overwrites, never appends
            r.prompt_logprobs[pos] = Logprob(r.seq.token_ids[pos], lp, dict(zip(top_ids, top_values)))

    def _output(self, r: _Request, stream: bool) -> RequestOutput | None:
        """The request's output after this step (unless ``stream``, None while it runs on: a
        stop string found here finishes it too); finds stop strings in the new text, and
        forgets the request once it finished."""
        seq, params = r.seq, r.params
        finished = seq.status is SequenceStatus.FINISHED
        finish = seq.finish_reason if finished else None
        # the output is token_ids[start:end]: index the sequence's list rather than copy it
        token_ids, start, end = seq.token_ids, seq.num_prompt_tokens, len(seq.token_ids)
        if params.max_tokens == 0:  # the one internal token is not reported
            end, finish = start, ("length" if finish is not None else None)
            r.logprobs = [] if r.logprobs is not None else None
        text_end = end
        if finish == "stop" and end > start and token_ids[end - 1] in seq.eos_token_ids:
            text_end = end - 1  # the stop token itself is not text
        text = self._detokenize(r, token_ids, start, text_end, final=finished)
        if params.stop:
            # the text only grows and held no stop string before: search only where one may end
            first = r.stop_searched - r.hold
            cut = min((i for i in (text.find(s, max(0, first)) for s in params.stop) if i >= 0), default=-1)
            r.stop_searched = len(text)
            if cut >= 0:
                text, finish = text[:cut], "stop"
                if not finished:
                    self.scheduler.abort(seq.request_id)  # frees its cache
        if finish is None:
            visible = text[: max(len(text) - r.hold, r.sent_text)] if r.hold else text
        else:
            visible = text
            self.requests.pop(seq.request_id, None)
            self.runner.drop_images(seq.request_id)
        r.text = visible
        delta_text, r.sent_text = visible[r.sent_text:], len(visible)
        sent_tokens, r.sent_tokens = r.sent_tokens, end - start
        if not stream and finish is None:
            return None
        return RequestOutput(seq.request_id, seq.prompt_token_ids, token_ids[start:end], visible,
                             token_ids[start + sent_tokens:end], delta_text,
                             list(r.logprobs) if r.logprobs is not None else None,
                             finish is not None, finish, seq.num_cached_tokens,
                             list(r.prompt_logprobs) if r.prompt_logprobs is not None else None)

    def _detokenize(self, r: _Request, token_ids: list[int], start: int, end: int, final: bool) -> str:
        """Text of ``token_ids[start:end]`` (the output so far), decoding only the window since
        the last complete character; an incomplete one at the end waits unless ``final``."""
        if end - start > r.read_offset:
            decode = self.tokenizer.decode
            prefix = decode(token_ids[start + r.prefix_offset:start + r.read_offset])
            new = decode(token_ids[start + r.prefix_offset:end])
            if final or (len(new) > len(prefix) and not new.endswith("\ufffd")):
                r.decoded += new[len(prefix):]
                r.prefix_offset, r.read_offset = r.read_offset, end - start
        return r.decoded

    def snapshot_stats(self) -> EngineStats:
        """A copy of the counters plus the current gauges (safe to call from another thread:
        it only reads)."""
        bm = self.block_manager.stats
        return EngineStats(**{**vars(self.stats), "num_running": self.scheduler.num_running,
                              "num_waiting": self.scheduler.num_waiting,
                              "cache_usage": self.block_manager.usage, "prefix_queries": bm.queries,
                              "prefix_hits": bm.hits, "prefix_tokens_saved": bm.saved_tokens})

    def generate(self, prompts: list[str | list[int] | dict],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run requests to completion; outputs in the order of ``prompts``. A prompt with images
        is a dict ``{"prompt": str | list[int], "images": [...]}`` (``add_request``)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif isinstance(params, (list, tuple)) and all(isinstance(sp, SamplingParams) for sp in params):
            params = list(params)
        else:
            raise TypeError(f"params must be a SamplingParams or a list of them, one per prompt; "
                            f"got {type(params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for p, sp in zip(prompts, params):
                if isinstance(p, dict):
                    unknown = set(p) - {"prompt", "images"}
                    if unknown or "prompt" not in p:
                        raise InvalidRequest("prompt", f"a dict prompt has the keys 'prompt' and 'images', "
                                                       f"got {sorted(p)}")
                    ids.append(self.add_request(p["prompt"], sp, images=p.get("images")))
                else:
                    ids.append(self.add_request(p, sp))
        except BaseException:  # a bad prompt: the ones queued before it go too (a later call would get their outputs)
            for rid in ids:
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            if not self.has_unfinished():  # an engine bug, not a request's: fail instead of spinning
                lost = [i for i in ids if i not in final]
                raise RuntimeError(f"requests {lost} finished without a final output")
            with torch.inference_mode():
                for o in self._step(stream=False):
                    final[o.request_id] = o
        return [final[i] for i in ids]


def _coalesce(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: the newer with both deltas (every other
    field already holds everything so far)."""
    return replace(newer, delta_token_ids=older.delta_token_ids + newer.delta_token_ids,
                   delta_text=older.delta_text + newer.delta_text)


def _deliver(deliveries: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in deliveries:
        q.put_nowait(item)


class StreamingEngine:
    """What the asyncio engines share (``AsyncEngine``: ``LLMEngine`` on a thread;
    ``openk3.serve.engine_process.ProcessEngine``: in a process of its own): a stream per request
    fed from the engine's side by ``_push``.

    ``generate`` validates in the caller (raising ``InvalidRequest`` before anything is queued),
    then yields ``RequestOutput`` objects as steps produce them; outputs that queued up while
    the consumer was busy arrive merged into one (their deltas concatenated, as vLLM's output
    collector does), so a lagging server writes one chunk per stream per wake-up, not one per
    step. If the consumer stops early
    (client disconnect: the async generator is closed or cancelled), the request is aborted.
    Subclasses set ``inputs`` and implement ``_submit``, ``abort``, ``stats``, ``is_alive`` and
    ``shutdown``.
    """

    inputs: RequestInputs

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    def check(self, prompt: str | list[int], params: SamplingParams,
              images: MultiModalInput | None = None) -> Checked:
        """``generate`` checks only when first iterated; servers call this first to answer bad
        input before a stream starts (``InvalidRequest`` naming the parameter). Returns what
        ``generate`` then takes as its prompt without checking the ids again (a request checked
        once, however many choices it runs)."""
        return self.inputs.checked(prompt, params, images)

    def stats(self) -> EngineStats:
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    def _submit(self, request_id: str, valid: tuple[list[int], array], params: SamplingParams,
                images: MultiModalInput | None) -> None:
        """Hand a checked request (``RequestInputs.checked``'s ids and array) to the engine."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def _push(self, items: list[tuple[str, object]]) -> None:
        """Hand ``(request id, output or exception)`` pairs to their streams: one wake-up of each
        event loop per engine step, however many streams it serves. Any thread may call it."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, item in items:
            target = self._streams.get(rid)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_deliver, deliveries)

    def fail_all(self, error: BaseException) -> None:
        """End every open stream with ``error`` (raised to its consumer, which aborts the
        request): the server's shutdown after its grace period."""
        self._push([(rid, error) for rid in list(self._streams)])

    async def generate(self, prompt: str | list[int] | Checked, params: SamplingParams, request_id: str,
                       images: MultiModalInput | None = None) -> AsyncIterator[RequestOutput]:
        """``images``: from ``RequestInputs.prepare_images``, with ``prompt`` the ids it returned.
        A ``Checked`` prompt (``check``, with the same images) has only ``params`` checked here."""
        if isinstance(prompt, Checked):
            self.inputs.check_params(len(prompt.ids), params)
            valid = prompt
        else:
            valid = self.inputs.checked(prompt, params, images)  # here, not on the engine's side
        if request_id in self._streams:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            self._submit(request_id, valid, params, images)
            while not finished:
                items = [await q.get()]
                while not q.empty():  # a consumer slower than the engine: one output for all
                    items.append(q.get_nowait())
                out = None
                for item in items:
                    if isinstance(item, BaseException):
                        if out is not None:
                            yield out
                        raise item
                    out = item if out is None else _coalesce(out, item)
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)


class AsyncEngine(StreamingEngine):
    """``LLMEngine`` on a background thread of this process (``StreamingEngine``: the streams).
    Its steps share the interpreter's lock with the caller's event loop; ``ProcessEngine`` runs
    them in a process of their own."""

    def __init__(self, engine: LLMEngine):
        super().__init__()
        self.engine = engine
        self.inputs, self.model_name = engine.inputs, engine.model_name
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="openk3-engine", daemon=True)
        self._thread.start()

    def stats(self) -> EngineStats:
        return self.engine.snapshot_stats()

    @property
    def is_alive(self) -> bool:
        """The engine thread runs (False after ``shutdown`` or if it died)."""
        return self._thread.is_alive() and not self._stop

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            while True:
                try:
                    cmd, *args = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd == "add":
                    rid, (ids, packed), params, images = args
                    try:
                        eng._add(ids, packed, params, rid, images)  # checked by ``generate``
                    except Exception as e:  # noqa: BLE001 - fail this request only
                        self._push([(rid, e)])
                else:
                    eng.abort(args[0])
            if not eng.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = eng.step()
            except Exception as e:  # noqa: BLE001 - fail every request, keep serving
                # and every open stream: a request that finished inside the failed step has left
                # the engine already, and its output never came
                failed = dict.fromkeys([*eng.abort_all(), *list(self._streams)])
                self._push([(rid, e) for rid in failed])
                continue
            self._push([(o.request_id, o) for o in outputs])

    def _submit(self, request_id, valid, params, images) -> None:
        self._commands.put(("add", request_id, valid, params, images))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
