"""RMSNorm and gated RMSNorm against the spec's formulas; on GPU, the compiled fast paths."""

import pytest
import torch

from openk3.ops.norm import gated_rms_norm, gated_rms_norm_ref, rms_norm, rms_norm_ref


def test_rms_norm_formula_and_dtype():
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    w = torch.rand(64, dtype=torch.bfloat16) + 0.5
    xf = x.float()
    want = w * (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = rms_norm_ref(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rms_norm_returns_the_autocast_dtype_under_autocast():
    """Training's fp32 weight would promote the output to fp32, which the reading matmul casts
    back: under autocast the norm rounds ``w * y`` to the autocast dtype itself (the values the
    matmul would read), unless ``out_dtype`` is given."""
    x, w = torch.randn(3, 5, 64), torch.rand(64) + 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = rms_norm(x, w, 1e-5)
        kept = rms_norm(x, w, 1e-5, out_dtype=torch.float32)
    assert got.dtype == torch.bfloat16 and kept.dtype == torch.float32
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-5).to(torch.bfloat16), rtol=0, atol=0)
    assert rms_norm(x, w, 1e-5).dtype == torch.float32  # no autocast: promoted, as before


def test_gated_rms_norm_is_fp32_throughout():
    x, g = torch.randn(4, 7, 16, dtype=torch.bfloat16), torch.randn(4, 7, 16, dtype=torch.bfloat16)
    w = torch.rand(16) + 0.5
    xf = x.float()
    want = (w * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.sigmoid(g.float()))
    torch.testing.assert_close(gated_rms_norm_ref(x, w, g, 1e-5), want.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_paths_match_references_on_gpu():
    torch.manual_seed(0)
    x = torch.randn(4, 333, 2048, device="cuda", dtype=torch.bfloat16)
    wn = torch.rand(2048, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(rms_norm(x, wn, 1e-5), rms_norm_ref(x, wn, 1e-5), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gated_rms_norm(x, wn, x.flip(-1), 1e-5),
                               gated_rms_norm_ref(x, wn, x.flip(-1), 1e-5), rtol=1e-2, atol=1e-2)
