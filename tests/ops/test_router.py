"""The MoE router's choice (``openk3.ops.router``): the reference on hand-made numbers, the
group-limited routing of ``Router``, and the Triton kernel against the reference (in Triton's
interpreter on the CPU, and on the GPU)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import openk3.ops.router as router_ops
from openk3 import preset
from openk3.model.moe import Router
from openk3.ops.router import router_logits, router_topk, router_topk_ref
from tests.ops.checks import run_doctests, run_triton_interpreted


def test_reference_on_hand_made_numbers():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0], [3.0, -3.0, 0.0, 0.5]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])  # expert 2 always chosen, weighted by its own score
    s = torch.sigmoid(logits)
    scores, idx, w = router_topk_ref(logits, bias, k=2, scale=2.0)
    assert torch.equal(scores, s)
    assert idx.tolist() == [[2, 1], [2, 0]]
    want = torch.stack([s[0, [2, 1]], s[1, [2, 0]]])
    torch.testing.assert_close(w, 2.0 * want / want.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    _, _, raw = router_topk_ref(logits, bias, k=2, renormalize=False)
    assert torch.equal(raw, want)


def test_group_limited_routing_never_picks_a_dropped_group():
    cfg = preset("debug").replace(num_experts=8, num_experts_per_token=2, num_expert_group=4, topk_group=2)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(64, cfg.hidden_size)
    scores, idx, w = router(x)
    biased = scores + router.e_score_correction_bias
    group_score = biased.view(64, 4, 2).sum(-1)  # top-2 of a group of 2 is the whole group
    kept = group_score.topk(2, dim=-1).indices
    for t in range(64):
        assert set((idx[t] // 2).tolist()) <= set(kept[t].tolist())
        best = biased[t].view(4, 2)[kept[t]].flatten().topk(2).values
        torch.testing.assert_close(biased[t, idx[t]], best)


@pytest.mark.parametrize("name,kwargs,match", [
    ("logits", dict(logits=torch.randn(3, 4, 1)), "must be"),
    ("bias", dict(bias=torch.zeros(5)), "must be"),
    ("k", dict(k=5), "k = 5"),
    ("backend", dict(backend="cuda"), "backend"),
])
def test_rejects_bad_arguments(name, kwargs, match):
    args = {"logits": torch.randn(3, 4), "bias": torch.zeros(4), "k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        router_topk(**args)


@pytest.mark.parametrize("x,w,kwargs,match", [
    (torch.randn(3, 8, 1), torch.randn(4, 8), {}, "must be"),
    (torch.randn(3, 8), torch.randn(4, 7), {}, "must be"),
    (torch.randn(3, 8), torch.randn(4, 8), dict(backend="cuda"), "backend"),
    (torch.randn(3, 8, requires_grad=True), torch.randn(4, 8), dict(backend="triton"), "no backward"),
])
def test_logits_reject_bad_arguments(x, w, kwargs, match):
    with pytest.raises(ValueError, match=match):
        router_logits(x, w, **kwargs)


@pytest.mark.parametrize("x,k,match", [
    (torch.rand(5, 8), 9, "k = 9"),
    (torch.rand(5, 8), 0, "k = 0"),
    (torch.rand(5, 8), 2, "backend"),
])
def test_kth_largest_rejects_bad_arguments(x, k, match):
    with pytest.raises(ValueError, match=match):
        router_ops.kth_largest(x, k, backend="cuda" if match == "backend" else "auto")


def test_kth_largest_reference_on_hand_made_numbers():
    scores = torch.tensor([[[0.9, 0.5, 0.5, 0.1]], [[0.2, 0.4, 0.6, 0.8]]])
    bias = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, -0.5]])
    got = router_ops.kth_largest(scores + bias[:, None], 3)  # ties count: 0.5 twice
    assert got.tolist() == [[0.5], [pytest.approx(0.4)]]


def test_logits_are_fp32_under_autocast():
    # training runs under autocast, which would make the linear a bf16 one (logits rounded to 8
    # bits, the QB margins with them)
    x, w = torch.randn(5, 64, dtype=torch.bfloat16, requires_grad=True), torch.randn(4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router_logits(x, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x.float() @ w.T, rtol=0, atol=0)
    out.sum().backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_logits_reference_is_an_fp32_linear_and_takes_gradients():
    x, w = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    out = router_logits(x, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x.float() @ w.T, rtol=0, atol=0)
    out.sum().backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize("N,D,E", [(40, 256, 16), (7, 100, 5)])
def test_split_logits_are_fp32_logits_and_gradients(N, D, E):
    """The weight in two bf16 halves: logits and the weight's gradient within 2^-15 of each
    entry's sum of |products| (fp32 products keep 24 bits, the halves 16), x's gradient within
    its bf16 rounding; under autocast as without it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=gen).bfloat16().requires_grad_()
    w = (0.05 * torch.randn(E, D, generator=gen)).requires_grad_()
    g = torch.randn(N, E, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router_logits(x, w, backend="split")
    assert out.dtype == torch.float32
    out.backward(g)
    x64, w64, g64 = x.detach().double(), w.detach().double(), g.double()
    for got, want, scale, rel in ((out, x64 @ w64.T, x64.abs() @ w64.abs().T, 2 ** -15),
                                  (w.grad, g64.T @ x64, g64.abs().T @ x64.abs(), 2 ** -15),
                                  (x.grad, g64 @ w64, g64.abs() @ w64.abs(), 2 ** -7)):
        assert got.dtype in (torch.float32, torch.bfloat16)
        assert ((got.double() - want).abs() <= rel * scale).all(), ((got.double() - want).abs() / scale).max()
    # and it is not the plain bf16 linear: its logits are ~2^-9 off
    assert ((x64 @ w.detach().bfloat16().double().T - x64 @ w64.T).abs() > 2 ** -15 * (x64.abs() @ w64.abs().T)).any()


def test_split_logits_reject_other_dtypes():
    with pytest.raises(ValueError, match="bf16"):
        router_logits(torch.randn(3, 8), torch.randn(4, 8), backend="split")


def test_docstring_examples_run():
    run_doctests(router_ops)


_INTERPRETED = """
import torch
from openk3.ops.router import _router_topk_triton, router_topk_ref
torch.manual_seed(0)
# small's router (64 experts, 4 per token) and K3's (896, 16), renormalised and not, scaled
for N, E, k, renorm, scale in ((5, 64, 4, True, 1.0), (3, 896, 16, True, 2.5), (2, 10, 3, False, 1.0)):
    logits, bias = torch.randn(N, E), 0.1 * torch.randn(E)
    got = _router_topk_triton(logits, bias, k, renorm, scale)
    want = router_topk_ref(logits, bias, k, renorm, scale)
    assert torch.equal(got[1], want[1]), (got[1], want[1])
    for g, w in zip(got[::2], want[::2]):
        assert (g - w).abs().max() < 1e-6, (g - w).abs().max()
# with autograd (training) the kernel picks the experts; scores and weights carry the reference's
# gradients
from openk3.ops.router import router_topk
logits, bias = torch.randn(6, 64), 0.1 * torch.randn(64)
got, want = [], []
for backend, out in (("triton", got), ("torch", want)):
    leaf = logits.clone().requires_grad_()
    scores, idx, w = router_topk(leaf, bias, 4, True, 2.0, backend=backend)
    (w * torch.arange(4.0)).sum().backward()
    out += [scores, idx, w, leaf.grad]
assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (got[1], want[1])
for g, w in zip(got[2:], want[2:]):
    assert (g - w).abs().max() < 1e-6, (g - w).abs().max()
# Quantile Balancing's thresholds: the k-th largest of scores + bias, several routers side by
# side, ties among the largest (they count), sizes that fill no tile
from openk3.ops.router import kth_largest
import openk3.ops.router as router_ops
router_ops.TOPK_TILE = 256  # rows past 1,024 take the long-row kernel for any k (sizes the interpreter runs quickly)
for shape, k in (((3, 37, 64), 5), ((2, 5, 10), 3), ((1, 1, 896), 17), ((2, 3, 333), 40), ((1, 2, 1100), 1),
                 ((1, 2, 1100), 3), ((1, 2, 4096), 4096), ((2, 1, 2500), 1001)):
    scores, bias = torch.rand(shape), 0.01 * torch.randn(shape[0], shape[2])
    scores[0, 0, :3] = 2.0
    got = kth_largest(scores + bias[:, None], k, backend="triton")
    want = (scores + bias[:, None]).topk(k, dim=-1).values[..., k - 1]
    assert torch.equal(got, want), (shape, k, (got - want).abs().max())
from openk3.ops.router_triton import kth_largest_long_kernel
# the long-row kernel's bisection on the ordered bits: negative values, -0.0 and +0.0, +-inf,
# NaN (counts as +inf), ties across the threshold
x = torch.tensor([[-3.5, -0.0, 0.0, 2.0, 2.0, float("inf"), float("-inf"), -1e-30, 7.0, float("nan")]])
for k in range(1, 11):
    want = torch.where(x.isnan(), float("inf"), x).topk(k).values[:, k - 1]
    got = torch.empty(1)
    kth_largest_long_kernel[(1,)](x, got, 10, k, BLOCK_E=16)
    assert torch.equal(got, want), (k, got, want)  # -0.0 == 0.0: topk may name either
# a bias of -inf on all but two experts: the kernel still names k distinct experts (the
# reference's -inf ties may come in any order)
bias = torch.full((8,), float("-inf"))
bias[[3, 6]] = 0.0
_, idx, _ = _router_topk_triton(torch.randn(2, 8), bias, 4, True, 1.0)
assert all(len(set(row)) == 4 and set(row[:2]) == {3, 6} for row in idx.tolist()), idx
# training's path writes no scores of its own
scores, _, _ = _router_topk_triton(torch.randn(2, 8), torch.zeros(8), 2, True, 1.0, write_scores=False)
assert scores.numel() == 0
# a NaN hidden state: NaN ranks first (as in torch.topk) and every id stays in 0..E-1
logits = torch.randn(3, 10)
logits[0] = float("nan")
logits[1, [2, 7]] = float("nan")
_, idx, _ = _router_topk_triton(logits, torch.zeros(10), 4, True, 1.0)
assert ((idx >= 0) & (idx < 10)).all(), idx
assert idx[0].unique().numel() == 4 and set(idx[1, :2].tolist()) == {2, 7}, idx
# the logits GEMV: small's router (d 1024, 64 experts) on bf16 tokens, and sizes that fill no
# tile (d 300 over columns of 256, 10 experts over rows of 4), fp32 tokens
from openk3.ops.router import _router_logits_triton
for N, D, E, dtype in ((3, 1024, 64, torch.bfloat16), (2, 300, 10, torch.float32)):
    x, w = torch.randn(N, D).to(dtype), torch.randn(E, D)
    got, want = _router_logits_triton(x, w), x.float() @ w.T
    assert got.dtype == torch.float32 and got.shape == (N, E)
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
print("ok")
"""


def test_kernel_in_the_triton_interpreter():
    """The Triton kernels on the CPU (TRITON_INTERPRET=1): the same experts, in the same order,
    and the same scores and weights as the reference; the logits as an fp32 linear."""
    run_triton_interpreted(_INTERPRETED)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("N,E,k", [(1, 64, 4), (128, 64, 4), (32, 896, 16)])
def test_kernel_matches_reference_gpu(N, E, k):
    logits, bias = torch.randn(N, E, device="cuda"), 0.1 * torch.randn(E, device="cuda")
    got = router_topk(logits, bias, k)
    want = router_topk(logits, bias, k, backend="torch")
    # the kernel's sigmoid rounds differently (~1e-7): near-ties may swap, so the chosen biased
    # scores are compared, not the ids
    biased = want[0] + bias
    torch.testing.assert_close(biased.gather(1, got[1]), biased.gather(1, want[1]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[2].sort(-1).values, want[2].sort(-1).values, rtol=1e-5, atol=1e-7)
    logits[0] = float("nan")  # a NaN hidden state still names experts in range
    idx = router_topk(logits, bias, k)[1]
    assert ((idx >= 0) & (idx < E)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("L,N,E,k", [(23, 16384, 64, 5), (2, 100, 896, 17), (1, 3, 10, 1),
                                     (23, 64, 16384, 1025), (2, 3, 9999, 33), (1, 3, 9999, 5),
                                     (1, 2, 16384, 16384)])
def test_kth_largest_matches_topk_gpu(L, N, E, k):
    """Short rows (the per-token thresholds) and long ones (the per-expert thresholds over
    `small`'s 16,384 tokens: the bisection kernel)."""
    scores, bias = torch.rand(L, N, E, device="cuda"), 0.01 * torch.randn(L, E, device="cuda")
    scores[0, :5, :2] = 0.5  # ties
    got = router_ops.kth_largest(scores + bias[:, None], k)
    want = router_ops.kth_largest(scores + bias[:, None], k, backend="torch")
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_router_takes_the_kernels_choice_and_the_references_gradient():
    # small's training shape: 16,384 tokens, 64 experts, 4 per token
    logits, bias = torch.randn(16384, 64, device="cuda"), 0.1 * torch.randn(64, device="cuda")
    cot = torch.randn(16384, 4, device="cuda")
    out = {}
    for backend in ("auto", "torch"):
        leaf = logits.clone().requires_grad_()
        scores, idx, w = router_topk(leaf, bias, 4, backend=backend)
        (w * cot).sum().backward()
        out[backend] = (scores, idx, w, leaf.grad)
    (s, i, w, g), (s_ref, i_ref, w_ref, g_ref) = out["auto"], out["torch"]
    same = (i == i_ref).all(-1)  # near-ties may swap (the kernel's sigmoid rounds differently)
    assert same.float().mean() > 0.999, same.float().mean()
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)  # autograd's sigmoid in both
    torch.testing.assert_close(w[same], w_ref[same], rtol=0, atol=0)
    torch.testing.assert_close(g[same], g_ref[same], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("N,D,E", [(1, 1024, 64), (128, 1024, 64), (3, 7168, 896), (5, 300, 10)])
def test_logits_kernel_matches_reference_gpu(N, D, E):
    """The GEMV kernel (decode) and, with gradients, the split GEMMs (training and prefill)."""
    x, w = torch.randn(N, D, device="cuda", dtype=torch.bfloat16), torch.randn(E, D, device="cuda")
    got = router_logits(x, w, backend="triton")
    want = x.double() @ w.double().T  # fp32 sums of d products: error ~ sqrt(d) * 6e-8 * |terms|
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5 * D ** 0.5)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    with mock.patch.object(router_ops._SplitLogits, "apply", wraps=router_ops._SplitLogits.apply) as halves:
        router_logits(xs, ws)
    assert halves.called  # "auto" with gradients takes the halves
    with torch.autocast("cuda", dtype=torch.bfloat16):
        split = router_logits(xs, ws, backend="split")
    g = torch.randn_like(split)
    split.backward(g)
    x64, w64, g64 = x.double(), w.double(), g.double()
    for got, want, scale, rel in ((split, want, x64.abs() @ w64.abs().T, 2 ** -15),
                                  (ws.grad, g64.T @ x64, g64.abs().T @ x64.abs(), 2 ** -15),
                                  (xs.grad, g64 @ w64, g64.abs() @ w64.abs(), 2 ** -7)):
        assert ((got.double() - want).abs() <= rel * scale).all(), ((got.double() - want).abs() / scale).max()
