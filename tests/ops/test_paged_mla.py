"""Paged MLA decode attention: the reference against a float64 loop written from the formula
(each row's tokens read through its block table), bad arguments, the docstring example. The
``gpu`` tests compare the Triton kernel with the reference (bf16 and fp32, block sizes 64 and
6144, odd and long contexts, head counts that do not fill a head tile) and replay it in a CUDA
graph captured at short contexts over longer ones."""

from __future__ import annotations

import pytest
import torch

import openk3.ops.paged_mla as paged_mla_module
from openk3.ops.paged_mla import paged_mla_decode, paged_mla_decode_ref
from tests.ops.checks import (
    nan_poisoned_empty,
    rel_err,
    run_doctests,
    run_triton_interpreted,
)


def make_inputs(lens, H, R, P, block_size, num_blocks, dtype=torch.float32, device="cpu", seed=0):
    """Random queries and cache; each row's table is a random set of distinct blocks (padded
    with more random blocks past its context, which must not be read)."""
    g = torch.Generator().manual_seed(seed)
    B, W = len(lens), max(-(-n // block_size) for n in lens) + 1
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:W] for _ in lens]).int()
    return dict(
        q_lat=torch.randn(B, H, R, generator=g).to(device, dtype),
        q_rope=torch.randn(B, H, P, generator=g).to(device, dtype),
        cache=torch.randn(num_blocks * block_size, R + P, generator=g).to(device, dtype),
        block_table=table.to(device), context_lens=torch.tensor(lens, device=device),
        block_size=block_size, scale=(R + P) ** -0.5)


def loop(q_lat, q_rope, cache, block_table, context_lens, block_size, scale, first_pos=None):
    """softmax(scale * (q_lat . c + q_rope . k_r)) @ c per row and head over positions
    ``first_pos[b] .. context_lens[b] - 1``, in float64."""
    R = q_lat.shape[-1]
    out = torch.empty(q_lat.shape, dtype=torch.float64)
    firsts = [0] * len(context_lens) if first_pos is None else first_pos.tolist()
    for b, (n, first) in enumerate(zip(context_lens.tolist(), firsts)):
        rows = [int(block_table[b, t // block_size]) * block_size + t % block_size for t in range(first, n)]
        ctx = cache[rows].double()
        scores = scale * (q_lat[b].double() @ ctx[:, :R].T + q_rope[b].double() @ ctx[:, R:].T)
        out[b] = torch.softmax(scores, dim=-1) @ ctx[:, :R]
    return out


@pytest.mark.parametrize("lens, block_size", [([1, 7, 8, 9, 30], 8), ([63, 2], 64), ([5], 3)])
def test_reference_matches_loop(lens, block_size):
    x = make_inputs(lens, H=3, R=32, P=16, block_size=block_size, num_blocks=12)
    assert rel_err(paged_mla_decode(**x), loop(**x)) < 1e-6


@pytest.mark.parametrize("lens, firsts, block_size", [([9, 30, 5], [3, 17, 4], 8), ([63, 2], [0, 1], 64)])
def test_first_position_matches_loop(lens, firsts, block_size):
    x = make_inputs(lens, H=3, R=32, P=16, block_size=block_size, num_blocks=12)
    first_pos = torch.tensor(firsts)
    assert rel_err(paged_mla_decode(**x, first_pos=first_pos), loop(**x, first_pos=first_pos)) < 1e-6


def test_blocks_past_the_context_do_not_matter():
    x = make_inputs([5, 12], H=2, R=16, P=16, block_size=4, num_blocks=10)
    want = paged_mla_decode(**x)
    x["block_table"][0, 2:] = 9 - x["block_table"][0, 2:]  # row 0 uses columns 0 and 1 only
    torch.testing.assert_close(paged_mla_decode(**x), want, rtol=0, atol=0)


@pytest.mark.parametrize("name, bad, message", [
    ("q_rope", torch.randn(2, 3, 16), "must agree"),
    ("cache", torch.randn(40, 40), r"\[rows, R \+ P\]"),
    ("cache", torch.randn(40, 48, dtype=torch.float64), "share a dtype"),
    ("block_table", torch.zeros(3, 4, dtype=torch.int32), "block_table"),
    ("context_lens", torch.tensor([1, 2, 3]), "context_lens"),
    ("block_size", 0, "block_size"),
    ("first_pos", torch.tensor([1, 2], dtype=torch.int32), "first_pos"),
    ("first_pos", torch.tensor([1]), "first_pos"),
])
def test_rejects_bad_arguments(name, bad, message):
    x = make_inputs([5, 9], H=2, R=32, P=16, block_size=8, num_blocks=5)
    x[name] = bad
    with pytest.raises(ValueError, match=message):
        paged_mla_decode(**x)


def test_docstring_examples_run():
    run_doctests(paged_mla_module)


# bf16: the kernel rounds the softmax weights to bf16 before the value product, as the
# reference does; both against the float64 loop on the same bf16 inputs
GPU_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens, block_size, H", [
    ([1, 7, 64, 65, 200, 333], 64, 8),  # odd lengths, many blocks, one head tile half full
    ([1, 6144, 6145, 9000], 6144, 16),  # K3's physical block size, a row spanning two blocks
    ([17, 4099], 64, 20),  # heads over two tiles, the second nearly empty
    ([40000], 64, 8),  # one long row: every split busy
])
def test_triton_matches_reference(dtype, lens, block_size, H):
    num_blocks = sum(-(-n // block_size) + 1 for n in lens) + 4
    x = make_inputs(lens, H=H, R=512, P=64, block_size=block_size, num_blocks=num_blocks,
                    dtype=dtype, device="cuda")
    with nan_poisoned_empty():  # split outputs the kernel left unwritten would poison the merge
        got = paged_mla_decode(**x)
    assert got.dtype == dtype and got.shape == x["q_lat"].shape
    want = loop(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in x.items()})
    ref = paged_mla_decode_ref(**x)
    assert rel_err(got.cpu(), want) < GPU_TOL[dtype], rel_err(got.cpu(), want)
    assert rel_err(ref.cpu(), want) < GPU_TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_first_position_matches_loop(dtype):
    """Rows starting past 0 (the EAGLE draft's ``base``), inside and at the edge of a block; the
    cache before each row's first position is NaN, which the kernel must not read."""
    lens, firsts, block_size = [1, 200, 333, 64, 4099], [0, 199, 64, 17, 1000], 64
    W = -(-max(lens) // block_size) + 1
    x = make_inputs(lens, H=8, R=512, P=64, block_size=block_size, num_blocks=len(lens) * W,
                    dtype=dtype, device="cuda")
    # rows own disjoint blocks here, so poisoning one row's positions never touches another's
    x["block_table"] = torch.randperm(len(lens) * W, generator=torch.Generator().manual_seed(1)).view(
        len(lens), W).int().cuda()
    first_pos = torch.tensor(firsts, device="cuda")
    for b, first in enumerate(firsts):
        for t in range(first):
            x["cache"][int(x["block_table"][b, t // block_size]) * block_size + t % block_size] = float("nan")
    with nan_poisoned_empty():
        got = paged_mla_decode(**x, first_pos=first_pos)
    want = loop(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in x.items()}, first_pos=first_pos.cpu())
    assert rel_err(got.cpu(), want) < GPU_TOL[dtype], rel_err(got.cpu(), want)


_INTERPRETED = """
import torch
from openk3.ops.paged_mla import _paged_mla_decode_triton, num_splits
import openk3.ops.paged_mla as paged_mla
from tests.ops.test_paged_mla import loop, make_inputs, rel_err
paged_mla._num_sms = lambda device_index: 4  # the interpreter has no device properties
x = make_inputs([9, 30, 5, 40], H=3, R=32, P=16, block_size=8, num_blocks=16)
for first_pos in (None, torch.tensor([3, 17, 4, 0])):
    got = _paged_mla_decode_triton(**x, first_pos=first_pos)
    assert rel_err(got, loop(**x, first_pos=first_pos)) < 1e-5, rel_err(got, loop(**x, first_pos=first_pos))
# one row's length and first position broadcast over 3 queries (stride 0), as the EAGLE draft's
# verify rows of a batch of one pass them: the kernel must not read past them
x = make_inputs([12, 12, 12], H=3, R=32, P=16, block_size=8, num_blocks=16)
x["block_table"] = x["block_table"][:1].expand(3, -1)
meta = torch.tensor([[12, 5, 1000, -1000]])
x["context_lens"], first_pos = meta[:, 0].expand(3), meta[:, 1].expand(3)
assert x["context_lens"].stride(0) == 0 and first_pos.stride(0) == 0
dense = {**x, "context_lens": x["context_lens"].contiguous(), "block_table": x["block_table"].contiguous()}
got = _paged_mla_decode_triton(**x, first_pos=first_pos)
assert rel_err(got, loop(**dense, first_pos=first_pos.contiguous())) < 1e-5
# the merge kernel against its reference: split counts that fill no tile (3, 200), empty splits
# (lse -inf, zero outputs) and a row whose only tokens sit in its last split; outputs in bf16
from openk3.ops.paged_mla import _merge_splits_triton, merge_splits_ref
torch.manual_seed(0)
for B, H, S, R, dtype in ((3, 3, 3, 40, torch.float32), (2, 2, 200, 512, torch.bfloat16)):
    o_part, lse_part = torch.randn(B, H, S, R), 3 * torch.randn(B, H, S)
    lse_part[0, :, : S - 1] = float("-inf")
    o_part[0, :, : S - 1] = 0.0
    lse_part[1, 0, 1::2] = float("-inf")
    o_part[1, 0, 1::2] = 0.0
    got, want = _merge_splits_triton(o_part, lse_part, dtype), merge_splits_ref(o_part, lse_part, torch.float32)
    assert got.dtype == dtype and got.shape == (B, H, R)
    # fp32 sums in another order, then one rounding to the output dtype: one bf16 ulp (2^-7
    # relative), as Triton's interpreter truncates to bf16 where the GPU rounds to nearest
    bound = 1e-5 + (2.0 ** -7 if dtype == torch.bfloat16 else 0.0) * want.abs()
    assert ((got.float() - want).abs() <= bound).all(), (got.float() - want).abs().max()
    assert ((got[0].float() - o_part[0, :, S - 1]).abs() <= bound[0]).all()  # its one split's output
print("ok")
"""


def test_kernel_in_the_triton_interpreter():
    """The Triton kernels on the CPU (TRITON_INTERPRET=1, fp32), with and without first positions,
    and the split merge against its reference (bf16 output too); in a subprocess because the
    interpreter is chosen when the kernel is defined."""
    run_triton_interpreted(_INTERPRETED)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_in_a_cuda_graph_serves_longer_contexts():
    """Captured with one-token contexts, replayed over hundreds of tokens: the kernel's launch
    does not depend on the context, only the tensors it reads do."""
    x = make_inputs([300, 1000, 77], H=8, R=512, P=64, block_size=64, num_blocks=40,
                    dtype=torch.bfloat16, device="cuda")
    want = paged_mla_decode(**x)
    static_lens = torch.ones_like(x["context_lens"])
    args = {**x, "context_lens": static_lens}
    paged_mla_decode(**args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_mla_decode(**args)
    static_lens.copy_(x["context_lens"])
    graph.replay()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
