"""RMSNorm, gated RMSNorm, SiTU-GLU and AttnRes aggregation against the spec and fla."""

import pytest
import torch

from openk3.ops.attnres import attn_res_agg, attn_res_agg_ref
from openk3.ops.norm import gated_rms_norm_ref, rms_norm_ref
from openk3.ops.situ import situ_glu_ref
from tests.helpers import load_fla_file


def test_rms_norm_formula_and_dtype():
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    w = torch.rand(64, dtype=torch.bfloat16) + 0.5
    xf = x.float()
    want = w * (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = rms_norm_ref(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gated_rms_norm_is_fp32_throughout():
    x, g = torch.randn(4, 7, 16, dtype=torch.bfloat16), torch.randn(4, 7, 16, dtype=torch.bfloat16)
    w = torch.rand(16) + 0.5
    xf = x.float()
    want = (w * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.sigmoid(g.float()))
    torch.testing.assert_close(gated_rms_norm_ref(x, w, g, 1e-5), want.to(torch.bfloat16), rtol=0, atol=0)


def test_situ_values_and_bound():
    gate = torch.tensor([0.0, 1.0, -3.0, 50.0, -50.0, 1e4])
    up = torch.tensor([1.0, 2.0, 100.0, 1e4, 1e4, 1e4])
    want = (4 * torch.tanh(gate / 4) * torch.sigmoid(gate)) * (25 * torch.tanh(up / 25))
    torch.testing.assert_close(situ_glu_ref(gate, up), want)
    big = torch.randn(10000) * 1e3
    h = situ_glu_ref(big, big.flip(0))
    assert h.abs().max() <= 100.0
    assert situ_glu_ref(torch.tensor([1e4]), torch.tensor([1e4])).item() == pytest.approx(100.0, rel=1e-4)
    # near the origin SiTU-GLU follows SwiGLU to first order: h ~ silu(g) * u
    g, u = torch.tensor([1e-3]), torch.tensor([2e-3])
    assert situ_glu_ref(g, u).item() == pytest.approx((torch.nn.functional.silu(g) * u).item(), rel=1e-3)
    # the sigmoid takes the uncapped gate: at gate=8, tanh cap gives 4*tanh(2), sigmoid(8) not sigmoid(4tanh2)
    assert situ_glu_ref(torch.tensor([8.0]), torch.tensor([25.0])).item() == pytest.approx(
        4 * torch.tanh(torch.tensor(2.0)).item() * torch.sigmoid(torch.tensor(8.0)).item()
        * 25 * torch.tanh(torch.tensor(1.0)).item(), rel=1e-6)


def test_attn_res_zero_query_is_mean():
    srcs = [torch.randn(2, 5, 32) * (i + 1) for i in range(4)]
    out = attn_res_agg(srcs, torch.zeros(32), torch.ones(32), 1e-5)
    torch.testing.assert_close(out, torch.stack(srcs).mean(0))


def test_attn_res_single_source_is_identity():
    x = torch.randn(3, 4, 16)
    torch.testing.assert_close(attn_res_agg([x], torch.randn(16), torch.rand(16), 1e-5), x)


def test_attn_res_mixed_dtypes_follow_autocast():
    """Under autocast the bank mixes the fp32 embedding with bf16 outputs (the fused kernel
    needs one dtype): all sources become the autocast dtype first."""
    srcs = [torch.randn(2, 3, 16)] + [torch.randn(2, 3, 16).bfloat16() for _ in range(2)]
    q, w = torch.randn(16), torch.rand(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn_res_agg(srcs, q, w, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, attn_res_agg_ref([s.bfloat16() for s in srcs], q, w, 1e-5))
    assert attn_res_agg(srcs, q, w, 1e-5).dtype == torch.float32  # no autocast: promoted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_res_matches_fla_naive(dtype):
    fla = load_fla_file("ops/attnres/naive.py")
    torch.manual_seed(0)
    srcs = [torch.randn(2, 9, 48, dtype=dtype) * s for s in (0.01, 1.0, 30.0)]
    q, w = torch.randn(48), torch.rand(48) + 0.5
    want = fla.naive_attnres(q, srcs, w, rms_eps=1e-5)
    got = attn_res_agg_ref(srcs, q, w, 1e-5)
    # fp32: only summation order differs (fla uses F.rms_norm and einsum); bf16: one final rounding
    tol = dict(rtol=2e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def test_attn_res_eps_matters_and_gradients_match_fla():
    fla = load_fla_file("ops/attnres/naive.py")
    srcs = [(torch.randn(2, 3, 8) * 1e-3).requires_grad_() for _ in range(3)]
    q, w = torch.randn(8, requires_grad=True), torch.rand(8, requires_grad=True)
    a = attn_res_agg_ref(srcs, q, w, 1e-5)
    b = attn_res_agg_ref(srcs, q, w, 1e-6)
    assert not torch.allclose(a, b, rtol=1e-3)  # sources ~1e-3: eps is visible, use exactly 1e-5
    want = fla.naive_attnres(q, srcs, w, rms_eps=1e-5)
    g = torch.randn_like(a)
    ours = torch.autograd.grad(a, [*srcs, q, w], g)
    theirs = torch.autograd.grad(want, [*srcs, q, w], g)
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_attn_res_bad_shapes():
    with pytest.raises(ValueError, match="query"):
        attn_res_agg([torch.randn(2, 3, 8)], torch.randn(7), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="at least one"):
        attn_res_agg([], torch.randn(8), torch.ones(8), 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_paths_match_references_on_gpu():
    torch.manual_seed(0)
    dev = "cuda"
    srcs = [torch.randn(2, 1000, 1024, device=dev, dtype=torch.bfloat16) * s for s in (1, 3, 0.1, 10)]
    srcs = [s.requires_grad_() for s in srcs]
    q = torch.randn(1024, device=dev, requires_grad=True)
    w = (torch.rand(1024, device=dev) + 0.5).requires_grad_()
    fast = attn_res_agg(srcs, q, w, 1e-5)
    ref = attn_res_agg_ref(srcs, q, w, 1e-5)
    torch.testing.assert_close(fast, ref, rtol=1e-2, atol=1e-2)
    g = torch.randn_like(fast)
    for a, b in zip(torch.autograd.grad(fast, [*srcs, q, w], g), torch.autograd.grad(ref, [*srcs, q, w], g)):
        assert ((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
    with torch.autocast("cuda", dtype=torch.bfloat16):  # fp32 embedding beside bf16 outputs
        mixed = attn_res_agg([srcs[0].detach().float(), *(s.detach() for s in srcs[1:])],
                             q.detach(), w.detach(), 1e-5)
    assert mixed.dtype == torch.bfloat16
    torch.testing.assert_close(mixed, ref.detach(), rtol=1e-2, atol=1e-2)
    x = torch.randn(4, 333, 2048, device=dev, dtype=torch.bfloat16)
    wn = torch.rand(2048, device=dev, dtype=torch.bfloat16)
    from openk3.ops.norm import gated_rms_norm, rms_norm
    from openk3.ops.situ import situ_glu
    torch.testing.assert_close(rms_norm(x, wn, 1e-5), rms_norm_ref(x, wn, 1e-5), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gated_rms_norm(x, wn, x.flip(-1), 1e-5),
                               gated_rms_norm_ref(x, wn, x.flip(-1), 1e-5), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(situ_glu(x * 5, x), situ_glu_ref(x * 5, x), rtol=1e-2, atol=1e-2)


def test_compiled_falls_back_to_eager_when_dynamo_gives_up(monkeypatch):
    """Serving calls the compiled norms with many ranks/dtypes/grad modes; when dynamo hits its
    recompile limit for one kind of call, that kind runs eagerly (once warned), others stay
    compiled."""
    import torch._dynamo

    from openk3.ops import fast

    compiled_calls = []

    def fake_compile(fn, **kw):
        def run(*args):
            if args[0].dim() == 3:
                raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile limit")
            compiled_calls.append(args[0].dim())
            return fn(*args)
        return run

    monkeypatch.setattr(fast.torch, "compile", fake_compile)
    double = fast.compiled(lambda x: x * 2)
    with pytest.warns(UserWarning, match="recompile limit"):
        assert torch.equal(double(torch.ones(1, 2, 3)), torch.full((1, 2, 3), 2.0))
    assert torch.equal(double(torch.ones(1, 2, 3)), torch.full((1, 2, 3), 2.0))  # eager, no warning
    assert torch.equal(double(torch.ones(4)), torch.full((4,), 2.0))
    assert compiled_calls == [1]


def test_compiled_norm_keeps_one_graph_across_widths(monkeypatch, request):
    """Norms of every width (1024 hidden, 384/512 LoRA ranks, 128 heads...) share one dynamic
    graph per kind of call: weights are Parameters, whose shapes dynamo would treat as static."""
    import warnings

    from torch._dynamo.testing import CompileCounter

    from openk3.ops import fast
    from openk3.ops.norm import rms_norm_ref

    torch._dynamo.reset()
    counter, real_compile = CompileCounter(), torch.compile
    monkeypatch.setattr(fast.torch, "compile", lambda fn, **kw: real_compile(fn, backend=counter, **kw))
    norm = fast.compiled(rms_norm_ref)
    request.addfinalizer(torch._dynamo.reset)  # leave rms_norm_ref's recompile budget to later tests
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*recompile limit")  # no eager fallback
        for width in (64, 96, 128, 384, 512, 1024, 200):
            w = torch.nn.Parameter(torch.rand(width) + 0.5)
            for shape in ((3, 5, width), (7, width)):
                x = torch.randn(*shape, requires_grad=True)
                y = norm(x, w, 1e-6)
                torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-6))
                y.sum().backward()
                assert w.grad is not None
    assert counter.frame_count <= 4, counter.frame_count  # one graph per rank (+ respecialisation)
