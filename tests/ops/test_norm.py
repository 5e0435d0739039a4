"""RMSNorm and gated RMSNorm against the spec's formulas; on GPU, the compiled fast paths."""

from unittest import mock

import pytest
import torch

import openk3.ops.norm as norm_ops

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


_INTERPRETED = """
import torch
import openk3.ops.norm as N
from openk3.ops.norm import rms_norm
torch.manual_seed(0)
# odd widths against the tiles; x a column slice (rows not contiguous), dy transposed; tiles of one
# row (the backward's programs walking several row blocks, the last partly past N) and of many
for shape, D, elements in [((3, 7), 70, 4096), ((3, 7), 70, 64), ((1,), 5, 4096), ((50,), 16, 64), ((2, 9), 33, 256)]:
    N.FWD_ELEMENTS = N.BWD_ELEMENTS = elements
    x, w = torch.randn(*shape, D + 3)[..., 1:D + 1], 1 + 0.1 * torch.randn(D)
    dy = torch.randn(D, *shape).movedim(0, -1)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm(xs, ws, 1e-5, backend="triton")
    y.backward(dy)
    got = [y, xs.grad, ws.grad]
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()  # the norm in fp64
    y64 = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    y64.backward(dy.double())
    want = [y64, x64.grad, w64.grad]
    for name, a, b in zip(("y", "dx", "dweight"), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, (name, a.dtype, a.shape)
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert err < 1e-5, (name, shape, D, elements, err)
print("ok")
"""


def test_triton_kernels_in_the_triton_interpreter():
    """Forward and backward (dx, dweight) on the CPU (TRITON_INTERPRET=1, fp32: the interpreter
    truncates casts to bf16 where the GPU rounds to nearest) against autograd of the norm in
    fp64, on widths and row counts that fill no tile."""
    from tests.ops.checks import run_triton_interpreted

    run_triton_interpreted(_INTERPRETED)


def test_auto_traces_the_reference_inside_a_compiled_region(monkeypatch):
    """Where the kernels would run ("auto" on the fast path), a compiled region traces the
    reference instead (one graph with its neighbours, no break at an opaque call); outside it
    "auto" calls the kernels (stubbed here: the CPU has no Triton)."""
    calls = []
    monkeypatch.setattr(norm_ops, "use_fast_path", lambda x: True)
    monkeypatch.setattr(norm_ops, "importable", lambda module: True)
    monkeypatch.setattr(norm_ops, "_rms_norm_triton", lambda *args: calls.append(1) or rms_norm_ref(*args))
    x, w = torch.randn(4, 8), torch.rand(8) + 0.5
    region = torch.compile(lambda x, w: rms_norm(x, w, 1e-5) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(region(x, w), 2 * rms_norm_ref(x, w, 1e-5))
    assert calls == []
    rms_norm(x, w, 1e-5)
    assert calls == [1]


@pytest.mark.parametrize("kwargs,message", [
    ({"backend": "cuda"}, "backend"),
    ({"backend": "triton"}, "CUDA"),
    ({"backend": "triton", "weight": torch.ones(8)}, "weight"),
    ({"backend": "triton", "weight": None}, "weight"),
    ({"backend": "triton", "weight": torch.ones(16, dtype=torch.float64)}, "float64"),
])
def test_rms_norm_rejects_bad_backends(kwargs, message):
    args = {"weight": torch.ones(16), **kwargs}
    with pytest.raises(ValueError, match=message):
        rms_norm(torch.randn(2, 16), args.pop("weight"), 1e-5, **args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,weight_dtype,out_dtype", [
    (torch.bfloat16, torch.float32, torch.bfloat16),   # training under autocast
    (torch.bfloat16, torch.bfloat16, None),            # serving: checkpoint weights
    (torch.bfloat16, torch.bfloat16, torch.float32),   # the product rounded, then widened
    (torch.float32, torch.float32, None)], ids=["train", "serve", "bf16-to-fp32", "fp32"])
@pytest.mark.parametrize("rows,D", [(1, 1024), (333, 1024), (16384, 512), (77, 7168), (5, 48)])
def test_triton_norm_matches_reference_gpu(dtype, weight_dtype, out_dtype, rows, D):
    """"auto" takes the kernels on CUDA. Their output against the reference's: equal up to one
    rounding of each of its two bf16 roundings (rstd summed in another order). The gradients
    against fp64 autograd of the unrounded norm (what the backward computes): within the one
    rounding of dx to its dtype; the weight's within fp32 summation order (bf16: its rounding)."""
    torch.manual_seed(0)
    x = torch.randn(rows, D, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(D, device="cuda")).to(weight_dtype)
    with mock.patch.object(norm_ops, "_rms_norm_triton", wraps=norm_ops._rms_norm_triton) as kernels:
        rms_norm(x, w, 1e-6, out_dtype)
    assert kernels.called  # "auto" takes the kernels on CUDA
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm(xs, ws, 1e-6, out_dtype, backend="triton")
    dy = torch.linspace(-1, 1, rows * D, device="cuda").view(rows, D).to(y.dtype)
    y.backward(dy)
    want = rms_norm(x, w, 1e-6, out_dtype, backend="torch")
    assert y.dtype == want.dtype and xs.grad.dtype == dtype and ws.grad.dtype == weight_dtype
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    (w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)).backward(dy.double())
    fp32 = dtype == torch.float32
    for name, a, b, rel in (("y", y, want, 1e-5 if fp32 else 2 ** -6),
                            ("dx", xs.grad, x64.grad, 1e-5 if fp32 else 2 ** -8),
                            ("dweight", ws.grad, w64.grad, 1e-5 if weight_dtype == torch.float32 else 2 ** -8)):
        a, b = a.double(), b.double()
        # elementwise, plus an absolute term for entries near 0 (fp32 sums over thousands of rows)
        bad = (a - b).abs() > rel * b.abs() + max(1e-3 * rel, 1e-6) * b.abs().max()
        assert not bad.any(), (name, bad.sum().item(), ((a - b).abs().max() / b.abs().max()).item())
