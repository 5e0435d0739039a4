"""Bottom-right causal attention over packed sequences: the reference against a float64 loop
written from the mask's definition, bad arguments, the docstring example; the ``gpu`` test
compares the FlashAttention-2 varlen path with the reference (MLA's head dims: 192 for q and k,
128 for v, and the debug model's 48 / 32)."""

from __future__ import annotations

import pytest
import torch

import openk3.ops.varlen_attention as varlen_module
from openk3.ops.varlen_attention import varlen_causal_attention
from tests.ops.checks import cu_seqlens_of, rel_err, run_doctests

# (queries, keys) per sequence: whole prompts (equal), chunks over a cached prefix, one token
SEQUENCES = [(5, 5), (3, 10), (1, 1), (7, 20), (1, 9)]


def make_inputs(sequences, H, D, Dv, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    Tq, Tk = sum(q for q, _ in sequences), sum(k for _, k in sequences)
    cu_q = cu_seqlens_of([q for q, _ in sequences])
    cu_k = cu_seqlens_of([k for _, k in sequences])
    return dict(q=torch.randn(Tq, H, D, generator=g).to(device, dtype),
                k=torch.randn(Tk, H, D, generator=g).to(device, dtype),
                v=torch.randn(Tk, H, Dv, generator=g).to(device, dtype),
                cu_seqlens_q=cu_q.to(device), cu_seqlens_k=cu_k.to(device),
                cu_seqlens_q_cpu=cu_q, cu_seqlens_k_cpu=cu_k, scale=D ** -0.5)


def loop(q, k, v, cu_seqlens_q_cpu, cu_seqlens_k_cpu, scale, **_):
    """Query j of a sequence with Tq queries and Tk keys sees keys 0 .. Tk - Tq + j; float64."""
    out = []
    cu_q, cu_k = cu_seqlens_q_cpu.tolist(), cu_seqlens_k_cpu.tolist()
    for i in range(len(cu_q) - 1):
        qi, ki, vi = (t.double() for t in (q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]))
        Tq, Tk = qi.shape[0], ki.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        visible = torch.arange(Tk)[None, :] <= (Tk - Tq + torch.arange(Tq))[:, None]
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", p, vi))
    return torch.cat(out)


def test_reference_matches_loop():
    x = make_inputs(SEQUENCES, H=3, D=24, Dv=16)
    assert rel_err(varlen_causal_attention(**x), loop(**x)) < 1e-6


@pytest.mark.parametrize("name, bad, message", [
    ("k", torch.randn(45, 3, 20), "`k` must be"),
    ("v", torch.randn(44, 3, 16), "`k` must be"),
    ("cu_seqlens_k", torch.tensor([0, 45]), "offsets"),
    ("cu_seqlens_k_cpu", cu_seqlens_of([5, 10, 1, 20, 8]), "end at"),
    ("cu_seqlens_q_cpu", cu_seqlens_of([6, 2, 1, 7, 1]), "keys as queries"),  # 6 queries, 5 keys
])
def test_rejects_bad_arguments(name, bad, message):
    x = make_inputs(SEQUENCES, H=3, D=24, Dv=16)
    x[name] = bad
    with pytest.raises(ValueError, match=message):
        varlen_causal_attention(**x)


def test_docstring_examples_run():
    run_doctests(varlen_module)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("D, Dv, H", [(192, 128, 8), (48, 32, 2)])
def test_flash_varlen_matches_reference(D, Dv, H):
    sequences = SEQUENCES + [(300, 1000), (513, 513), (64, 4096)]
    x = make_inputs(sequences, H=H, D=D, Dv=Dv, dtype=torch.bfloat16, device="cuda")
    got = varlen_causal_attention(**x)
    want = loop(**{k: t.cpu() if torch.is_tensor(t) else t for k, t in x.items()})
    ref = varlen_module.varlen_causal_attention_ref(x["q"], x["k"], x["v"], x["cu_seqlens_q_cpu"],
                                                    x["cu_seqlens_k_cpu"], x["scale"])
    assert got.shape == (x["q"].shape[0], H, Dv) and got.dtype == torch.bfloat16
    # bf16 inputs, fp32 accumulation, bf16 output: both paths within bf16 rounding of exact
    assert rel_err(got.cpu(), want) < 1e-2, rel_err(got.cpu(), want)
    assert rel_err(ref.cpu(), want) < 1e-2

