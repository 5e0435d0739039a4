"""Partial-rollout bookkeeping with a fake generator: across rounds (and a checkpoint round
trip) no trajectory is lost or duplicated, each resumes exactly where it stopped, and its
token / log-prob / version arrays stay aligned."""

from __future__ import annotations

import json
import random

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

    def submit(self, key, token_ids, max_tokens, stop):
        assert stop == ("\n",)
        prompt = self.prompts.setdefault(key, list(token_ids))
        assert token_ids[:len(prompt)] == prompt
        done = token_ids[len(prompt):]
        assert done == [expected_token(key, j) for j in range(len(done))], "resumed at the wrong place"
        assert key not in self.live and max_tokens > 0
        self.live[key] = [len(done), max_tokens]

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
       roundtrip_at=st.integers(0, 6))
def test_no_trajectory_lost_or_duplicated(seed, group_size, groups, fraction, partial, max_tokens, roundtrip_at):
    rng = random.Random(seed)
    lengths = {k: rng.randint(1, 20) for k in range(10_000)}  # long-tailed enough: many hit max_tokens
    backend = FakeBackend(lengths, seed)
    sched = PartialRollouts(backend, group_size, groups * group_size, max_tokens, fraction, partial)
    total_groups, admitted = 12, 0

    def new_groups(n):
        nonlocal admitted
        n = min(n, total_groups - admitted)
        out = [([admitted % 5 + 1] * (1 + admitted % 3), {"g": admitted + i}, ("\n",)) for i in range(n)]
        admitted += n
        return out

    handed, version = [], 0
    while len(handed) < total_groups:
        ready, stats = sched.round(new_groups, version)
        assert ready, "a round hands out at least one group"
        assert [g.uid for g in ready] == sorted(g.uid for g in ready)  # admission order
        if not partial:
            assert stats.queued == 0 and not sched.groups
        handed += ready
        version += 1
        if version == roundtrip_at:  # a checkpoint and resume mid-run
            state = json.loads(json.dumps(sched.state_dict(lambda p: p)))
            sched = PartialRollouts(backend, group_size, groups * group_size, max_tokens, fraction, partial)
            sched.load_state_dict(state, lambda p: p)
        assert len(handed) + len(sched.groups) == admitted
    assert sorted(g.payload["g"] for g in handed) == list(range(total_groups))
    uids = [t.uid for g in handed for t in g.members]
    assert len(uids) == len(set(uids)) == total_groups * group_size
    assert not sched.queue and not sched.groups
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
            assert len(set(t.versions)) <= t.segments
            if not partial:
                assert t.segments == 1
