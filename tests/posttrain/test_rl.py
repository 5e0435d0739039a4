"""The RL loop end to end on a tiny policy and a toy task: the reward rises (GRPO; k1.5 runs in
the CLI test), every option runs (partial rollouts with staleness, efforts with the length
penalty, KL to the reference, MOPD), resume continues the run, a non-finite loss stops it with
the last checkpoint intact, and the CLI wires it up."""

from __future__ import annotations

import json
import math

import pytest
import torch

from openk3.cli import main
from openk3.posttrain.config import PostTrainConfig
from openk3.posttrain.partial import Trajectory
from openk3.posttrain.rl import cut_resumed_at_stop, run
from openk3.tokenizer import ByteTokenizer
from openk3.train import state as ckpt
from openk3.train.trainer import TrainingDiverged

from .conftest import FixedAnswerTask

pytestmark = pytest.mark.sandbox  # one such test at a time on the machine (conftest.py)

BASE = dict(task=("fixed",), prompts_per_step=4, group_size=8, max_new_tokens=2, max_model_len=24,
            lr=1e-2, device="cpu")


def test_reward_rises(tiny_checkpoint, tmp_path):
    cfg = PostTrainConfig(checkpoint=str(tiny_checkpoint), out=str(tmp_path / "run"), max_steps=8,
                          ckpt_interval=100, **BASE)
    r = run(cfg, tasks=[FixedAnswerTask()])["rewards"]
    # a random policy answers "7" 1 time in 18; eight steps of RL make it the usual answer
    assert sum(r[:2]) / 2 < 0.2 and sum(r[-2:]) / 2 > 0.5, r


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_option_and_resume(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    # groups of 2 with up to 12 tokens: a round ends (half finished, one group complete) while
    # others are still generating
    opts = dict(BASE, prompts_per_step=8, group_size=2, max_new_tokens=12, finish_fraction=0.5, effort="mixed", length_penalty_low=1.0,
                kl_coef=0.1, teacher=(f"toy:*={tiny_checkpoint}",), mopd_weight=0.5, ckpt_interval=1)
    cfg = PostTrainConfig(checkpoint=str(tiny_checkpoint), out=str(out), max_steps=2, **opts)
    run(cfg, tasks=[FixedAnswerTask()])
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward", "accuracy", "length_mean", "staleness_mean", "staleness_max", "mopd_reward", "kl"):
        assert all(key in r for r in rows), key
    assert rows[0]["staleness_max"] == 0
    assert any(r["resumed"] > 0 for r in rows)  # partial rollouts interrupted some trajectories
    assert any(r["staleness_max"] > 0 for r in rows)
    assert (out / "export" / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="already holds a run"):
        run(cfg, tasks=[FixedAnswerTask()])
    state = json.loads((ckpt.latest_checkpoint(out) / ckpt.TRAINER_FILE).read_text())
    in_flight = {t["uid"] for g in state["rollouts"]["groups"] for t in g["members"]}
    resumed = PostTrainConfig(checkpoint=str(tiny_checkpoint), out=str(out), max_steps=3, resume=True, **opts)
    summary = run(resumed, tasks=[FixedAnswerTask()])
    assert summary["start_step"] == 2 and summary["end_step"] == 3
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]
    state = json.loads((ckpt.latest_checkpoint(out) / ckpt.TRAINER_FILE).read_text())
    assert state["version"] == 3 and state["step"] == 3
    still = {t["uid"] for g in state["rollouts"]["groups"] for t in g["members"]}
    assert min(still | {10**9}) >= min(in_flight | {10**9})  # the in-flight ones were continued, not dropped


def test_nan_stops_with_last_checkpoint_intact(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    cfg = PostTrainConfig(checkpoint=str(tiny_checkpoint), out=str(out), max_steps=3, ckpt_interval=1, **BASE)

    def poison(step, loss):
        return loss * float("nan") if step == 2 else loss

    with pytest.raises(TrainingDiverged, match="last good checkpoint is step 1"):
        run(cfg, tasks=[FixedAnswerTask()], loss_hook=poison)
    assert ckpt.latest_checkpoint(out).name == "step_000001"
    assert [r["step"] for r in _rows(out)] == [1]


def test_cli_rl_and_distill(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from openk3.posttrain import rl

    monkeypatch.setattr(rl, "_tasks", lambda cfg: [FixedAnswerTask()])
    common = ["--checkpoint", str(tiny_checkpoint), "--task", "fixed", "--prompts-per-step", "2",
              "--group-size", "4", "--max-new-tokens", "2", "--max-model-len", "16", "--max-steps", "1",
              "--device", "cpu"]
    assert main(["rl", *common, "--out", str(tmp_path / "rl"), "--loss", "k15"]) == 0
    assert (tmp_path / "rl" / "plots" / "reward.png").exists()
    assert "reward" in capsys.readouterr().err
    assert main(["distill", *common, "--out", str(tmp_path / "d")]) == 2  # no teacher
    assert main(["distill", *common, "--out", str(tmp_path / "d"), "--teacher", f"toy:*={tiny_checkpoint}"]) == 0
    saved = json.loads((tmp_path / "d" / "run_config.json").read_text())["posttrain"]
    assert saved["reward_weight"] == 0.0 and saved["teacher"] == [f"toy:*={tiny_checkpoint}"]
    assert main(["rl", *common, "--out", str(tmp_path / "rl"), "--resume", "--lr", "0.5"]) == 2  # conflict


def test_a_steps_completions_are_scored_together_each_as_its_task_scores_it(tiny_checkpoint, monkeypatch):
    """``_score``: one ``score_all`` call per task over all the step's groups (the sandbox's
    workers then run across groups), and every row gets the score its own task gives it, in
    group order, with its group's length reward and reward weight."""
    import random

    from openk3.posttrain import rl
    from openk3.posttrain.partial import Group, Trajectory
    from openk3.posttrain.tasks import get_task
    from openk3.tokenizer import ByteTokenizer

    tok, rng = ByteTokenizer(), random.Random(0)
    tasks = [get_task("python", num_tests=2), get_task("arithmetic")]
    groups, want = [], []
    for uid in range(4):  # python, arithmetic, python, arithmetic
        task = tasks[uid % 2]
        problem = task.sample(rng)
        texts = [problem.answer, "", problem.answer + " + 1", problem.answer] if uid % 2 == 0 else \
            [problem.answer, "0", problem.answer + "9", problem.answer]
        members = [Trajectory(uid * 10 + j, uid, 8, tokens=tok.encode(t), logprobs=[0.0] * len(tok.encode(t)),
                              versions=[0] * len(tok.encode(t)), finish_reason="stop") for j, t in enumerate(texts)]
        groups.append(Group(uid, tok.encode(problem.prompt), {"task": uid % 2, "problem": problem,
                                                                "effort": "none", "teacher_ids": []},
                            members, tuple(problem.stop)))
        want += [task.score(problem, t) for t in texts]
    calls = []
    real = rl.score_all
    monkeypatch.setattr(rl, "score_all", lambda task, ps, cs, max_workers: calls.append((task.name, len(ps),
                                                                                          max_workers))
                        or real(task, ps, cs, max_workers))
    cfg = PostTrainConfig(checkpoint="x", reward_weight=0.5, score_workers=3)
    rows = rl._score(groups, tasks, tok, (), cfg)
    assert sorted(calls) == [("arithmetic", 8, 3), ("python", 8, 3)]
    assert rows["score"] == want and sorted(set(want)) == [0.0, 1.0]
    assert rows["correct"] == [s >= 1.0 for s in want] and rows["reward"] == [0.5 * s for s in want]
    assert [len(t) for t in rows["tokens"]] == [len(t.tokens) for g in groups for t in g.members]


@pytest.mark.parametrize("loss", ["grpo", "k15"])
def test_micro_batches_accumulate_the_whole_batchs_gradient(loss):
    """``_update`` with micro-batches of 3 rows gives the gradient of one pass over all 16 rows
    (losses are sums over the step's totals), rows of different lengths and staleness."""
    import random
    from contextlib import nullcontext
    from types import SimpleNamespace

    from openk3 import build_model, preset
    from openk3.posttrain import rl

    rng = random.Random(0)
    tokens = [[rng.randrange(1, 200) for _ in range(rng.randint(1, 6))] for _ in range(16)]
    batch = {"prompt": [[rng.randrange(1, 200) for _ in range(rng.randint(2, 5))] for _ in tokens],
             "tokens": tokens, "logprobs": [[-rng.random() * 3 for _ in t] for t in tokens],
             "versions": [[rng.choice([2, 3]) for _ in t] for t in tokens],
             "reward": [float(rng.random() < 0.5) for _ in tokens], "score": [0.0] * 16,
             "correct": [False] * 16, "domain": ["math"] * 16, "effort": ["none"] * 16}
    grads = {}
    for mb in (3, 64):
        policy = build_model(preset("debug"), seed=0)

        class Capture:
            def step(self):
                grads[mb] = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

            def zero_grad(self, set_to_none=True):
                policy.zero_grad(set_to_none=set_to_none)

        parallel = SimpleNamespace(clip_grad_norm_=lambda max_norm: torch.tensor(0.0))
        cfg = PostTrainConfig(checkpoint="x", group_size=4, micro_batch_size=mb, loss=loss)
        row = rl._update(cfg, policy, [Capture()], parallel, nullcontext, batch, 3, None, None)
        assert math.isfinite(row["loss"])
    assert grads[3].keys() == grads[64].keys() and len(grads[3]) > 10
    for name, g in grads[64].items():
        torch.testing.assert_close(grads[3][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_a_resumed_trajectory_is_cut_at_a_stop_across_its_resume_point():
    """A partial rollout paused after "\\n" and resumed: its second request saw "\\n" again but
    not the first, so "\\n\\n" did not stop it. The trajectory is cut after the token that
    completes the stop, as one request would have been, with its log-probs and versions."""
    tok = ByteTokenizer()
    ids = tok.encode("1\n\n817>45\n")
    t = Trajectory(0, 0, 64, list(ids), [-0.5] * len(ids), [0, 0] + [1] * (len(ids) - 2), "length", segments=2)
    cut_resumed_at_stop(tok, t, ("\n\n", "\ndef "))
    assert tok.decode(t.tokens) == "1\n\n" and len(t.logprobs) == len(t.versions) == 3 and t.finish_reason == "stop"
    one = Trajectory(1, 0, 64, list(ids), [-0.5] * len(ids), [0] * len(ids), "length", segments=1)
    cut_resumed_at_stop(tok, one, ("\n\n",))  # one request: the engine's own stop search held
    assert one.tokens == ids and one.finish_reason == "length"
