"""Continuous batching: which sequences run this step and how many tokens each. No tensors.

Each ``step()`` first gives every running decode its one token, then continues running
prefills chunk by chunk, then admits waiting requests in FIFO order, all under a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). When the MLA block pool runs
out, the running sequence last in that order (the newest prefill, else the newest decode) is
preempted by recomputation: its cache is freed and it goes back to the front of the waiting queue with nothing computed (the prefix
cache often gives most of it back on re-admission).

Engine loop contract, per step:
    out = scheduler.step()
    runner.execute(out): writes out.block_table_updates into its block table, executes
    out.block_copies and out.kda_restores, zeroes out.kda_resets, runs the forward pass for
    out.scheduled, then executes out.kda_saves; it returns the logits of the sequences in
    out.sampled (all of their tokens computed), one token is sampled for each, and
    scheduler.postprocess(request_ids, [[token_id] for each])

Speculative decoding (``num_speculative_tokens`` K > 0): a decode may be planned ``k <= K`` draft
tokens (``out.num_draft_tokens``); it is scheduled ``1 + k`` tokens, holds MLA blocks for
them, and ``num_computed_tokens`` counts them. Drafts take their budget once every running
decode has its token, before prefill chunks and admissions (``EngineConfig`` keeps the budget at
``max_num_seqs * (1 + K)`` or more, so a prefill always gets some and ``k`` depends only on the
request: seeded sampling stays independent of the batch), and their blocks last, from those the
step's sequences and admissions leave (none in a step that preempts), so speculation never
preempts or holds back a sequence plain decoding would run. The engine fills ``seq.draft_token_ids``,
the runner verifies them, and ``postprocess`` gets that sequence's emitted tokens (the accepted
drafts and one more): it rolls ``num_computed_tokens`` back to the tokens kept, appends the
run, gives back the blocks past it (the rejected drafts' lookahead) and only then registers the
step's hash blocks, so prefix hashes only ever cover accepted tokens. ``k`` stops short of the next
KDA checkpoint boundary, so checkpoints are only ever saved by plain steps (whose state is
exact); the step reaching the boundary is a plain decode.
The step's hash blocks and KDA checkpoints become visible to prefix lookups at the next
``postprocess`` or ``step`` (the runner has run it by then); a sequence freed before that
(abort) gives its planned checkpoint id back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from openk3.serve.block_manager import BlockCopy, BlockManager, BlockTableUpdate, KDARestore, KDASave
from openk3.serve.config import EngineConfig
from openk3.serve.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's plan. ``scheduled`` holds (sequence, tokens computed this step); the tokens are
    ``seq.token_ids[seq.num_computed_tokens - n : seq.num_computed_tokens]`` (already advanced)."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    block_table_updates: list[BlockTableUpdate] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    kda_restores: list[KDARestore] = field(default_factory=list)
    kda_resets: list[int] = field(default_factory=list)  # state slots to zero before the forward
    kda_saves: list[KDASave] = field(default_factory=list)  # after the forward
    preempted_ids: list[str] = field(default_factory=list)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)  # by request id, k >= 1

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def sampled(self) -> list[Sequence]:
        """Sequences whose every token is computed after this step: they get a new token
        (speculating sequences, which also count their drafts, are not among them)."""
        return [seq for seq, _ in self.scheduled if seq.num_computed_tokens == seq.num_tokens]


class Scheduler:
    """Reads ``max_num_seqs`` and ``max_num_batched_tokens`` from ``config``; ``max_model_len`` is
    the resolved limit (the model runner's, never None)."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.config, self.max_model_len = config, max_model_len
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self._last_scheduled: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, seq: Sequence) -> None:
        """Queue ``seq``; raises ValueError naming it when it can never fit."""
        rid, limit = seq.request_id, self.max_model_len
        if rid in self.requests:
            raise ValueError(f"request {rid!r} already exists")
        if seq.num_prompt_tokens + seq.max_tokens > limit:
            raise ValueError(
                f"request {rid!r}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                f"({seq.max_tokens}) exceeds max_model_len ({limit})"
            )
        bm = self.block_manager
        if bm.num_blocks_for(seq.num_prompt_tokens + seq.max_tokens) > bm.num_blocks:
            raise ValueError(
                f"request {rid!r}: {seq.num_prompt_tokens + seq.max_tokens} tokens exceed the "
                f"MLA cache ({bm.num_blocks} blocks of {bm.block_size})"
            )
        self.waiting.append(seq)
        self.requests[rid] = seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free everything it holds; False when it is unknown or done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.block_manager.free(seq)
            self.running.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        return True

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        """Tokens to compute now; a prefill chunk stops at the next KDA checkpoint boundary so the
        runner holds the state at exactly that boundary."""
        start = seq.num_computed_tokens
        end = start + min(seq.num_uncomputed_tokens, budget)
        boundary = self.block_manager.next_kda_checkpoint_boundary(seq, start)
        if boundary is not None and boundary < end:
            end = boundary
        return end - start

    def _num_draft_tokens(self, seq: Sequence, budget: int) -> int:
        """Draft tokens to verify for a decoding ``seq`` that holds its one token already: up to
        K, no more than max_tokens lets it emit (a step emits up to k + 1), within ``budget``
        (never short: ``EngineConfig`` keeps ``max_num_batched_tokens`` >= ``max_num_seqs * (1 +
        K)``), ending before the next KDA checkpoint boundary (the state there must be exact for
        the save). Blocks for them are the caller's business. A prompt's last token gets none,
        also when a prefill chunk left it alone (the batch's budget, or a checkpoint boundary at
        its end, cut the chunk there): a request's first token is always one plain sample, so
        where its chunks end does not change its tokens."""
        K = self.config.num_speculative_tokens
        if K == 0 or seq.num_uncomputed_tokens != 1 or seq.num_output_tokens == 0:
            return 0
        k = min(K, seq.max_tokens - seq.num_output_tokens - 1, budget)
        boundary = self.block_manager.next_kda_checkpoint_boundary(seq, seq.num_computed_tokens)
        if boundary is not None:
            k = min(k, boundary - seq.num_tokens - 1)
        return max(k, 0)

    def _grow(self, seq: Sequence, num_lookahead: int, pending: deque, out: SchedulerOutput) -> bool:
        """Blocks for ``seq``'s next token, preempting from the back of ``pending`` (then ``seq``
        itself) while the pool is short; False when ``seq`` was preempted."""
        bm = self.block_manager
        while not bm.can_append(seq, num_lookahead):
            victim = pending.pop() if pending else seq
            self._preempt(victim, out)
            if victim is seq:
                return False
        self._append(seq, num_lookahead, out)
        return True

    def _append(self, seq: Sequence, num_lookahead: int, out: SchedulerOutput) -> None:
        """``BlockManager.append_slot`` (the pool has room), the new blocks told to the runner."""
        num_blocks = len(seq.block_table)
        self.block_manager.append_slot(seq, num_lookahead)
        self._update_table(out, seq, num_blocks)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted_ids.append(seq.request_id)

    def _register_computed(self) -> None:
        """The last step has run: its hash blocks and KDA checkpoints may serve hits."""
        if self._last_scheduled:
            self.block_manager.commit_step([s for s in self._last_scheduled if s.status is SequenceStatus.RUNNING])
            self._last_scheduled = []

    @staticmethod
    def _update_table(out: SchedulerOutput, seq: Sequence, start: int) -> None:
        """Tell the runner about ``seq``'s block ids from column ``start`` on, if any."""
        if len(seq.block_table) > start:
            out.block_table_updates.append(
                BlockTableUpdate(seq.state_slot, start, tuple(seq.block_table[start:])))

    def step(self, admit: bool = True) -> SchedulerOutput:
        """The next step's work: running sequences first (decodes, then prefill chunks), then
        waiting ones while the budget, memory and ``max_num_seqs`` allow, unless ``admit`` is
        False (the engine adopts a decode step it launched ahead: ``LLMEngine``); the decodes'
        drafts take their budget before the prefills and their blocks after the admissions."""
        self._register_computed()  # in case the engine skipped postprocess (nothing sampled)
        bm, out = self.block_manager, SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # Running sequences: decodes first, each its one token, then the drafts' share of the
        # budget, then prefill chunks; victims come from the back.
        pending = deque(sorted(self.running, key=lambda s: len(s.token_ids) - s.num_computed_tokens > 1))
        block_size, decodes = bm.block_size, []
        while pending and budget > 0 and len(pending[0].token_ids) - pending[0].num_computed_tokens <= 1:
            seq = pending.popleft()
            if len(seq.token_ids) == seq.num_computed_tokens:
                continue  # its sampled token has not been reported yet
            if len(seq.token_ids) > len(seq.block_table) * block_size:  # its last block is full
                if not self._grow(seq, 0, pending, out):
                    pending.clear()
                    break
            out.scheduled.append((seq, 1))
            budget -= 1
            decodes.append(len(out.scheduled) - 1)
        drafts = {}  # index in out.scheduled -> k: the budget now, blocks after the admissions
        for i in decodes if self.config.num_speculative_tokens else ():
            k = self._num_draft_tokens(out.scheduled[i][0], budget)
            if k:
                drafts[i] = k
                budget -= k
        while pending and budget > 0:
            seq = pending.popleft()
            if not self._grow(seq, 0, pending, out):
                break
            n = self._num_new_tokens(seq, budget)
            out.scheduled.append((seq, n))
            budget -= n

        # Waiting sequences, strictly FIFO; none while memory is short enough to preempt.
        while (admit and self.waiting and budget > 0 and not out.preempted_ids
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            allocation = bm.admit(seq)
            if allocation is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._update_table(out, seq, 0)
            if allocation.block_copy is not None:
                out.block_copies.append(allocation.block_copy)
            if allocation.kda_restore is not None:
                out.kda_restores.append(allocation.kda_restore)
            else:
                out.kda_resets.append(seq.state_slot)
            n = self._num_new_tokens(seq, budget)
            out.scheduled.append((seq, n))
            budget -= n

        # The drafts' blocks last, from those nothing else needs this step (none while memory is
        # short enough to preempt): a draft never holds back a sequence plain decoding would run
        for i, k in drafts.items() if not out.preempted_ids else ():
            seq = out.scheduled[i][0]
            while k and not bm.can_append(seq, k):
                k -= 1
            if k:
                self._append(seq, k, out)
                out.num_draft_tokens[seq.request_id] = k
                out.scheduled[i] = (seq, 1 + k)

        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
        for seq in bm.kda_checkpoint_boundaries([seq for seq, _ in out.scheduled]):
            save = bm.plan_kda_save(seq, seq.num_computed_tokens)
            if save is not None:
                out.kda_saves.append(save)
        self._last_scheduled = [seq for seq, _ in out.scheduled]
        return out

    def postprocess(self, seq_ids: list[str], new_token_ids: list[list[int]]) -> list[Sequence]:
        """Append each sequence's new tokens: one sampled token, or a speculating sequence's
        emitted run (its ``a`` accepted drafts and one more: ``num_computed_tokens`` rolls back
        to the ``a`` drafts kept, and blocks past the tokens it holds now go back to the pool).
        Tokens are appended in order and a sequence finishes (and is freed) at the first eos or
        at max_tokens; the rest of its run is dropped. Then the step's hash blocks are registered:
        they cover computed tokens, every one appended by then.

        Returns the sequences that finished. Ids of requests aborted since the step are ignored.
        """
        if len(seq_ids) != len(new_token_ids):
            raise ValueError(f"{len(seq_ids)} sequence ids but {len(new_token_ids)} token lists")
        seqs, requests, running = [], self.requests, SequenceStatus.RUNNING
        for rid, token_ids in zip(seq_ids, new_token_ids):  # check every run before changing anything
            seq = requests.get(rid)
            if seq is None or seq.status is not running:
                continue
            num_drafts = len(seq.draft_token_ids)
            if not 1 <= len(token_ids) <= num_drafts + 1:
                raise ValueError(f"request {seq.request_id!r}: {len(token_ids)} new tokens, but "
                                 f"{num_drafts} drafts allow 1 to {num_drafts + 1}")
            if seq.num_computed_tokens - num_drafts != len(seq.token_ids):
                raise ValueError(f"request {seq.request_id!r} was not due to sample this step")
            seqs.append((seq, token_ids))
        bm, finished = self.block_manager, []
        for seq, token_ids in seqs:
            num_drafts = len(seq.draft_token_ids)
            seq.num_computed_tokens = len(seq.token_ids) + len(token_ids) - 1  # the kept drafts
            if num_drafts:
                seq.draft_token_ids = []
            eos, limit = seq.eos_token_ids, seq.num_prompt_tokens + seq.max_tokens
            for token_id in token_ids:
                seq.append_token(token_id)
                if token_id in eos:
                    seq.finish_reason = "stop"
                elif len(seq.token_ids) >= limit:  # max_tokens output tokens
                    seq.finish_reason = "length"
                else:
                    continue
                break
            if seq.finish_reason is not None:  # its run's tokens after the end are not computed
                seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids))
                finished.append(seq)
            elif num_drafts:  # the rejected drafts' lookahead blocks
                bm.trim(seq)
        self._register_computed()
        for seq in finished:
            bm.free(seq)
            self.running.remove(seq)
            del self.requests[seq.request_id]
            seq.status = SequenceStatus.FINISHED
        return finished
