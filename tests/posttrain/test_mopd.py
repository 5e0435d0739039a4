"""MOPD: the per-token reward equals clip(log pi_T - log pi_S, -R, R) on hand-made
log-probabilities; teachers are picked by (domain, effort)."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.posttrain.config import PostTrainConfig, check_teacher_coverage, parse_teacher
from openk3.posttrain.mopd import Teachers, mopd_rewards


def test_reward_formula():
    teacher = torch.tensor([[math.log(0.5), math.log(0.1), -30.0, 0.0]])
    student = torch.tensor([[math.log(0.25), math.log(0.4), -1.0, -20.0]], requires_grad=True)
    r = mopd_rewards(teacher, student, clip=5.0)
    want = [math.log(2.0), math.log(0.25), -5.0, 5.0]  # the last two clipped to [-R, R]
    assert r[0].tolist() == pytest.approx(want)
    assert not r.requires_grad  # stop-gradient


def test_parse_teacher_and_config_checks():
    assert parse_teacher("math:high=runs/t1") == ("math", "high", "runs/t1")
    assert parse_teacher("code:*=a=b") == ("code", "*", "a=b")
    for bad in ("math=runs/t", "math:extreme=x", ":high=x", "math:high="):
        with pytest.raises(ValueError, match="--teacher"):
            parse_teacher(bad)
    with pytest.raises(ValueError, match="--loss"):
        PostTrainConfig(checkpoint="x", teacher=("math:high=x",), loss="k15")
    with pytest.raises(ValueError, match="a teacher for math:high is already given"):
        PostTrainConfig(checkpoint="x", teacher=("math:high=x", "math:high=y"))
    # every task's domain at every effort the run can draw, before a model loads
    cfg = PostTrainConfig(checkpoint="x", teacher=("math:*=x",), effort="mixed")
    check_teacher_coverage(cfg, [("arithmetic", "math")])
    with pytest.raises(ValueError, match="no teacher for --task 'sorting' .domain 'text'. at effort 'low'"):
        check_teacher_coverage(cfg, [("arithmetic", "math"), ("sorting", "text")])
    cfg = PostTrainConfig(checkpoint="x", teacher=("math:high=x", "math:low=x"), effort="mixed")
    with pytest.raises(ValueError, match="at effort 'medium': add math:medium=PATH or math:.=PATH"):
        check_teacher_coverage(cfg, [("arithmetic", "math")])


def test_teacher_picked_by_domain_and_effort(tiny_checkpoint):
    t = Teachers((f"toy:high={tiny_checkpoint}", f"toy:*={tiny_checkpoint}", f"code:low={tiny_checkpoint}"),
                 torch.device("cpu"), torch.float32, student_vocab=18)
    assert t.pick("toy", "high") == ("toy", "high")
    assert t.pick("toy", "low") == ("toy", "*")
    assert t.pick("code", "low") == ("code", "low")
    with pytest.raises(ValueError, match="no teacher for domain 'code' at effort 'high'"):
        t.pick("code", "high")
    assert len({id(m) for m in t.models.values()}) == 1  # one path: loaded once
    with pytest.raises(ValueError, match="vocab_size"):
        Teachers((f"toy:high={tiny_checkpoint}",), torch.device("cpu"), torch.float32, student_vocab=99)
    with pytest.raises(ValueError, match=r"--teacher 'toy:high=/nonexistent': checkpoint='/nonexistent': no such directory"):
        Teachers(("toy:high=/nonexistent",), torch.device("cpu"), torch.float32, student_vocab=99)
