"""Draft losses: a hand-computed example, the row-by-row float64 reference, gradients (gradcheck;
none reach the target), q = p, TV = 1 - alpha, the ignore mask, argument errors, and small
optimisations in which each loss raises the acceptance of a free draft."""

import math
from statistics import fmean

import pytest
import torch

import openk3.train.draft_loss as dl
from openk3.train.draft_loss import (
    acceptance_rate,
    kl_loss,
    lk_alpha_loss,
    lk_lambda_loss,
    tv_distance,
)

LOSSES = {"kl": kl_loss, "tv": tv_distance, "lk_alpha": lk_alpha_loss, "lk_lambda": lk_lambda_loss}


def draft_losses_ref(target_logits, draft_logits, ignore=None, eta=dl.DEFAULT_ETA) -> dict:
    """The reference: each row on its own in float64, straight from the formulas."""
    kl, tv, alpha = [], [], []
    for i in range(target_logits.shape[0]):
        if ignore is not None and ignore[i]:
            continue
        p = torch.softmax(target_logits[i].double(), -1)
        q = torch.softmax(draft_logits[i].double(), -1)
        kl.append(sum(float(px * math.log(px / qx)) for px, qx in zip(p, q) if px > 0))
        tv.append(0.5 * float((p - q).abs().sum()))
        alpha.append(sum(min(float(px), float(qx)) for px, qx in zip(p, q)))
    if not kl:
        return dict.fromkeys(LOSSES, 0.0)
    lam = math.exp(-eta * fmean(alpha))
    return {"kl": fmean(kl), "tv": fmean(tv), "lk_alpha": fmean([-math.log(a) for a in alpha]),
            "lk_lambda": lam * fmean(kl) + (1 - lam) * fmean(tv)}


def _logits(N=37, V=11, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, V, generator=g) * scale, torch.randn(N, V, generator=g) * scale


def test_hand_computed_example():
    # p = (1/2, 1/2), q = (1/4, 3/4): alpha = 1/4 + 1/2, TV = 1/4, KL = 1/2 ln 2 + 1/2 ln(2/3)
    t = torch.tensor([[0.0, 0.0]])
    d = torch.tensor([[0.0, math.log(3.0)]])
    kl = 0.5 * math.log(4 / 3)
    lam = math.exp(-3 * 0.75)
    want = {"kl": kl, "tv": 0.25, "lk_alpha": -math.log(0.75), "lk_lambda": lam * kl + (1 - lam) * 0.25}
    for name, fn in LOSSES.items():
        assert fn(t, d).item() == pytest.approx(want[name], rel=1e-6), name
    assert acceptance_rate(t, d).item() == pytest.approx(0.75)
    assert lk_lambda_loss(t, d, eta=0.0).item() == pytest.approx(kl, rel=1e-6)  # eta = 0: pure KL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_against_reference(dtype):
    t, d = _logits()
    ignore = torch.zeros(37, dtype=torch.bool)
    ignore[::5] = True
    t[1, :4] = float("-inf")  # a filtered target: 0 log 0 = 0
    ref = draft_losses_ref(t.to(dtype), d.to(dtype), ignore)
    for name, fn in LOSSES.items():
        got = fn(t.to(dtype), d.to(dtype), ignore)
        assert got.dtype == torch.float32
        assert got.item() == pytest.approx(ref[name], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("name", ["kl", "tv", "lk_alpha"])
def test_gradcheck(name):
    t, d = _logits(N=4, V=5, seed=1)
    ignore = torch.tensor([False, True, False, False])
    d = d.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: LOSSES[name](t.double(), x, ignore), (d,))


def test_lk_lambda_gradient_is_the_blend_with_lambda_held_fixed():
    t, d = _logits(N=6, V=7, seed=2)
    d = d.double().requires_grad_()
    lam = math.exp(-dl.DEFAULT_ETA * acceptance_rate(t.double(), d).item())
    (got,) = torch.autograd.grad(lk_lambda_loss(t.double(), d), d)
    g_kl, g_tv = (torch.autograd.grad(fn(t.double(), d), d)[0] for fn in (kl_loss, tv_distance))
    torch.testing.assert_close(got, lam * g_kl + (1 - lam) * g_tv)


def test_no_gradient_reaches_the_target():
    t, d = _logits(N=5, V=6)
    t.requires_grad_()
    d.requires_grad_()
    for fn in LOSSES.values():
        fn(t, d).backward()
    assert t.grad is None and d.grad is not None and torch.isfinite(d.grad).all()


def test_equal_distributions():
    t, _ = _logits(N=8, V=9)
    assert acceptance_rate(t, t).item() == pytest.approx(1.0, abs=1e-6)
    for name, fn in LOSSES.items():
        assert abs(fn(t, t).item()) < 1e-6, name
    # a shift of the logits is the same distribution
    assert kl_loss(t, t + 3.0).item() == pytest.approx(0.0, abs=1e-6)


def test_tv_is_one_minus_alpha():
    for seed in range(3):
        t, d = _logits(seed=seed, scale=3.0)
        assert tv_distance(t, d).item() == pytest.approx(1 - acceptance_rate(t, d).item(), abs=1e-6)


def test_ignore_mask():
    t, d = _logits(N=10, V=8)
    ignore = torch.tensor([True, False] * 5)
    d.requires_grad_()
    for name, fn in LOSSES.items():
        masked = fn(t, d, ignore)
        torch.testing.assert_close(masked, fn(t[~ignore], d[~ignore]))
        (grad,) = torch.autograd.grad(masked, d)
        assert (grad[ignore] == 0).all() and (grad[~ignore] != 0).any(), name
        everything = fn(t, d, torch.ones(10, dtype=torch.bool))   # all ignored: 0, not NaN
        assert everything.item() == 0.0
        (grad,) = torch.autograd.grad(everything, d)
        assert (grad == 0).all(), name


@pytest.mark.parametrize("name", list(LOSSES))
def test_each_loss_raises_the_acceptance(name):
    # a free draft (its logits are the parameters), starting uniform, against peaked targets
    t, _ = _logits(N=8, V=16, seed=4, scale=3.0)
    d = torch.zeros(8, 16, requires_grad=True)
    opt = torch.optim.Adam([d], lr=0.3)
    start = acceptance_rate(t, d).item()
    for _ in range(40):
        opt.zero_grad()
        LOSSES[name](t, d).backward()
        opt.step()
    end = acceptance_rate(t, d).item()
    assert start < 0.5 and end > 0.95, (start, end)


def test_limited_capacity_lk_accepts_more_than_kl():
    # One draft distribution q = (c, 1 - c) for three targets p(0) = 0.9, 0.9, 0 (a draft that
    # cannot tell them apart). Row acceptances: c + 0.1, c + 0.1, 1 - c (c <= 0.9), mean
    # (1.2 + c) / 3. Optima: TV c = 0.9 (0.70); KL the targets' mixture c = 0.6 (0.60);
    # LK_alpha, -2 log(c + 0.1) - log(1 - c), c = 0.633 (0.61); LK_lambda, mostly TV once
    # lambda = exp(-3 alpha) ~ 0.13, c ~ 0.85 (~0.68).
    t = torch.tensor([[math.log(0.9), math.log(0.1)]] * 2 + [[-20.0, 0.0]])
    accepted = {}
    for name, fn in LOSSES.items():
        shared = torch.zeros(1, 2, requires_grad=True)
        opt = torch.optim.Adam([shared], lr=0.15)
        for _ in range(60):
            opt.zero_grad()
            fn(t, shared.expand(3, 2)).backward()
            opt.step()
        accepted[name] = acceptance_rate(t, shared.detach().expand(3, 2)).item()
    want = {"kl": 0.6, "tv": 0.7, "lk_alpha": 0.611, "lk_lambda": 0.684}
    assert all(abs(accepted[k] - want[k]) < 0.01 for k in want), accepted


@pytest.mark.parametrize("args,name", [
    ((torch.zeros(3, 5), torch.zeros(3)), "draft_logits"),
    ((torch.zeros(0, 5), torch.zeros(0, 5)), "draft_logits"),
    ((torch.zeros(3, 4), torch.zeros(3, 5)), "target_logits"),
    ((torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, 5)), "target_logits"),
    ((torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(3)), "ignore"),
    ((torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(2, dtype=torch.bool)), "ignore"),
])
def test_bad_arguments_are_named(args, name):
    for fn in LOSSES.values():
        with pytest.raises(ValueError, match=name):
            fn(*args)
    with pytest.raises(ValueError, match="eta"):
        lk_lambda_loss(torch.zeros(1, 2), torch.zeros(1, 2), eta=-1.0)


def test_docstring_examples():
    from tests.ops.checks import run_doctests
    run_doctests(dl)
