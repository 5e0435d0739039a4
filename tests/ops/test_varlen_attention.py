"""Bottom-right causal attention over packed sequences: the reference against a float64 loop
written from the mask's definition, bad arguments, the docstring example, one sequence in parts
merged by their log-sum-exps; the ``gpu`` tests compare the FlashAttention-2 varlen path and the
one-sequence parts (FlashAttention-2 pieces, cuDNN's causal square padded to a bucket) with the
loop (MLA's head dims: 192 for q and k, 128 for v, and the debug model's 48 / 32)."""

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
        pos_k, pos_q = torch.arange(Tk, device=qi.device), torch.arange(Tq, device=qi.device)
        visible = pos_k[None, :] <= (Tk - Tq + pos_q)[:, None]
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


@pytest.mark.parametrize("Tq, Tk", [(5, 5), (3, 10), (1, 9), (7, 30), (16, 17)])
@pytest.mark.parametrize("groups, align", [(1, 1), (2, 1), (3, 2), (4, 3), (50, 1), (2, 40)])
@pytest.mark.parametrize("own_parts", [False, True])
def test_split_attention_matches_loop(Tq, Tk, groups, align, own_parts):
    """The prefix in runs (as many as ``groups`` allows, lengths multiples of ``align``), then
    the causal tail (the prefix's remainder and the queries' own keys; with ``own_parts`` as a
    padded top-left square), merged by their log-sum-exps, give the one-pass result."""
    x = make_inputs([(Tq, Tk)], H=3, D=24, Dv=16)
    calls = []

    def square(q, k, v, scale):  # what the cuDNN tail is given: the last keys, bottom-right causal
        calls.append(("square", k.shape[0]))
        return varlen_module.square_by(dense_ref, q, k, v, scale)

    def pieces(q, k, v, scale):  # what the cuDNN runs are given: [m, L, H, D]
        calls.append(("pieces", tuple(k.shape[:2])))
        return varlen_module._pieces_by(varlen_module.attention_lse_ref, q, k, v, scale)

    got = varlen_module.split_attention(x["q"], x["k"], x["v"], x["scale"], groups, align,
                                        pieces=pieces if own_parts else None,
                                        square=square if own_parts else None)
    assert rel_err(got, loop(**x)) < 1e-6
    P = Tk - Tq
    m = min(groups, P // align)
    L = P // m // align * align if m else 0
    want = ([("pieces", (m, L))] if m else []) + [("square", Tk - m * L)]
    assert calls == (want if own_parts else [])
    assert L % align == 0 and m * L <= P


def dense_ref(q, k, v, scale, causal):
    """What ``square_by`` asks of cuDNN, by the reference: [1, B, H, *] in, top-left causal
    (a square: the same as bottom-right), (out [1, B, H, Dv], lse [1, H, B]) out."""
    one = torch.tensor([0, q.shape[1]])
    out, lse = varlen_module.attention_lse_ref(q[0], k[0], v[0], one, torch.tensor([0, k.shape[1]]), scale,
                                               causal)
    return out[None], lse[None]


@pytest.mark.parametrize("Tq, Tk", [(1, 1), (5, 5), (3, 10), (64, 64), (65, 70), (40, 130), (1, 200),
                                     (40, 64), (64, 128)])
def test_square_by_puts_a_bottom_right_tail_in_a_top_left_square(Tq, Tk):
    """Zero queries in front, zero keys after (up to the bucket: 70 -> 128, 130 -> 192; 64 and
    128 keys are their own bucket, passed as they are): the real rows' outputs and log-sum-exps
    are the bottom-right tail's; a declining kernel declines. v strided, as the MLA layer's."""
    x = make_inputs([(Tq, Tk)], H=2, D=16, Dv=16)
    x["v"] = x["v"][..., 4:12]
    got = varlen_module.square_by(dense_ref, x["q"], x["k"], x["v"], x["scale"])
    want = varlen_module.attention_lse_ref(x["q"], x["k"], x["v"], x["cu_seqlens_q_cpu"],
                                           x["cu_seqlens_k_cpu"], x["scale"], True)
    assert rel_err(got[0], want[0]) < 1e-6 and rel_err(got[1], want[1]) < 1e-6
    assert varlen_module.square_by(lambda *args: None, x["q"], x["k"], x["v"], x["scale"]) is None


def test_attention_lse_ref_is_the_log_sum_exp():
    x = make_inputs(SEQUENCES, H=2, D=8, Dv=4)
    out, lse = varlen_module.attention_lse_ref(x["q"], x["k"], x["v"], x["cu_seqlens_q_cpu"],
                                               x["cu_seqlens_k_cpu"], x["scale"], True)
    assert rel_err(out, loop(**x)) < 1e-6
    q, k = x["q"][:5], x["k"][:5]  # the first sequence: 5 of 5, query 2 sees keys 0..2
    s = torch.einsum("hd,khd->hk", q[2], k[:3]) * x["scale"]
    assert torch.allclose(lse[:, 2], s.logsumexp(-1), atol=1e-5)


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



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("route", ["cudnn", "mixed", "flash"])
@pytest.mark.parametrize("Tq, Tk", [(1024, 9000), (1024, 9216), (600, 600), (600, 5000), (700, 1724), (1, 3000),
                                     (37, 1061)])
def test_one_sequence_parts_match_loop(Tq, Tk, route, monkeypatch):
    """One sequence on the device, sizes scaled down (by the module's thresholds): the prefix in
    runs of multiples of 96 keys in cuDNN (or FlashAttention-2, when cuDNN has failed), the tail
    in FlashAttention-2 or, from 512 queries and a remainder no longer than them, in cuDNN as a
    padded top-left square (600 of 600 keys -> 640 rows; 600 after a remainder of 368 -> 1,024;
    1,024 after 512 -> 1,536 rows, the keys and values passed as they are: the serving case of
    1,024 queries after 31,744 cached keys); v strided as the MLA layer's (a slice of
    kv_b_proj's output)."""
    monkeypatch.setattr(varlen_module, "CUDNN_MIN_TOKENS", 512)
    monkeypatch.setattr(varlen_module, "SPLIT_MIN_TOKENS", 512)
    monkeypatch.setattr(varlen_module, "CUDNN_PIECE_KEYS", 96)
    # "mixed": prefixes under 2^20 query-key pairs in FlashAttention-2, the tail still in cuDNN
    monkeypatch.setattr(varlen_module, "CUDNN_MIN_PAIRS", 0 if route == "cudnn" else 1 << 20)
    if route == "flash":
        monkeypatch.setattr(varlen_module, "_CUDNN_FAILED", ["cuDNN refused (the test says so)"])
    x = make_inputs([(Tq, Tk)], H=8, D=192, Dv=256, dtype=torch.bfloat16, device="cuda")
    x["v"] = x["v"][..., 64:192]  # [Tk, 8, 128], rows 2,048 apart
    got = varlen_causal_attention(**x)
    want = loop(**x)  # float64 on the device
    assert got.shape == (Tq, 8, 128) and got.dtype == torch.bfloat16
    assert len(varlen_module._CUDNN_FAILED) == (route == "flash"), varlen_module._CUDNN_FAILED
    # each part is rounded to bf16 before the fp32 merge: one more rounding than one kernel
    assert rel_err(got.double(), want) < 1e-2, rel_err(got.double(), want)


def test_one_flash_call_unless_the_split_pays(monkeypatch):
    monkeypatch.setattr(varlen_module, "_sm_count", lambda device: 132)
    pays = varlen_module._split_pays
    q = torch.empty(1024, 8, 192)  # 128 blocks of 64 queries x heads: the SMs filled once
    assert not pays(q, 0) and not pays(q, 1024) and not pays(q, 8191)  # under 2^23 pairs
    assert pays(q, 8192) and pays(torch.empty(2048, 8, 192), 0)  # cuDNN's prefix; its square
    assert pays(torch.empty(16, 8, 192), 3000) and not pays(torch.empty(16, 8, 192), 0)  # 8 blocks
    assert not pays(torch.empty(1024, 1, 192), 0) and pays(torch.empty(1024, 1, 192), 1)  # 16 blocks


def test_prefix_runs_fill_the_sms_four_times(monkeypatch):
    monkeypatch.setattr(varlen_module, "_sm_count", lambda device: 132)
    q = torch.empty(1024, 8, 192)
    assert varlen_module._groups(q, 64) == 5  # 128 blocks of 64 queries: 528 / 128 -> 5 runs
    assert varlen_module._groups(torch.empty(16384, 8, 192), 64) == 1
    assert varlen_module._groups(torch.empty(1, 8, 192), 64) == 66
    # run lengths: eight per octave, so 31,744 keys in 5 runs are 5 x 6,144 and a tail of 1,024
    assert [varlen_module._run_align(n) for n in (100, 4095, 6348, 16384)] == [256, 256, 512, 2048]


_INTERPRETED_MERGE = """
import torch
from openk3.ops.attention_merge_triton import merge_parts_kernel
from openk3.ops.varlen_attention import merge_parts_ref
torch.manual_seed(0)
# strided parts as the attention returns them (runs sliced from padded queries, lse [m, H, B]);
# odd Tq and Dv (masked rows and columns); a tail with a part of weight ~0 beside it
for m, Tq, H, Dv in ((1, 5, 2, 8), (3, 37, 3, 24), (2, 16, 1, 128)):
    o_runs = torch.randn(m, Tq + 3, H, Dv + 8)[:, :Tq, :, :Dv]
    lse_runs = (4 * torch.randn(m, H, Tq + 3))[..., :Tq]
    o_tail, lse_tail = torch.randn(Tq, H, Dv), 4 * torch.randn(H, Tq)
    lse_runs[0, 0, 0] = -60.0
    out = torch.empty(Tq, H, Dv)
    grid = lambda meta: ((Tq + meta["BLOCK_Q"] - 1) // meta["BLOCK_Q"], H)
    merge_parts_kernel[grid](o_runs, lse_runs, o_tail, lse_tail, out, m, Tq, Dv, *o_runs.stride()[:3],
                             *lse_runs.stride(), *o_tail.stride()[:2], *lse_tail.stride(), *out.stride()[:2],
                             BLOCK_Q=16, BLOCK_D=max(8, 1 << (Dv - 1).bit_length()))
    want = merge_parts_ref(o_runs.double(), lse_runs.double(), o_tail.double(), lse_tail.double())
    assert (out.double() - want).abs().max().item() < 1e-5, (m, Tq, H, Dv)
print("ok")
"""


def test_merge_kernel_in_the_triton_interpreter():
    """The parts' merge kernel on the CPU (TRITON_INTERPRET=1, fp32) against ``merge_parts_ref``
    in fp64: strided inputs, odd query counts and head dims."""
    from tests.ops.checks import run_triton_interpreted

    run_triton_interpreted(_INTERPRETED_MERGE)


def test_merge_ref_is_attention_over_all_keys():
    """Two parts' outputs and log-sum-exps merged give attention over the union of their keys."""
    q, k, v = torch.randn(6, 2, 8, dtype=torch.float64), torch.randn(20, 2, 8, dtype=torch.float64), \
        torch.randn(20, 2, 4, dtype=torch.float64)

    def part(a, b):
        return varlen_module.attention_lse_ref(q, k[a:b], v[a:b], torch.tensor([0, 6]),
                                               torch.tensor([0, b - a]), 0.3, False)

    (o1, l1), (o2, l2), (o3, l3), (want, _) = part(0, 7), part(7, 12), part(12, 20), part(0, 20)
    got = varlen_module.merge_parts_ref(torch.stack([o1, o2]), torch.stack([l1, l2]), o3, l3)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
