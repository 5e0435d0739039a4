"""The rollout benchmark's logic (benchmarks/rollout_bench.py) on a count-based fake engine, whose
clock is its number of steps: sync steps last exactly as long as their longest sample, partial
rollouts keep the batch fuller and need fewer engine steps on a long tail, every generated token
is either delivered or counted as undelivered; and the wiring on the real engine (CPU, tiny)."""

from __future__ import annotations

import statistics

import pytest
import torch

from benchmarks.rollout_bench import make_lengths, run_mode, warm_up
from openk3 import build_model
from openk3.posttrain.partial import Piece
from openk3.posttrain.rollout import RolloutEngine
from openk3.tokenizer import ByteTokenizer

from .conftest import tiny_config

STEPS, B, G, CAP = 4, 3, 4, 256
COMMON = {"steps": STEPS, "prompts_per_step": B, "group_size": G, "max_new_tokens": CAP, "prompt_tokens": 5, "seed": 0}


class CountingEngine:
    """Every request gets one token per step (prefill is free); ``steps`` is the clock."""

    def __init__(self):
        self.live: dict[int, int] = {}  # key -> tokens left
        self.steps = self.most_live = 0

    def submit(self, key, token_ids, max_tokens, stop):
        assert key not in self.live and max_tokens >= 1
        self.live[key] = max_tokens
        self.most_live = max(self.most_live, len(self.live))

    def step(self):
        self.steps += 1
        pieces = []
        for key in list(self.live):
            self.live[key] -= 1
            pieces.append(Piece(key, [5], [-0.5], None if self.live[key] else "length"))
            if not self.live[key]:
                del self.live[key]
        return pieces

    def abort_all(self):
        self.live.clear()

    def has_unfinished(self):
        return bool(self.live)


def _run(partial, fraction, kind="heavy"):
    engine, syncs = CountingEngine(), []
    row = run_mode(engine, lambda: syncs.append(engine.steps), partial=partial, finish_fraction=fraction,
                   length=make_lengths(kind, CAP, 0), clock=lambda: engine.steps, **COMMON)
    assert len(syncs) == STEPS and engine.most_live <= B * G
    return row, engine


def test_lengths():
    # light: the cap is 8x the median (~4% reach it); heavy: 32x, and 7% run to it
    for kind, median, at_cap in (("light", CAP / 8, (0.03, 0.065)), ("heavy", CAP / 32, (0.055, 0.085))):
        length = make_lengths(kind, CAP, 3)
        draws = [length(k) for k in range(4000)]
        assert draws[:50] == [make_lengths(kind, CAP, 3)(k) for k in range(50)]  # a function of k
        assert min(draws) >= 1 and max(draws) == CAP
        assert at_cap[0] <= draws.count(CAP) / len(draws) <= at_cap[1]
        assert 0.8 * median <= statistics.median(draws) <= 1.25 * median
    with pytest.raises(ValueError, match="--lengths"):
        make_lengths("medium", CAP, 0)


def test_sync_steps_last_as_long_as_their_longest_sample():
    row, engine = _run(False, 1.0)
    length = make_lengths("heavy", CAP, 0)
    per_step = [[length(k) for k in range(s * B * G, (s + 1) * B * G)] for s in range(STEPS)]
    assert row["step_s"] == [max(x) for x in per_step]
    assert row["engine_steps"] == row["seconds"] == engine.steps == sum(map(max, per_step))
    assert row["tokens"] == sum(map(sum, per_step)) and row["undelivered"] == row["reprefilled_tokens"] == 0
    assert row["tokens_per_s"] == row["generated_tokens_per_s"] == row["tokens"] / engine.steps
    assert row["mean_batch"] == row["tokens"] / engine.steps  # one token per sample in flight per step
    assert row["mean_staleness"] == row["max_staleness"] == 0 and row["rounds"] == STEPS


@pytest.mark.parametrize("fraction", [0.25, 0.75])
def test_partial_keeps_the_batch_fuller_on_a_long_tail(fraction):
    sync, _ = _run(False, 1.0)
    row, _ = _run(True, fraction)
    generated = row["generated_tokens_per_s"] * row["seconds"]
    assert row["tokens"] + row["undelivered"] == pytest.approx(generated)
    assert row["mean_batch"] > 1.5 * sync["mean_batch"]
    assert row["engine_steps"] < sync["engine_steps"] and row["rounds"] > STEPS
    assert row["max_staleness"] >= 1 and row["reprefilled_tokens"] > 0
    assert row["mean_length"] < sync["mean_length"]  # short samples are delivered first


def test_bench_on_the_engine():
    policy = build_model(tiny_config().replace(vocab_size=256), seed=0).eval()
    common = {**COMMON, "steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "prompt_tokens": 2}
    rollouts = RolloutEngine(policy, ByteTokenizer(), torch.device("cpu"), torch.float32, max_num_seqs=4,
                             max_model_len=8, eos_token_ids=(), cuda_graphs=False)
    warm_up(rollouts, lambda: rollouts.sync(policy), 4, {**common, "length": make_lengths("heavy", 4, 0)})
    for partial in (False, True):
        row = run_mode(rollouts, lambda: rollouts.sync(policy), partial=partial, finish_fraction=0.5,
                       length=make_lengths("light", 4, 0), **common)
        assert row["tokens"] > 0 and row["seconds"] > 0 and len(row["step_s"]) == 2
