"""Partial-rollout bookkeeping with fake generators: across rounds, training steps and a
checkpoint round trip no trajectory is lost or duplicated, each resumes exactly where it stopped
(and is resubmitted only after a step boundary), the batch never exceeds the capacity, and the
token / log-prob / version arrays stay aligned; rounds refill freed slots exactly as specified."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openk3.posttrain.partial import PartialRollouts, Piece


def expected_token(key: int, j: int) -> int:
    return (key * 7919 + j * 104729) % 1000


class FakeBackend:
    """Trajectory ``key`` would produce ``length(key)`` tokens ``expected_token(key, j)``; each
    step emits 1-3 tokens per request. It checks every resubmission continues the prompt and
    the tokens so far."""

    def __init__(self, lengths: dict[int, int], seed: int):
        self.lengths, self.rng = lengths, random.Random(seed)
        self.prompts: dict[int, list[int]] = {}
        self.live: dict[int, list] = {}  # key -> [position, tokens left in this request]
        self.submitted: list[int] = []  # keys, in submission order
        self.most_live = 0

    def submit(self, key, token_ids, max_tokens, stop):
        assert stop == ("\n",)
        prompt = self.prompts.setdefault(key, list(token_ids))
        assert token_ids[:len(prompt)] == prompt
        done = token_ids[len(prompt):]
        assert done == [expected_token(key, j) for j in range(len(done))], "resumed at the wrong place"
        assert key not in self.live and max_tokens > 0
        self.live[key] = [len(done), max_tokens]
        self.submitted.append(key)
        self.most_live = max(self.most_live, len(self.live))

    def step(self):
        pieces = []
        for key, (pos, left) in list(self.live.items()):
            n = min(self.rng.randint(1, 3), left, self.lengths[key] - pos)
            toks = [expected_token(key, pos + j) for j in range(n)]
            end = pos + n
            reason = "stop" if end == self.lengths[key] else ("length" if n == left else None)
            pieces.append(Piece(key, toks, [-(key + pos + j) / 1e3 for j in range(n)], reason))
            if reason:
                del self.live[key]
            else:
                self.live[key] = [end, left - n]
        return pieces

    def abort_all(self):
        self.live.clear()

    def has_unfinished(self):
        return bool(self.live)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), group_size=st.integers(2, 4), groups=st.integers(1, 4),
       fraction=st.sampled_from([0.25, 0.5, 0.9, 1.0]), partial=st.booleans(), max_tokens=st.integers(1, 12),
       per_step=st.integers(1, 3), roundtrip_at=st.integers(0, 6))
def test_no_trajectory_lost_or_duplicated(seed, group_size, groups, fraction, partial, max_tokens, per_step,
                                          roundtrip_at):
    rng = random.Random(seed)
    lengths = {k: rng.randint(1, 20) for k in range(10_000)}  # long-tailed enough: many hit max_tokens
    backend = FakeBackend(lengths, seed)
    capacity = max(groups, per_step) * group_size
    sched = PartialRollouts(backend, group_size, capacity, max_tokens, fraction, partial)
    total_groups, admitted = 12, 0

    def new_groups(n):
        nonlocal admitted
        n = min(n, total_groups - admitted)
        out = [([admitted % 5 + 1] * (1 + admitted % 3), {"g": admitted + i}, ("\n",)) for i in range(n)]
        admitted += n
        return out

    handed, version, generated = [], 0, 0
    while len(handed) < total_groups:
        queued = [t.uid for t in sched.queue]
        first = len(backend.submitted)
        ready, stats = sched.generate(new_groups, version, per_step)
        calls = backend.submitted[first:]
        assert len(calls) == len(set(calls)), "a trajectory was resubmitted within a step"
        assert queued == sorted(queued)
        if calls:  # the queue goes first, oldest first
            assert calls[:len(queued)] == queued and stats.resumed == len(queued)
        else:  # enough complete groups were waiting: nothing ran, the queue waits
            assert [t.uid for t in sched.queue] == queued and stats.engine_steps == stats.rounds == 0
        assert len(ready) == min(per_step, total_groups - len(handed))
        assert [g.uid for g in ready] == sorted(g.uid for g in ready)  # admission order
        assert all(g.uid > h.uid for g in sched.groups.values() if g.done for h in ready)  # oldest first
        if not partial:
            assert stats.queued == stats.waiting == 0 and not sched.groups and stats.rounds == 1
        assert stats.queued == len(sched.queue)
        handed += ready
        generated += stats.tokens
        version += 1
        if version == roundtrip_at:  # a checkpoint and resume mid-run
            state = json.loads(json.dumps(sched.state_dict(lambda p: p)))
            sched = PartialRollouts(backend, group_size, capacity, max_tokens, fraction, partial)
            sched.load_state_dict(state, lambda p: p)
        assert len(handed) + len(sched.groups) == admitted
    assert backend.most_live <= capacity
    assert sorted(g.payload["g"] for g in handed) == list(range(total_groups))
    uids = [t.uid for g in handed for t in g.members]
    assert len(uids) == len(set(uids)) == total_groups * group_size
    assert not sched.queue and not sched.groups
    assert generated == sum(len(t.tokens) for g in handed for t in g.members)
    for g in handed:
        assert len(g.members) == group_size
        for t in g.members:
            n = len(t.tokens)
            assert len(t.logprobs) == len(t.versions) == n and t.finished
            assert t.tokens == [expected_token(t.uid, j) for j in range(n)]
            assert t.logprobs == [-(t.uid + j) / 1e3 for j in range(n)]
            assert t.versions == sorted(t.versions)
            assert n == min(lengths[t.uid], max_tokens)
            assert t.finish_reason == ("stop" if lengths[t.uid] <= max_tokens else "length")
            assert len(set(t.versions)) <= t.segments == backend.submitted.count(t.uid)
            if not partial:
                assert t.segments == 1


class OneTokenBackend:
    """Every request gets one token per step; trajectory ``key`` ends after ``lengths[key]``."""

    def __init__(self, lengths: dict[int, int]):
        self.lengths, self.live, self.log = lengths, {}, []

    def submit(self, key, token_ids, max_tokens, stop):
        self.live[key] = min(max_tokens, self.lengths[key] - (len(token_ids) - 1))  # 1-token prompts
        self.log.append(("submit", key, len(token_ids)))

    def step(self):
        pieces = []
        for key in list(self.live):
            self.live[key] -= 1
            done = self.live[key] == 0
            pieces.append(Piece(key, [7], [-1.0], "stop" if done else None))
            if done:
                del self.live[key]
        self.log.append(("step", len(pieces)))
        return pieces

    def abort_all(self):
        self.log.append(("abort", sorted(self.live)))
        self.live.clear()

    def has_unfinished(self):
        return bool(self.live)


def test_rounds_refill_and_steps_carry_over():
    """Groups of 2, capacity 4, lambda 0.5, 2 groups per step. Lengths: group 0 (uids 0, 1): 1
    each; group 1 (2, 3): 4; group 2 (4, 5): 1; group 3 (6, 7): 3; group 4 (8, 9): 1."""
    lengths = {0: 1, 1: 1, 2: 4, 3: 4, 4: 1, 5: 1, 6: 3, 7: 3, 8: 1, 9: 1}
    backend = OneTokenBackend(lengths)
    sched = PartialRollouts(backend, 2, 4, max_tokens=10, finish_fraction=0.5)
    ready, stats = sched.generate(lambda n: [([1], None, ())] * n, version=0, num_groups=2)
    # step 1 finishes group 0 (half the round's 4): round 2 refills the 2 free slots with group 2,
    # which completes at step 2; group 1 is aborted with 2 of its 4 tokens and queued
    assert [g.uid for g in ready] == [0, 2]
    assert backend.log == [("submit", 0, 1), ("submit", 1, 1), ("submit", 2, 1), ("submit", 3, 1), ("step", 4),
                           ("submit", 4, 1), ("submit", 5, 1), ("step", 4), ("abort", [2, 3])]
    assert (stats.rounds, stats.engine_steps, stats.slot_steps, stats.tokens) == (2, 2, 8, 8)
    assert (stats.admitted_groups, stats.queued, stats.resumed, stats.waiting) == (3, 2, 0, 0)
    backend.log.clear()
    ready, stats = sched.generate(lambda n: [([1], None, ())] * n, version=1, num_groups=2)
    # the queue first (prompt + 2 tokens, 2 to go), then group 3 in the free slots
    assert backend.log[:4] == [("submit", 2, 3), ("submit", 3, 3), ("submit", 6, 1), ("submit", 7, 1)]
    # step 2 finishes group 1 (half the round): group 4 refills; step 3 completes groups 3 and 4
    assert backend.log[4:] == [("step", 4), ("step", 4), ("submit", 8, 1), ("submit", 9, 1), ("step", 4),
                               ("abort", [])]
    assert [g.uid for g in ready] == [1, 3]
    assert [t.versions for t in ready[0].members] == [[0, 0, 1, 1]] * 2
    assert (stats.resumed, stats.resumed_tokens, stats.rounds, stats.queued, stats.waiting) == (2, 6, 2, 0, 1)
    assert list(sched.groups) == [4] and sched.groups[4].done
    assert all(t.segments == 2 for t in ready[0].members) and all(t.segments == 1 for t in ready[1].members)


def test_sync_runs_each_step_to_the_end():
    lengths = {k: 1 + k % 5 for k in range(40)}
    backend = OneTokenBackend(lengths)
    sched = PartialRollouts(backend, 2, 6, max_tokens=10, partial=False)
    for version in range(3):
        ready, stats = sched.generate(lambda n: [([1], None, ())] * n, version, num_groups=3)
        uids = [t.uid for g in ready for t in g.members]
        assert uids == list(range(6 * version, 6 * version + 6))
        assert stats.engine_steps == max(lengths[u] for u in uids)  # the longest sample sets the step
        assert stats.rounds == 1 and stats.queued == 0 and not sched.queue
    with pytest.raises(ValueError, match="exceeds capacity"):
        sched.generate(lambda n: [([1], None, ())] * n, 3, num_groups=4)
