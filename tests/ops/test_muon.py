"""openk3.ops.muon: Muon's two elementwise passes a block, the Triton kernels against the
plain-PyTorch reference on every kind of block view (a head's rows, a head's columns, a tall
matrix in its wide orientation, experts, odd sizes), a float and a 0-dim tensor lr."""

import pytest
import torch

from openk3.ops import muon


def blocks(device: str = "cpu", seed: int = 0) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(name, g, m, w) block views ``[n, r, c]`` of fp32 tensors, as ``optim._blocks`` and the
    wide orientation make them: contiguous row blocks, transposed column blocks, experts."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def three(*shape):
        return [torch.randn(*shape, generator=gen, device=device) for _ in range(3)]

    views = {
        "rows of 3 heads": (three(120, 70), lambda t: t.reshape(3, 40, 70)),
        "columns of 2 heads": (three(50, 66), lambda t: t.mT.reshape(2, 33, 50)),  # strided views
        "tall, wide form": (three(130, 37), lambda t: t[None].mT),
        "experts": (three(4, 17, 29), lambda t: t),
    }
    return [(name, *(make(t) for t in ts)) for name, (ts, make) in views.items()]


_INTERPRETED = """
import torch
from openk3.ops import muon
from openk3.ops.muon_triton import launch_apply_update, launch_momentum
from tests.ops.test_muon import blocks
for name, g, m, w in blocks():
    for nesterov in (True, False):
        m1, m2 = m.clone(), m.clone()
        out1, out2 = torch.empty(g.shape), torch.empty(g.shape)
        launch_momentum(g, m1, out1, 0.95, nesterov)
        muon.momentum_ref(g, m2, out2, 0.95, nesterov)
        assert torch.equal(m1, m2), (name, (m1 - m2).abs().max())
        assert (out1 - out2).abs().max() <= 1e-6 * out2.abs().max(), (name, nesterov)
    c = torch.tensor(0.37)  # gradient clipping's coefficient, applied on the way in
    m1, m2 = m.clone(), m.clone()
    out1, out2 = torch.empty(g.shape), torch.empty(g.shape)
    launch_momentum(g, m1, out1, 0.95, True, c)
    muon.momentum_ref(g * c, m2, out2, 0.95, True)
    assert torch.equal(m1, m2), (name, "scaled", (m1 - m2).abs().max())
    assert (out1 - out2).abs().max() <= 1e-6 * out2.abs().max(), (name, "scaled")
    x = torch.randn(g.shape)
    for lr, wd in ((0.02, 0.1), (torch.tensor(0.02), 0.1), (0.02, 0.0), (torch.tensor(0.015), 0.0)):
        w1, w2 = w.clone(), w.clone()
        launch_apply_update(w1, x, lr, wd, 3.7)
        muon.apply_update_ref(w2, x, lr, wd, 3.7)
        assert (w1 - w2).abs().max() <= 1e-6 * w2.abs().max(), (name, lr, wd, (w1 - w2).abs().max())
        assert not torch.equal(w1, w), name
# Newton-Schulz's per-matrix factors: odd sizes against the block, one matrix and many
from openk3.ops.muon_triton import launch_scale
import openk3.ops.muon_triton as kernels
kernels.SCALE_BLOCK = 64
for shape in ((3, 7, 9), (1, 1, 5), (70, 8, 16)):
    t, s = torch.randn(shape), torch.rand(shape[0]) + 0.5
    want = t * s[:, None, None]
    launch_scale(t, s)
    assert torch.equal(t, want), shape
print("ok")
"""


def test_kernels_in_the_triton_interpreter():
    """The kernels on the CPU (TRITON_INTERPRET=1, fp32) against the reference: the momentum
    bit for bit (fp contraction off: the multiply and the add round as the reference's), the
    outputs to an fp32 ulp or so (the reference's add-with-alpha and addcmul may contract)."""
    from tests.ops.checks import run_triton_interpreted

    run_triton_interpreted(_INTERPRETED)


def test_reference_is_the_momentum_and_update_formula():
    g, m, w, x = (torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(i)) for i in range(4))
    m0, w0 = m.clone(), w.clone()
    out = torch.empty(2, 3, 5)
    muon.momentum_(g, m, out, 0.9, nesterov=True)
    torch.testing.assert_close(m, 0.9 * m0 + g)
    torch.testing.assert_close(out, g + 0.9 * (0.9 * m0 + g))
    muon.apply_update_(w, x, torch.tensor(0.1), 0.5, 2.0)
    torch.testing.assert_close(w, w0 * (1 - 0.1 * 0.5) - 0.1 * 2.0 * x)


@pytest.mark.parametrize("call,message", [
    (lambda t: muon.momentum_(t, t[:, :2], torch.empty_like(t), 0.9, True), "`momentum` must match"),
    (lambda t: muon.momentum_(t, t.clone(), torch.empty(2, 3, 4), 0.9, True), "`out` must match"),
    (lambda t: muon.apply_update_(t, t[:1], 0.1, 0.0, 1.0), "`x` must match"),
    (lambda t: muon.apply_update_(t, t.clone(), torch.tensor([0.1]), 0.0, 1.0), "lr tensor must be 0-dim"),
    (lambda t: muon.momentum_(t, t.clone(), t.clone(), 0.9, True, torch.ones(2)), "grad_scale must be 0-dim"),
])
def test_bad_blocks_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.zeros(2, 3, 5))


def test_scale_matrices_reference_and_bad_arguments():
    t, s = torch.randn(3, 4, 5), torch.rand(3)
    want = t * s[:, None, None]
    muon.scale_matrices_(t, s)
    assert torch.equal(t, want)
    for bad_t, bad_s in ((torch.randn(3, 4, 5).mT, torch.rand(3)), (torch.randn(3, 4, 5), torch.rand(2)),
                         (torch.randn(4, 5), torch.rand(4))):
        with pytest.raises(ValueError, match="scale_matrices_"):
            muon.scale_matrices_(bad_t, bad_s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_match_the_reference_on_cuda():
    """The kernels as Muon runs them on CUDA (bf16 Newton-Schulz input and update) against the
    reference: the momentum bit for bit, the bf16 output to one bf16 rounding of an ulp-level
    difference, the weights to fp32 rounding."""
    for name, g, m, w in blocks("cuda"):
        m1, m2 = m.clone(), m.clone()
        out1 = torch.empty(g.shape, dtype=torch.bfloat16, device="cuda")
        out2 = torch.empty_like(out1)
        muon.momentum_(g, m1, out1, 0.95, True)
        muon.momentum_ref(g, m2, out2, 0.95, True)
        assert torch.equal(m1, m2), name
        torch.testing.assert_close(out1, out2, rtol=8e-3, atol=0, msg=name)
        c = torch.tensor(0.37, device="cuda")  # gradient clipping's coefficient on the way in
        muon.momentum_(g, m1, out1, 0.95, True, c)
        muon.momentum_ref(g * c, m2, out2, 0.95, True)
        assert torch.equal(m1, m2), name
        torch.testing.assert_close(out1, out2, rtol=8e-3, atol=0, msg=name)
        x = torch.randn(g.shape, device="cuda").bfloat16()
        for lr in (0.02, torch.tensor(0.02, device="cuda")):
            w1, w2 = w.clone(), w.clone()
            muon.apply_update_(w1, x, lr, 0.1, 3.7)
            muon.apply_update_ref(w2, x, lr, 0.1, 3.7)
            torch.testing.assert_close(w1, w2, rtol=1e-6, atol=1e-6, msg=name)
    # Newton-Schulz's per-matrix factors on a bf16 batch: as torch's fp32 product rounded once
    t, s = torch.randn(4416, 16, 33, device="cuda").bfloat16(), torch.rand(4416, device="cuda") + 0.5
    want = (t.float() * s[:, None, None]).bfloat16()
    muon.scale_matrices_(t, s)
    assert torch.equal(t, want)
