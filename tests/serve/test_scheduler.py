"""Scheduler: budgets, chunked prefill, preemption, aborts, and a randomised leak/correctness check.

``FakeRunner`` stands in for the model: the MLA cache holds the token id written at each slot and
a KDA state slot holds the token ids folded into it, so every step can check that the prefix the
scheduler claims is computed really sits in the cache and the state (copies, restores and
checkpoints included). It keeps its block tables only from the step's ``BlockTableUpdate``s, as
the model runner does, and checks them against the block manager's.
"""

import random
from array import array
from collections import Counter

from hypothesis import given, settings, strategies as st
import pytest

from openk3.serve.block_manager import BlockManager
from openk3.serve.config import EngineConfig
from openk3.serve.scheduler import Scheduler
from openk3.serve.sequence import Sequence, SequenceStatus

EOS = 0


def make(num_blocks=16, max_num_seqs=4, budget=32, max_model_len=128, num_state_slots=4, **cache):
    cache_config = dict(physical_block_size=16, hash_block_size=4, num_kda_checkpoints=4, kda_checkpoint_interval=8)
    cache_config.update(cache)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, **cache_config)
    return Scheduler(config, BlockManager(config, num_blocks, num_state_slots), max_model_len)


class FakeRunner:
    def __init__(self, sched: Scheduler):
        self.sched, self.bm = sched, sched.block_manager
        self.kv: dict[int, int] = {}  # flat slot -> token id
        self.state: dict[int, list[int]] = {}
        self.checkpoints: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}  # state slot -> block ids, from the updates alone

    def next_token(self, seq: Sequence) -> int:
        return (sum(seq.token_ids[-3:]) * 31 + seq.num_tokens) % 23

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        table, size = self.tables[seq.state_slot], self.bm.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def run(self, out) -> list[Sequence]:
        size = self.bm.block_size
        for u in out.block_table_updates:
            table = self.tables.setdefault(u.state_slot, [])
            assert u.start <= len(table)
            table[u.start:] = u.block_ids
        for c in out.block_copies:
            for i in range(c.num_tokens):
                self.kv[c.dst * size + i] = self.kv[c.src * size + i]
        for r in out.kda_restores:
            self.state[r.dst_state_slot] = list(self.checkpoints[r.checkpoint_id])
        for slot in out.kda_resets:
            self.state[slot] = []
        for seq, n in out.scheduled:
            if seq.is_finished:  # aborted after the step was planned
                continue
            start = seq.num_computed_tokens - n
            assert self.tables[seq.state_slot][:len(seq.block_table)] == seq.block_table
            assert self.slots(seq, start, start + n) == self.bm.slot_mapping(seq, start, start + n)
            assert self.state[seq.state_slot] == seq.token_ids[:start]
            assert [self.kv[s] for s in self.slots(seq, 0, start)] == seq.token_ids[:start]
            for slot, token in zip(self.slots(seq, start, start + n), seq.token_ids[start : start + n]):
                self.kv[slot] = token
            self.state[seq.state_slot] = seq.token_ids[: start + n]
        for save in out.kda_saves:
            self.checkpoints[save.checkpoint_id] = list(self.state[save.state_slot])
        sampled = [s for s in out.sampled if not s.is_finished]
        return self.sched.postprocess([s.request_id for s in sampled], [[self.next_token(s)] for s in sampled])


def check_invariants(sched: Scheduler, out) -> None:
    bm, config = sched.block_manager, sched.config
    assert out.num_batched_tokens <= config.max_num_batched_tokens
    assert len(out.scheduled) <= config.max_num_seqs and len(sched.running) <= config.max_num_seqs
    assert all(n > 0 for _, n in out.scheduled)
    refs = Counter(b for seq in sched.running for b in seq.block_table)
    assert all(bm.ref_counts[b] == refs.get(b, 0) for b in range(bm.num_blocks))
    free = list(bm.free_block_ids) + list(bm.cached_block_ids)
    assert len(free) == len(set(free)) and all(bm.ref_counts[b] == 0 for b in free)
    assert len(free) + len(refs) == bm.num_blocks
    slots = [seq.state_slot for seq in sched.running] + list(bm.free_state_slots)
    assert sorted(slots) == list(range(bm.num_state_slots))
    assert_checkpoint_ids_conserved(bm)
    assert all(s.state_slot is not None for s, _ in out.scheduled if not s.is_finished)
    assert all(seq.status is SequenceStatus.WAITING and not seq.block_table for seq in sched.waiting)
    # Preempted sequences wait at the front, the earliest admitted first.
    k = len(out.preempted_ids)
    assert [s.request_id for s in list(sched.waiting)[:k]] == out.preempted_ids[::-1]


def assert_drained(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.requests and not sched.running and not sched.waiting
    assert all(r == 0 for r in bm.ref_counts) and bm.num_free_blocks == bm.num_blocks
    assert bm.num_free_state_slots == bm.num_state_slots
    assert_checkpoint_ids_conserved(bm)


def assert_checkpoint_ids_conserved(bm: BlockManager) -> None:
    """Every checkpoint id is free, stored or planned for the step in flight, exactly once."""
    ids = (list(bm.free_checkpoint_ids) + [c.checkpoint_id for c in bm.checkpoints.values()]
           + [c.checkpoint_id for _, c in bm.pending_checkpoints.values()])
    assert sorted(ids) == list(range(bm.config.num_kda_checkpoints))


def test_max_length_check_names_the_request():
    sched = make(max_model_len=64)
    with pytest.raises(ValueError, match="'too-long'"):
        sched.add_request(Sequence("too-long", [1] * 60, max_tokens=5))
    with pytest.raises(ValueError, match="'empty'"):
        Sequence("empty", [], max_tokens=5)


def test_chunked_prefill_and_decode_share_a_step_under_the_budget():
    sched = make(budget=10, enable_prefix_caching=False)
    runner = FakeRunner(sched)
    sched.add_request(Sequence("short", [1, 2, 3], max_tokens=5, eos_token_ids=[99]))
    out = sched.step()
    assert out.scheduled == [(sched.requests["short"], 3)]
    runner.run(out)
    sched.add_request(Sequence("long", list(range(1, 26)), max_tokens=5, eos_token_ids=[99]))
    out = sched.step()
    # The decode goes first, the prefill gets the rest of the budget.
    assert [(s.request_id, n) for s, n in out.scheduled] == [("short", 1), ("long", 9)]
    runner.run(out)
    out = sched.step()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("short", 1), ("long", 9)]


def test_a_step_without_admission_leaves_the_queue_waiting():
    """``step(admit=False)`` (the engine adopting a decode step it launched ahead) schedules the
    running sequences only; the waiting prompt is admitted by the next plain step."""
    sched = make(budget=10, enable_prefix_caching=False)
    runner = FakeRunner(sched)
    sched.add_request(Sequence("running", [1, 2, 3], max_tokens=5, eos_token_ids=[99]))
    runner.run(sched.step())
    sched.add_request(Sequence("waiting", [4, 5], max_tokens=5, eos_token_ids=[99]))
    out = sched.step(admit=False)
    assert [(s.request_id, n) for s, n in out.scheduled] == [("running", 1)] and sched.num_waiting == 1
    assert not (out.block_table_updates or out.kda_resets)
    runner.run(out)
    out = sched.step()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("running", 1), ("waiting", 2)]


def test_prefill_chunks_stop_at_kda_checkpoint_boundaries():
    sched = make(budget=32)
    runner = FakeRunner(sched)
    sched.add_request(Sequence("a", list(range(1, 15)), max_tokens=3, eos_token_ids=[99]))
    chunks = []
    while sched.has_unfinished():
        out = sched.step()
        chunks += [n for _, n in out.scheduled]
        runner.run(out)
    assert chunks[:2] == [8, 4]  # interval 8, then the prompt end 14 rounded down to 12
    assert chunks[2] == 2


def test_shared_prefix_hits_and_matches_uncached_outputs():
    outputs = {}
    for caching in (True, False):
        sched = make(enable_prefix_caching=caching)
        runner = FakeRunner(sched)
        prefix = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
        done = {}
        for i, tail in enumerate([[1, 2], [3, 4, 5], [6]]):
            sched.add_request(Sequence(f"r{i}", prefix + tail, max_tokens=4))
            while sched.has_unfinished():
                for seq in runner.run(sched.step()):
                    done[seq.request_id] = seq.output_token_ids
        outputs[caching] = done
        if caching:
            assert sched.block_manager.stats.hits == 2 and sched.block_manager.stats.saved_tokens == 2 * 16
        assert_drained(sched)
    assert outputs[True] == outputs[False]


def test_preempted_sequence_is_readmitted_before_newer_requests():
    sched = make(num_blocks=4, budget=64, max_model_len=64, enable_prefix_caching=False)
    runner = FakeRunner(sched)
    sched.add_request(Sequence("old", [1] * 20, max_tokens=40, eos_token_ids=[99]))
    sched.add_request(Sequence("young", [2] * 20, max_tokens=40, eos_token_ids=[99]))
    preempted = None
    for _ in range(40):
        out = sched.step()
        check_invariants(sched, out)
        if out.preempted_ids:
            preempted = out.preempted_ids[0]
            break
        runner.run(out)
    assert preempted == "young"
    sched.add_request(Sequence("newer", [3] * 4, max_tokens=2, eos_token_ids=[99]))
    assert [s.request_id for s in sched.waiting] == ["young", "newer"]
    runner.run(out)
    while sched.has_unfinished():
        out = sched.step()
        check_invariants(sched, out)
        admitted = [s.request_id for s, _ in out.scheduled if s.request_id != "old"]
        if admitted:
            assert admitted[0] == "young"
            break
        runner.run(out)


def test_abort_frees_everything():
    sched = make()
    runner = FakeRunner(sched)
    for i in range(3):
        sched.add_request(Sequence(f"r{i}", [i + 1] * 10, max_tokens=10, eos_token_ids=[99]))
    runner.run(sched.step())
    assert sched.abort("r1") and not sched.abort("r1") and not sched.abort("missing")
    sched.abort("r0")
    sched.abort("r2")
    assert_drained(sched)


def test_save_planned_for_an_aborted_request_is_returned_and_never_hits():
    sched = make(budget=64)
    runner = FakeRunner(sched)
    prompt = list(range(1, 11))  # the prompt end, 8, is a checkpoint boundary
    sched.add_request(Sequence("a", prompt, max_tokens=4, eos_token_ids=[99]))
    out = sched.step()
    (save,) = out.kda_saves
    assert save.state_slot == sched.requests["a"].state_slot
    sched.abort("a")  # the client left between planning and running the step
    runner.run(out)
    bm = sched.block_manager
    assert save.checkpoint_id in bm.free_checkpoint_ids and not bm.checkpoints
    sched.add_request(Sequence("b", prompt[:8] + [30], max_tokens=1, eos_token_ids=[99]))
    while sched.has_unfinished():
        runner.run(sched.step())
    assert sched.block_manager.stats.hits == 0
    assert_drained(sched)


def test_checkpoint_of_a_sequence_preempted_after_saving_serves_its_readmission():
    """young's save at 16 tokens (an interval boundary) is planned in the step right before the
    one that preempts it for want of a second block; that step's planning commits it first, so
    the recomputation resumes from it."""
    sched = make(num_blocks=3, budget=64, max_model_len=48)
    runner = FakeRunner(sched)
    sched.add_request(Sequence("old", [1] * 12, max_tokens=10, eos_token_ids=[99]))
    sched.add_request(Sequence("young", [2] * 12, max_tokens=10, eos_token_ids=[99]))
    out = sched.step()
    assert len(out.kda_saves) == 2
    while not out.preempted_ids:
        runner.run(out)
        out = sched.step()
        check_invariants(sched, out)
    young = sched.requests["young"]
    assert out.preempted_ids == ["young"] and young.num_tokens == 17
    assert tuple(young.token_ids[:16]) in [c.token_ids for c in sched.block_manager.checkpoints.values()]
    while sched.has_unfinished():
        runner.run(out)
        out = sched.step()
        if any(s.request_id == "young" for s, _ in out.scheduled):
            assert sched.requests["young"].num_cached_tokens == 16
            break
    else:
        raise AssertionError("young was never readmitted")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(8, 14), budget=st.integers(4, 40),
       max_num_seqs=st.integers(1, 4), caching=st.booleans())
def test_random_workload_is_correct_and_leak_free(seed, num_blocks, budget, max_num_seqs, caching):
    rng = random.Random(seed)
    sched = make(num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs, num_state_slots=4,
                 enable_prefix_caching=caching, num_kda_checkpoints=3)
    runner = FakeRunner(sched)
    prefixes = [[rng.randrange(1, 23) for _ in range(40)] for _ in range(3)]
    next_id = 0
    for step in range(400):
        if step < 60 and rng.random() < 0.4:
            prompt = rng.choice(prefixes)[: rng.randrange(0, 40)] + [rng.randrange(1, 23) for _ in range(rng.randrange(1, 20))]
            sched.add_request(Sequence(f"r{next_id}", prompt, max_tokens=rng.randrange(1, 30), eos_token_ids=[EOS]))
            next_id += 1
        if sched.requests and rng.random() < 0.05:
            sched.abort(rng.choice(sorted(sched.requests)))
        if not sched.has_unfinished() and step >= 60:
            break
        out = sched.step()
        check_invariants(sched, out)
        if sched.requests and rng.random() < 0.02:  # a client disconnects mid-step
            sched.abort(rng.choice(sorted(sched.requests)))
        runner.run(out)
    assert_drained(sched)


def test_speculative_decode_budget_blocks_and_rollback():
    """A decode with K = 3 drafts is scheduled 1 + k tokens and blocks for them; k is capped by
    max_tokens, the budget and the next KDA checkpoint boundary; postprocess keeps the accepted
    drafts only and hashes nothing beyond them."""
    sched = make(budget=64, num_speculative_tokens=3, kda_checkpoint_interval=64)
    seq = Sequence("a", list(range(1, 15)), max_tokens=6)
    sched.add_request(seq)
    while seq.num_computed_tokens < 14:  # the prompt, in two chunks (a checkpoint at 12)
        sched.step()
    sched.postprocess(["a"], [[1]])
    out = sched.step()
    assert out.scheduled == [(seq, 4)] and out.num_draft_tokens == {"a": 3}
    assert seq.num_computed_tokens == 18 and len(seq.block_table) == 2  # positions up to 17
    seq.draft_token_ids = [5, 6, 7]
    sched.postprocess(["a"], [[5, 9]])  # one draft accepted, then the correction
    assert seq.token_ids[14:] == [1, 5, 9] and seq.num_computed_tokens == 16
    assert seq.num_registered_hash_blocks == 4  # 16 // 4: only computed, accepted tokens
    # the last of them holds the accepted draft: registered with its ids, not a short slice
    bm = sched.block_manager
    assert [bm.hash_to_block[h].token_bytes for h in seq.block_hashes[:4]] == \
        [array("q", seq.token_ids[i:i + 4]).tobytes() for i in range(0, 16, 4)]
    out = sched.step()  # 3 generated, max_tokens 6: at most 3 more, so k = 2
    assert out.num_draft_tokens == {"a": 2}
    seq.draft_token_ids = [3, 4]
    sched.postprocess(["a"], [[3, 4, 8]])
    assert seq.is_finished and seq.finish_reason == "length" and seq.output_token_ids == [1, 5, 9, 3, 4, 8]


def test_speculation_stops_before_a_checkpoint_boundary():
    sched = make(budget=16, num_speculative_tokens=3, kda_checkpoint_interval=16)
    seq = Sequence("a", list(range(1, 12)), max_tokens=20)
    sched.add_request(seq)
    while seq.num_computed_tokens < 11:
        sched.step()
    sched.postprocess(["a"], [[1]])  # 12 tokens, 11 computed
    out = sched.step()
    assert out.num_draft_tokens == {"a": 3}  # positions 11 .. 14, short of the boundary at 16
    seq.draft_token_ids = [2, 3, 9]
    sched.postprocess(["a"], [[2, 3, 4]])  # 15 tokens, 14 computed
    for computed in (15, 16):  # a segment would reach the boundary at 16: plain decodes up to it
        out = sched.step()
        assert not out.num_draft_tokens and out.scheduled == [(seq, 1)] and seq.num_computed_tokens == computed
        assert bool(out.kda_saves) == (computed == 16)
        sched.postprocess(["a"], [[5]])
    assert sched.step().num_draft_tokens == {"a": 3}  # past it: speculating again
    with pytest.raises(ValueError, match="max_num_batched_tokens"):  # 4 decodes of 1 + 3 tokens do not fit
        make(budget=15, num_speculative_tokens=3)


def _run_drafting(requests, num_blocks: int, budget: int, K: int, accept: bool) -> list[tuple]:
    """Serve ``requests`` ((prompt length, max_tokens)) through the scheduler alone, every draft
    accepted or every one rejected; per step (the tokens each sequence computes less its
    drafts, the preempted ids), with the invariants checked."""
    sched = make(num_blocks=num_blocks, budget=budget, max_num_seqs=4, num_speculative_tokens=K,
                 physical_block_size=8, enable_prefix_caching=False)
    for i, (prompt, max_tokens) in enumerate(requests):
        sched.add_request(Sequence(f"r{i}", [3 + i] * prompt, max_tokens=max_tokens))
    trace = []
    while sched.has_unfinished():
        out = sched.step()
        trace.append((sorted((s.request_id, n - out.num_draft_tokens.get(s.request_id, 0)) for s, n in out.scheduled),
                      out.preempted_ids))
        ids, runs = [], []
        for seq, _ in out.scheduled:
            k = out.num_draft_tokens.get(seq.request_id, 0)
            if seq.num_computed_tokens - k == seq.num_tokens:  # due to sample
                seq.draft_token_ids = [7] * k
                ids.append(seq.request_id)
                runs.append([7] * (k + 1 if accept else 1))
        sched.postprocess(ids, runs)
        check_invariants(sched, out)
    assert_drained(sched)
    return trace


def test_drafts_take_no_block_a_sequence_needs():
    """The drafts' blocks are taken last, from those no decode, prefill or admission needs this
    step, and the rejected drafts' blocks go back: with every draft rejected the schedule is
    plain decoding's exactly, where taking a lookahead block first preempted the second request
    (three blocks of 8 tokens). With every draft accepted a sequence that grows faster may need
    its blocks before another finishes: that preemption is a real sequence's, not a draft's."""
    requests = [(1, 10), (7, 6)]
    plain = _run_drafting(requests, num_blocks=3, budget=64, K=0, accept=False)
    assert not any(preempted for _, preempted in plain)
    assert _run_drafting(requests, num_blocks=3, budget=64, K=7, accept=False) == plain


@pytest.mark.parametrize("accept", [False, True])
def test_drafts_hold_no_request_back(accept):
    """Every running decode gets its own token before any draft, and the budget is at least
    ``max_num_seqs * (1 + K)``, so prompts always get some: every request starts before any
    finishes (drafts taken first held two of these back until the first two finished)."""
    trace = _run_drafting([(20, 40)] * 4, num_blocks=32, budget=32, K=7, accept=accept)
    started = {rid: i for i, (step, _) in reversed(list(enumerate(trace))) for rid, _ in step}
    first_finish = next(i for i, (step, _) in enumerate(trace) if len(step) < 4 and i > max(started.values()))
    assert max(started.values()) <= 3 < first_finish
