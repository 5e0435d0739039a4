"""SiTU-GLU against the spec's formula and bound, the MLA output gate; on GPU, the compiled
fast paths."""

import pytest
import torch

from openk3.ops.situ import sigmoid_gate, sigmoid_gate_ref, situ_glu, situ_glu_ref


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


def test_sigmoid_gate_is_the_product_and_refuses_other_shapes():
    x, g = torch.randn(3, 7), torch.randn(3, 7) * 10
    torch.testing.assert_close(sigmoid_gate(x, g), x / (1 + torch.exp(-g)), rtol=1e-6, atol=1e-7)
    assert torch.equal(sigmoid_gate(x, torch.zeros(3, 7)), x * 0.5)
    with pytest.raises(ValueError, match=r"x \(3, 7\) and gate \(3, 1\)"):
        sigmoid_gate(x, g[:, :1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_path_matches_reference_on_gpu():
    torch.manual_seed(0)
    x = torch.randn(4, 333, 2048, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(situ_glu(x * 5, x), situ_glu_ref(x * 5, x), rtol=1e-2, atol=1e-2)
    o, g = torch.randn(2, 5, 2048, device="cuda", dtype=torch.bfloat16).unbind(0)
    # fp32 sigmoid rounded once against the bf16 sigmoid rounded before the product
    torch.testing.assert_close(sigmoid_gate(o, g * 4), sigmoid_gate_ref(o, g * 4), rtol=1e-2, atol=1e-2)
