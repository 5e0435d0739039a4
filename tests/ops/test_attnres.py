"""Block AttnRes aggregation against its spec, fla-core's naive reference and, on GPU, fla's
fused kernel."""

import pytest
import torch

from openk3.ops.attnres import attn_res_agg, attn_res_agg_ref, seal
from tests.helpers import load_fla_file
from tests.ops.checks import run_triton_interpreted


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


def test_attn_res_with_the_following_norm_is_agg_then_rms_norm():
    """``out_norm_weight``: the reference path is the two ops in turn, exactly (what the decoder
    ran before the CUDA fusion), and the gradient reaches the norm's weight."""
    from openk3.ops.norm import rms_norm_ref

    torch.manual_seed(0)
    srcs = [torch.randn(2, 5, 16) * s for s in (1.0, 4.0, 0.3)]
    q, w, ow = torch.randn(16), torch.rand(16) + 0.5, (torch.rand(16) + 0.5).requires_grad_()
    got = attn_res_agg(srcs, q, w, 1e-5, out_norm_weight=ow)
    assert torch.equal(got, rms_norm_ref(attn_res_agg_ref(srcs, q, w, 1e-5), ow, 1e-5))
    got.sum().backward()
    assert ow.grad is not None and ow.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="out_norm_weight"):
        attn_res_agg(srcs, q, w, 1e-5, out_norm_weight=torch.ones(15))


def test_attn_res_bad_shapes():
    with pytest.raises(ValueError, match="query"):
        attn_res_agg([torch.randn(2, 3, 8)], torch.randn(7), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="at least one"):
        attn_res_agg([], torch.randn(8), torch.ones(8), 1e-5)


def _bank_chain(x, qs, w, sealing, g):
    """Reads of two bank entries by later reads (in both orders), a copy of a sealed entry, an
    entry given twice to one read and a consumer of one that is not a read: the gradients of x,
    w and the queries."""
    s = seal if sealing else (lambda t: t)
    e0 = s(x * 2)
    p = torch.tanh(x)
    a = attn_res_agg([e0, p], qs[0], w, 1e-5)
    e1 = s(a * 3)
    b = attn_res_agg([e0, e1, p * a], qs[1], w, 1e-5)
    c = attn_res_agg([e0.clone(), e1, b], qs[2], w, 1e-5)
    d = attn_res_agg([e1, e0, c, e0], qs[3], w, 1e-5)
    return (d * g).sum() + e1.pow(2).sum()


def test_sealed_entries_get_the_summed_gradient_of_their_reads():
    """With sealed entries the reads add their gradients into one accumulator per entry: the
    same gradients as autograd's own sums (fp32, to summation order; with the reads returning
    their gradients for the entries as well, x's would be counted twice), twice over with a retained
    graph (nothing left over from the first backward)."""
    torch.manual_seed(0)
    D = 16
    x = torch.randn(2, 5, D, requires_grad=True)
    qs = [torch.randn(D, requires_grad=True) for _ in range(4)]
    w = (torch.rand(D) + 0.5).requires_grad_()
    g = torch.randn(2, 5, D)
    want = torch.autograd.grad(_bank_chain(x, qs, w, False, g), [x, w, *qs])
    loss = _bank_chain(x, qs, w, True, g)
    for _ in range(2):
        got = torch.autograd.grad(loss, [x, w, *qs], retain_graph=True)
        for a, b in zip(got, want):  # sums of terms up to ~200 in another order: ~1e-7 of the norm
            assert ((a - b).norm() / b.norm()) < 1e-6
    with torch.no_grad():  # inference: nothing sealed
        assert seal(x) is x


def test_sealed_reads_give_way_without_fla_internals(monkeypatch):
    """The fast sealed read uses two module-level functions of fla-core 0.6.0 that are not its
    public API: without them the read is the plain one (its gradients reach the entry through
    the identity node as autograd's own sum)."""
    import openk3.ops.attnres as attnres

    x = torch.randn(2, 3, 8, requires_grad=True)
    sources = [seal(x * 2), torch.tanh(x)]
    monkeypatch.setattr(attnres, "_fla_forward", lambda: None)
    assert attnres._sealed_read(sources, torch.randn(8), torch.ones(8), 1e-5, True) is None
    assert attnres._sealed_read(sources, torch.randn(8), torch.ones(8), 1e-5, False) is not None


def test_sealed_backward_kernel_in_the_triton_interpreter():
    """The backward kernel (fp32, CPU interpreter) against autograd of the reference: row counts
    that fill no program (8 rows each), one to four sources, accumulators holding a prior sum
    (added to) beside fresh ones (NaN-filled: written, never read); all sources in one tile (read
    once) and, with smaller tiles, in tiles of two (the last one part-filled) and of one."""
    run_triton_interpreted("""
        import torch
        import openk3.ops.attnres as attnres
        from openk3.ops.attnres import _bwd_triton, attn_res_agg_ref
        torch.manual_seed(0)
        # D = 48 and 20 pad to 64 and 32 features: tile 8192 holds all sources, 128 (D = 48) two
        # a tile, the last part-filled, 64 (D = 20) two, 64 (D = 48) and 32 (D = 20) one
        for tile, N, D, L, acc in ((8192, 13, 48, 3, (True, False, False)), (8192, 16, 64, 1, (False,)),
                                   (8192, 5, 20, 4, (True, True, False, True)),
                                   (128, 13, 48, 3, (True, False, False)), (64, 5, 20, 4, (True, True, False, True)),
                                   (64, 13, 48, 3, (False, True, True)), (32, 5, 20, 4, (False, True, False, True))):
            attnres.BWD_TILE = tile
            srcs = [torch.randn(N, D) * s for s in (1, 3, 0.1, 10)[:L]]
            q, w, eps = torch.randn(D), torch.rand(D) + 0.5, 1e-5
            v = torch.stack(srcs)
            rstd = torch.rsqrt(v.pow(2).mean(-1) + eps)
            logit = (v * (q * w)).sum(-1) * rstd
            lse = torch.logsumexp(logit, 0)
            g = torch.randn(N, D)
            leaves = [t.clone().requires_grad_() for t in (q, w, *srcs)]
            want = torch.autograd.grad(attn_res_agg_ref(leaves[2:], leaves[0], leaves[1], eps), leaves, g)
            prior = [torch.randn(N, D) for _ in srcs]
            grads = [p.clone() if a else torch.full((N, D), float("nan")) for p, a in zip(prior, acc)]
            dq, dw = _bwd_triton(g, q, w, rstd, logit, lse, srcs, grads, list(acc))
            got = [dq, dw, *[gr - p if a else gr for gr, p, a in zip(grads, prior, acc)]]
            for a, b in zip(got, want):
                err = ((a - b).norm() / max(b.norm(), 1e-3)).item()
                assert err < 1e-5, (tile, N, D, L, err)
        print("ok")
    """)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tile", [8192, 1024], ids=["sources-in-one-tile", "one-source-tiles"])
def test_sealed_entries_match_autograd_sums_on_gpu(monkeypatch, tile):
    """bf16 on CUDA: fla's forward and openk3's accumulating backward kernel against the same
    chain without sealing (fla's backward, autograd's adds) and against fp32 autograd of the
    reference: the sealed path is about as far from fp32 as the plain one (both round to bf16, at
    different places: the sum of a sealed entry's gradients is rounded once per read). Tiles of
    one source: the two-pass kernel wider models take."""
    import openk3.ops.attnres as attnres

    monkeypatch.setattr(attnres, "BWD_TILE", tile)
    print("relative distances from fp32 (sealed, plain):")
    torch.manual_seed(0)
    D = 1024
    x = torch.randn(2, 300, D, device="cuda", requires_grad=True)
    # logits of a few units (as trained queries give): a softmax peaked on one source would leave
    # the queries' gradients to bf16 rounding alone
    qs = [(torch.randn(D, device="cuda") * 0.05).requires_grad_() for _ in range(4)]
    w = (torch.rand(D, device="cuda") + 0.5).requires_grad_()
    g = torch.randn(2, 300, D, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        sealed = torch.autograd.grad(_bank_chain(x.bfloat16(), qs, w, True, g), [x, w, *qs])
        plain = torch.autograd.grad(_bank_chain(x.bfloat16(), qs, w, False, g), [x, w, *qs])
    monkeypatch.setenv("OPENK3_REFERENCE", "1")
    exact = torch.autograd.grad(_bank_chain(x, qs, w, False, g), [x, w, *qs])
    for name, a, b, c in zip(["x", "w", "q0", "q1", "q2", "q3"], sealed, plain, exact):
        errs = [((t.float() - c).norm() / c.norm()).item() for t in (a, b)]
        print(name, errs)
        assert errs[0] <= 2 * errs[1] + 5e-3, (name, errs)  # 5e-3: about bf16's half-ulp


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_path_matches_reference_on_gpu():
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_output_norm_matches_reference_on_gpu():
    """Without autograd fla applies the following RMSNorm in its kernel (normalised and weighted
    in fp32, one rounding); the reference rounds the mixture, then the normalised value: bf16
    rounding apart. With autograd the two ops run in turn, as the reference."""
    from openk3.ops.norm import rms_norm_ref

    torch.manual_seed(0)
    srcs = [torch.randn(3, 7, 1024, device="cuda", dtype=torch.bfloat16) * s for s in (1, 3, 0.1, 10)]
    q, w = torch.randn(1024, device="cuda"), torch.rand(1024, device="cuda") + 0.5
    ow = (torch.rand(1024, device="cuda") + 0.5).bfloat16()
    want = rms_norm_ref(attn_res_agg_ref([s.float() for s in srcs], q, w, 1e-5), ow.float(), 1e-5)
    with torch.no_grad():
        fused = attn_res_agg(srcs, q, w, 1e-5, out_norm_weight=ow)
    assert fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), want, rtol=1e-2, atol=1e-2)
    unfused = attn_res_agg(srcs, q, w, 1e-5, out_norm_weight=ow.clone().requires_grad_())
    torch.testing.assert_close(unfused.float(), want, rtol=2e-2, atol=2e-2)
