"""Rewards, advantages and losses against their formulas on hand-made numbers; the trainer's
per-token log-probabilities against a full forward."""

from __future__ import annotations

import math

import pytest
import torch

from openk3 import build_model
from openk3.posttrain.objective import (
    completion_logprobs,
    group_advantages,
    grpo_loss,
    k15_loss,
    kl_k3,
    length_rewards,
)

from .conftest import tiny_config


def test_length_rewards_k15():
    # lengths 10, 20, 30: lam = 0.5, 0, -0.5; wrong answers keep only the penalty
    assert length_rewards([10, 20, 30], [True, True, True]) == [0.5, 0.0, -0.5]
    assert length_rewards([10, 20, 30], [False, False, False]) == [0.0, 0.0, -0.5]
    assert length_rewards([7, 7], [True, False]) == [0.0, 0.0]


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])  # two groups of 3
    adv = group_advantages(r, 3, std_normalize=False)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]))
    norm = group_advantages(r, 3, std_normalize=True)
    std = torch.tensor([1.0, 0, 0]).std()
    torch.testing.assert_close(norm[:3], adv[:3] / (std + 1e-6))
    assert group_advantages(torch.ones(4), 2, True).abs().max() == 0


def test_grpo_loss_formula_and_clipping():
    logp = torch.tensor([[math.log(0.5), math.log(0.9)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.9)]])  # ratios 2.0 and 1.0
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.tensor([[True, True]])
    loss = grpo_loss(logp, old, adv, mask, clip_eps=0.2)
    # token 0: min(2 * 1, 1.2 * 1) = 1.2 (clipped: no gradient); token 1: min(-1, -1) = -1
    assert loss.item() == pytest.approx(-(1.2 - 1.0))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 1.0]]))  # d(-rho A)/dlogp = -rho A
    masked = grpo_loss(logp, old, adv, torch.tensor([[False, True]]), 0.2)
    assert masked.item() == pytest.approx(1.0)


def test_k15_loss_formula():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    old = torch.tensor([[-1.5, -2.0], [-0.5, -9.0]])
    mask = torch.tensor([[True, True], [True, False]])
    r = torch.tensor([0.5, -0.5])
    tau = 0.1
    # sequence log-ratios: 0.5 and 0 (the masked token does not count)
    want = (0.5 - tau * 0.5) ** 2 + (-0.5 - 0) ** 2
    assert k15_loss(logp, old, r, mask, tau).item() == pytest.approx(want)


def test_kl_k3():
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert kl_k3(logp, logp, mask).item() == 0
    ref = torch.tensor([[-1.5, -1.0]])
    d = ref - logp
    assert kl_k3(logp, ref, mask).item() == pytest.approx(float((d.exp() - d - 1).sum()))


def test_completion_logprobs_match_full_forward():
    torch.manual_seed(0)
    model = build_model(tiny_config(kda=True), seed=0)
    prompts, completions = [[3, 4, 5], [6]], [[7, 8], [9, 10, 11, 12]]
    logp, mask = completion_logprobs(model, prompts, completions)
    assert mask.tolist() == [[True, True, False, False], [True] * 4]
    for b, (p, c) in enumerate(zip(prompts, completions)):
        full = torch.log_softmax(model(torch.tensor([p + c])).logits[0].float(), -1)
        want = torch.stack([full[len(p) - 1 + j, t] for j, t in enumerate(c)])
        torch.testing.assert_close(logp[b, :len(c)], want, atol=1e-5, rtol=1e-5)
    logp.sum().backward()  # differentiable, through the checkpointed head
    assert model.lm_head.weight.grad is not None
