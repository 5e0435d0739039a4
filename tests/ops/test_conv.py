"""KDA's short convolution: the reference against a per-token loop written from the formula,
packed variable-length input against per-sequence calls, decode steps against the whole
sequence. The ``gpu`` tests compare fla-core's kernels with the fp32 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import openk3.ops.conv as conv_ops
from openk3.ops.conv import causal_conv1d, causal_conv1d_ref
from tests.ops.checks import (assert_all_close, cu_seqlens_of, nan_poisoned_empty, run_doctests,
                              run_with_grads)

W = 4  # K3's kernel size
# The reference and the loop sum the same four products in another order: rounding only.
FP32_TOL = 1e-6
# Odd lengths: single tokens, shorter than the state (W - 1 = 3), one past it, long.
LENGTHS = (1, 2, 7, 63, 3)


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def conv_loop(x, weight, conv_state):
    """y[b, t, c] = silu(sum_j w[c, j] * x_padded[b, t + j, c]), x_padded = [state, x];
    the new state is x_padded's last W-1 positions. x [B, T, C], conv_state [B, C, W-1]."""
    W = weight.shape[-1]
    x_padded = torch.cat([conv_state.transpose(1, 2), x], dim=1)  # [B, W-1+T, C]
    y = torch.zeros_like(x)
    for t in range(x.shape[1]):
        for j in range(W):
            y[:, t] += weight[:, 0, j] * x_padded[:, t + j]
    return F.silu(y), x_padded[:, x_padded.shape[1] - (W - 1):].transpose(1, 2)


def loop_per_sequence(lengths):
    """conv_loop on each sequence of a packed x [1, T, C] alone, with its own state row."""
    bounds = torch.tensor((0, *lengths)).cumsum(0).tolist()

    def run(x, weight, conv_state=None):
        if conv_state is None:
            conv_state = x.new_zeros(len(lengths), x.shape[-1], weight.shape[-1] - 1)
        outs = [conv_loop(x[:, a:b], weight, conv_state[i:i + 1])
                for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
        return torch.cat([y for y, _ in outs], dim=1), torch.cat([s for _, s in outs])
    return run


def conv_inputs(B, T, C, num_states=None, device="cpu", with_state=True):
    """x [B, T, C], weight [C, 1, W] and, with_state, conv_state [num_states or B, C, W-1]."""
    x = dict(x=torch.randn(B, T, C, device=device), weight=torch.randn(C, 1, W, device=device))
    if with_state:
        x["conv_state"] = torch.randn(num_states or B, C, W - 1, device=device)
    return x


def tolerances(names, tol) -> dict:
    # the state is a copy of inputs: exact
    return {name: 0.0 if name == "state" else tol for name in names}


@pytest.mark.parametrize("T", [1, 2, 7])
def test_matches_loop_with_and_without_state(T):
    x = conv_inputs(2, T, 6)
    y, new_state = causal_conv1d(**x)
    y_ref, state_ref = conv_loop(**x)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(new_state, state_ref, rtol=0, atol=0)
    y0, _ = causal_conv1d(x["x"], x["weight"])
    torch.testing.assert_close(y0, conv_loop(x["x"], x["weight"], torch.zeros(2, 6, W - 1))[0])


def test_split_and_short_steps():
    B, T, C = 2, 11, 5
    x, weight = torch.randn(B, T, C), torch.randn(C, 1, W)
    y_ref, state_ref = causal_conv1d(x, weight)
    # Prefill of 6, then a 2-token and three 1-token steps: both shorter than W - 1 = 3,
    # so the new state must keep the older inputs from the previous state.
    ys, state = [], None
    for lo, hi in [(0, 6), (6, 8), (8, 9), (9, 10), (10, 11)]:
        y, new_state = causal_conv1d(x[:, lo:hi], weight, state)
        if state is not None and hi - lo < W - 1:
            kept = W - 1 - (hi - lo)
            torch.testing.assert_close(new_state[..., :kept], state[..., -kept:])
        ys.append(y)
        state = new_state
    torch.testing.assert_close(torch.cat(ys, 1), y_ref)
    torch.testing.assert_close(state, state_ref)


@pytest.mark.parametrize("with_state", [False, True])
def test_varlen_matches_per_sequence_loop(with_state):
    x = conv_inputs(1, sum(LENGTHS), 6, num_states=len(LENGTHS), with_state=with_state)
    cu = cu_seqlens_of(LENGTHS)

    def packed(**inputs):
        return causal_conv1d(**inputs, cu_seqlens=cu)

    expected = run_with_grads(loop_per_sequence(LENGTHS), x, out_names=("y", "state"))
    actual = run_with_grads(packed, x, out_names=("y", "state"))
    assert actual["state"].shape == (len(LENGTHS), 6, W - 1)
    assert_all_close(actual, expected, tolerances(expected, FP32_TOL))


@pytest.mark.parametrize("B", [1, 3])
def test_batch_rows_are_sequences(B):
    # A [B, T, C] batch equals the same rows packed with cu_seqlens: one path in the reference,
    # two in fla, whose kernels index batch rows and packed sequences differently.
    x = conv_inputs(B, 5, 6)
    y, state = causal_conv1d(**x)
    y_packed, state_packed = causal_conv1d(x["x"].reshape(1, B * 5, 6), x["weight"],
                                           x["conv_state"], cu_seqlens_of([5] * B))
    torch.testing.assert_close(y_packed.reshape(B, 5, 6), y, rtol=0, atol=0)
    torch.testing.assert_close(state_packed, state, rtol=0, atol=0)


def test_decode_steps_match_full_sequence():
    x = conv_inputs(3, 9, 6)
    y_ref, state_ref = causal_conv1d(**x)
    ys, state = [], x["conv_state"]
    with torch.no_grad():
        for t in range(9):
            y, state = causal_conv1d(x["x"][:, t:t + 1], x["weight"], state)
            ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 1), y_ref)
    torch.testing.assert_close(state, state_ref, rtol=0, atol=0)


def test_concatenated_channels_match_separate_calls():
    # depthwise: q|k|v side by side in one call give the three calls' results
    parts = [conv_inputs(1, sum(LENGTHS), C, num_states=len(LENGTHS)) for C in (6, 6, 4)]
    cu = cu_seqlens_of(LENGTHS)
    y, state = causal_conv1d(*(torch.cat([p[n] for p in parts], dim=dim)
                               for n, dim in (("x", -1), ("weight", 0), ("conv_state", 1))), cu)
    separate = [causal_conv1d(**p, cu_seqlens=cu) for p in parts]
    torch.testing.assert_close(y, torch.cat([y for y, _ in separate], -1))  # vectorised sums
    torch.testing.assert_close(state, torch.cat([s for _, s in separate], 1), rtol=0, atol=0)


def test_bf16_input_gives_bf16_output_and_state():
    x = {n: t.bfloat16() for n, t in conv_inputs(2, 7, 6).items()}
    y, state = causal_conv1d(**x)
    y_ref, state_ref = conv_loop(**{n: t.double() for n, t in x.items()})
    assert y.dtype == state.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), y_ref, rtol=2 ** -8, atol=1e-6)  # one bf16 rounding
    torch.testing.assert_close(state.double(), state_ref, rtol=0, atol=0)


def test_reference_reads_no_unwritten_memory():
    x = conv_inputs(1, sum(LENGTHS), 6, num_states=len(LENGTHS))
    cu = cu_seqlens_of(LENGTHS)
    y, state = causal_conv1d_ref(**x, cu_seqlens=cu)
    with nan_poisoned_empty():
        assert all(t.isnan().all() for t in (torch.empty(3), torch.empty_like(y), y.new_empty(2)))
        y_poisoned, state_poisoned = causal_conv1d_ref(**x, cu_seqlens=cu)
    torch.testing.assert_close(y_poisoned, y, rtol=0, atol=0)
    torch.testing.assert_close(state_poisoned, state, rtol=0, atol=0)


@pytest.mark.parametrize("name,bad,message", [
    ("x", torch.randn(10, 6), "`x`"),
    ("weight", torch.randn(6, W), "`weight`"),
    ("weight", torch.randn(5, 1, W), "`weight`"),
    ("conv_state", torch.randn(2, 6, W), "`conv_state`"),
    ("cu_seqlens", torch.tensor([0, 3, 5]), "cu_seqlens"),  # needs a packed [1, T, C] input
    ("backend", "cuda", "`backend`"),
])
def test_rejects_bad_arguments(name, bad, message):
    kwargs = conv_inputs(2, 5, 6) | {name: bad}
    with pytest.raises(ValueError, match=message):
        causal_conv1d(**kwargs)


def test_varlen_state_needs_one_row_per_sequence():
    x = conv_inputs(1, 5, 6, num_states=3)
    with pytest.raises(ValueError, match=r"`conv_state` must be \[N, C, W-1\]"):
        causal_conv1d(**x, cu_seqlens=torch.tensor([0, 2, 5]))


def test_fla_backend_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        causal_conv1d(**conv_inputs(1, 3, 6), backend="fla")


def test_docstring_examples_run():
    run_doctests(conv_ops)


# Relative errors of fla's kernels against the fp32 reference on the same values. fp32: the
# same products summed in another order. bf16: fla rounds each output once from fp32 (at most
# 2^-9 relative), and its dy arrives rounded to bf16; the new state is a copy, exact in both.
FLA_TOLS = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def fla_vs_reference(x: dict, dtype: torch.dtype, weight_dtype: torch.dtype | None = None,
                     backend: str = "fla", **kwargs) -> tuple[dict, dict]:
    """fla (or another ``backend``) on ``x`` cast to dtype (the weight to weight_dtype, by
    default dtype too), writing into NaN-poisoned buffers; the reference on the same values in
    fp32. Returns the outputs and gradients of both."""
    low = {n: t.to((weight_dtype or dtype) if n == "weight" else dtype) for n, t in x.items()}

    def run(backend):
        return lambda **inputs: causal_conv1d(**inputs, **kwargs, backend=backend)

    with nan_poisoned_empty():
        actual = run_with_grads(run(backend), low, out_names=("y", "state"))
    expected = run_with_grads(run("torch"), {n: t.float() for n, t in low.items()},
                              out_names=("y", "state"))
    assert actual["y"].dtype == actual["state"].dtype == dtype
    return actual, expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,weight_dtype", [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),  # a bf16 model (serving)
    (torch.bfloat16, torch.float32),   # autocast training: fp32 weights, bf16 activations
], ids=["fp32", "bf16", "bf16-fp32weight"])
# one length: a [3, T, C] batch; several: one packed row with cu_seqlens, whose lengths are
# odd, shorter than the state, and on both sides of the edges of fla's 64-token tiles
@pytest.mark.parametrize("lengths", [(1,), (2,), (63,), (1000,), (*LENGTHS, 200, 64, 65)],
                         ids=["T1", "T2", "T63", "T1000", "packed"])
@pytest.mark.parametrize("with_state", [False, True], ids=["no_state", "state"])
def test_fla_matches_reference(dtype, weight_dtype, lengths, with_state):
    kwargs = {}
    if len(lengths) == 1:
        x = conv_inputs(3, lengths[0], 384, device="cuda", with_state=with_state)
    else:
        x = conv_inputs(1, sum(lengths), 384, num_states=len(lengths), device="cuda",
                        with_state=with_state)
        cu = cu_seqlens_of(lengths, device="cuda")
        kwargs = dict(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    actual, expected = fla_vs_reference(x, dtype, weight_dtype, **kwargs)
    assert_all_close(actual, expected, tolerances(expected, FLA_TOLS[dtype]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_state", [False, True], ids=["no_state", "state"])
def test_fla_decode_steps_match_reference(dtype, with_state):
    # without autograd a one-token step runs fla's update kernel, in place on a padded state
    x = conv_inputs(4, 9, 384, device="cuda")
    low = {n: t.to(dtype) for n, t in x.items()}
    state = low["conv_state"] if with_state else None
    before = low["conv_state"].clone()
    ys = []
    with torch.no_grad(), nan_poisoned_empty():
        for t in range(9):
            y, state = causal_conv1d(low["x"][:, t:t + 1], low["weight"], state, backend="fla")
            ys.append(y)
    torch.testing.assert_close(low["conv_state"], before, rtol=0, atol=0)  # not modified
    y_ref, state_ref = causal_conv1d(low["x"].float(), low["weight"].float(),
                                     low["conv_state"].float() if with_state else None,
                                     backend="torch")
    assert_all_close({"y": torch.cat(ys, 1), "state": state},
                     {"y": y_ref, "state": state_ref}, tolerances(("y", "state"), FLA_TOLS[dtype]))


# ---- openk3's Triton kernels: training's convolution (no state, no cu_seqlens) ----

def test_triton_backend_rejects_state_with_autograd_and_cpu():
    x = conv_inputs(2, 5, 6)
    with pytest.raises(ValueError, match="has no backward"):
        causal_conv1d(x["x"].clone().requires_grad_(), x["weight"], x["conv_state"], backend="triton")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        causal_conv1d(**x, backend="triton")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        causal_conv1d(x["x"], x["weight"], backend="triton")
    with pytest.raises(ValueError, match="written for 4 taps"):
        causal_conv1d(x["x"], x["weight"][..., :3], backend="triton")


_INTERPRETED_TRAINING = """
import torch
import openk3.ops.conv as conv_ops
from openk3.ops.conv import causal_conv1d
torch.manual_seed(0)
# odd sizes against the blocks; x a column slice (a row stride that is not C), dy transposed
# (no unit stride); T = 1 and 2 shorter than the state, 3 and 4 at its edge (the backward's
# three-row halo past T), blocks of positions that T fills once, partly or several times
for B, T, C, blocks in [(2, 37, 40, ((16, 32, 4), (8, 32, 4))), (1, 2, 5, ((16, 32, 4), (16, 32, 4))),
                        (1, 70, 20, ((64, 32, 4), (32, 16, 4))), (2, 1, 9, ((16, 32, 4), (4, 32, 4))),
                        (1, 3, 9, ((16, 32, 4), (8, 32, 4))), (2, 4, 9, ((16, 32, 4), (4, 32, 4))),
                        (2, 37, 40, ((16, 32, 4), (16, 64, 1)))]:
    conv_ops.FWD_BLOCKS, conv_ops.BWD_BLOCKS = blocks
    x, w = torch.randn(B, T, C + 5)[..., 2:C + 2], torch.randn(C, 1, 4)
    dy = torch.randn(C, T, B).permute(2, 1, 0)
    got, want = [], []
    for backend, dtype, out in (("triton", torch.float32, got), ("torch", torch.float64, want)):
        xs, ws = (t.detach().to(dtype).requires_grad_() for t in (x, w))
        y, state = causal_conv1d(xs, ws, backend=backend)
        (y * dy.to(dtype)).sum().backward()
        out += [y, xs.grad, ws.grad, state]
        if backend == "triton":  # a copy: a view would keep all of x alive with the state
            assert state.untyped_storage().data_ptr() != xs.untyped_storage().data_ptr()
    for name, a, b in zip(("y", "dx", "dweight", "state"), got, want):
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert err < 1e-5, (name, B, T, C, err)
print("ok")
"""


def test_triton_kernels_in_the_triton_interpreter():
    """Forward and backward (dx and dweight) on the CPU (TRITON_INTERPRET=1, fp32) against the
    fp64 reference's autograd, on sizes that are not multiples of the blocks."""
    from tests.ops.checks import run_triton_interpreted

    run_triton_interpreted(_INTERPRETED_TRAINING)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,weight_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32)], ids=["fp32", "bf16-fp32weight"])
@pytest.mark.parametrize("T", [1, 2, 63, 1000])
def test_triton_matches_reference(dtype, weight_dtype, T):
    x = conv_inputs(3, T, 384, device="cuda", with_state=False)
    x["x"] = torch.randn(3, T, 3 * 384, device="cuda")[..., 384:2 * 384]  # a column slice, as the fused projection's
    actual, expected = fla_vs_reference(x, dtype, weight_dtype, backend="triton")
    assert_all_close(actual, expected, tolerances(expected, FLA_TOLS[dtype]))
    low = {n: t.to(weight_dtype if n == "weight" else dtype) for n, t in x.items()}
    auto = run_with_grads(lambda **i: causal_conv1d(**i), low, out_names=("y", "state"))
    triton = run_with_grads(lambda **i: causal_conv1d(**i, backend="triton"), low, out_names=("y", "state"))
    assert_all_close(auto, triton, tolerances(auto, 0.0))  # "auto" takes these kernels here


# ---- causal_conv1d_update_: one token per row, the states in a pool, updated in place ----

def pooled_inputs(B=3, C=10, n=6, W=W, device="cpu", dtype=torch.float32):
    """x [B, C] as a column slice of a wider tensor (a row stride, as the fused projection's
    q|k|v columns are), weight [C, 1, W], pool [n, C, W-1], distinct slots in no order."""
    wide = torch.randn(B, C + 5, device=device, dtype=dtype)
    return dict(x=wide[:, 2:C + 2], weight=torch.randn(C, 1, W, device=device, dtype=dtype),
                pool=torch.randn(n, C, W - 1, device=device, dtype=dtype),
                slots=torch.randperm(n, device=device)[:B])


@pytest.mark.parametrize("width", [2, 4])
def test_pooled_update_matches_the_loop_and_leaves_other_rows(width):
    x = pooled_inputs(W=width)
    pool = x["pool"].clone()
    y = conv_ops.causal_conv1d_update_(**x)[0]
    want_y, want_state = conv_loop(x["x"][:, None], x["weight"], pool[x["slots"]])
    assert_all_close({"y": y, "state": x["pool"][x["slots"]]},
                     {"y": want_y[:, 0], "state": want_state}, {"y": FP32_TOL, "state": 0.0})
    others = torch.ones(len(pool), dtype=torch.bool)
    others[x["slots"]] = False
    assert torch.equal(x["pool"][others], pool[others])


def test_pooled_update_steps_match_the_whole_sequence():
    xs, weight = torch.randn(2, 7, 6), torch.randn(6, 1, W)
    pool, slots = torch.zeros(4, 6, W - 1), torch.tensor([3, 0])
    ys = [torch.cat(tuple(conv_ops.causal_conv1d_update_(xs[:, t], weight, pool, slots, parts=2)), -1)
          for t in range(7)]
    want_y, want_state = conv_loop(xs, weight, torch.zeros(2, 6, W - 1))
    assert_all_close({"y": torch.stack(ys, 1), "state": pool[slots]}, {"y": want_y, "state": want_state},
                     {"y": FP32_TOL, "state": 0.0})


@pytest.mark.parametrize("name,bad,message", [
    ("x", torch.randn(3, 1, 10), "`x` must be"),
    ("weight", torch.randn(10, 1, 1), "W >= 2"),
    ("pool", torch.randn(6, 3, 10).transpose(1, 2), "contiguous"),
    ("slots", torch.tensor([0.0, 1.0, 2.0]), "`slots` must be"),
    ("parts", 3, "`parts` must divide"),
])
def test_pooled_update_rejects_bad_arguments(name, bad, message):
    with pytest.raises(ValueError, match=message):
        conv_ops.causal_conv1d_update_(**{**pooled_inputs(), name: bad})


_INTERPRETED_UPDATE = """
import torch
from openk3.ops.conv import _conv_pooled_triton, _conv_update_triton, causal_conv1d_pooled, causal_conv1d_update_
from tests.ops.test_conv import pooled_inputs, verify_inputs
torch.manual_seed(0)
# 2502: three channel blocks, the last one short; parts 3: q|k|v each written contiguous
for width, C, parts in ((4, 10, 1), (4, 2502, 3), (2, 7, 1)):
    x = pooled_inputs(B=3, C=C, n=5, W=width)
    pool = x["pool"].clone()
    got = _conv_update_triton(x["x"], x["weight"], x["pool"], x["slots"], parts)
    want = causal_conv1d_update_(x["x"], x["weight"], pool, x["slots"], parts=parts, backend="torch")
    assert got.shape == want.shape == (parts, 3, C // parts), got.shape
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()
    assert torch.equal(x["pool"], pool), "the pool rows differ from the reference's"
# causal_conv1d_pooled: T below, at and past the state's W-1 columns
for width, T, C, parts in ((4, 1, 12, 1), (4, 3, 2502, 3), (4, 6, 12, 3), (2, 4, 7, 1)):
    x = verify_inputs(T=T, C=C, W=width)
    pool = x["pool"].clone()
    got = _conv_pooled_triton(x["x"], x["weight"], x["pool"], x["slots"], parts)
    want = causal_conv1d_pooled(x["x"], x["weight"], pool, x["slots"], parts=parts, backend="torch")
    assert got.shape == want.shape == (parts, 3, T, C // parts), got.shape
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()
    assert torch.equal(x["pool"], pool), "the kernel wrote the pool"
    step = _conv_update_triton(x["x"][:1, 0], x["weight"], pool, x["slots"][:1], parts)
    assert torch.equal(got[:, :1, 0], step), "the first token differs from the decode kernel's"
print("ok")
"""


def test_pooled_kernels_in_the_triton_interpreter():
    """The Triton kernels on the CPU (TRITON_INTERPRET=1, fp32) against the reference: the
    update's output and every pool row (the slots' updated, the others untouched); the verify
    convolution's output, the pool untouched, a row's first token bit for bit the update
    kernel's (one subprocess for both)."""
    from tests.ops.checks import run_triton_interpreted

    run_triton_interpreted(_INTERPRETED_UPDATE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pooled_update_kernel_matches_reference_gpu(dtype):
    x = pooled_inputs(B=5, C=3 * 1024, n=9, device="cuda", dtype=dtype)
    pool = x["pool"].clone()
    with nan_poisoned_empty():
        got = conv_ops.causal_conv1d_update_(**x, parts=3)
    want = conv_ops.causal_conv1d_update_(**{**x, "pool": pool}, parts=3, backend="torch")
    assert_all_close({"y": got, "state": x["pool"]}, {"y": want, "state": pool},
                     {"y": FLA_TOLS[dtype], "state": 0.0})


# ---- causal_conv1d_pooled: T tokens per row after pool states, read and not written ----

def verify_inputs(B=3, T=4, C=12, n=6, W=W, device="cpu", dtype=torch.float32):
    """x [B, T, C] as a column slice of a wider tensor (the fused projection's q|k|v columns),
    weight [C, 1, W], pool [n, C, W-1], slots with the scratch row 0 twice (padding rows)."""
    wide = torch.randn(B, T, C + 7, device=device, dtype=dtype)
    return dict(x=wide[..., 3:C + 3], weight=torch.randn(C, 1, W, device=device, dtype=dtype),
                pool=torch.randn(n, C, W - 1, device=device, dtype=dtype),
                slots=torch.tensor([4, 0, 0][:B], device=device))


@pytest.mark.parametrize("width,T", [(4, 1), (4, 2), (4, 5), (2, 3)])
def test_pooled_verify_conv_matches_the_loop_and_writes_nothing(width, T):
    x = verify_inputs(T=T, W=width)
    pool = x["pool"].clone()
    y = conv_ops.causal_conv1d_pooled(**x, parts=3)
    want, _ = conv_loop(x["x"], x["weight"], pool[x["slots"]])
    assert y.shape == (3, 3, T, 4)
    assert_all_close({"y": torch.cat(tuple(y), -1)}, {"y": want}, {"y": FP32_TOL})
    assert torch.equal(x["pool"], pool)


@pytest.mark.parametrize("name,bad,message", [
    ("x", torch.randn(3, 12), "`x` must be"),
    ("weight", torch.randn(12, 1, 1), "W >= 2"),
    ("pool", torch.randn(6, 3, 12).transpose(1, 2), "contiguous"),
    ("slots", torch.tensor([0.0, 1.0, 2.0]), "`slots` must be"),
])
def test_pooled_verify_conv_rejects_bad_arguments(name, bad, message):
    with pytest.raises(ValueError, match=message):
        conv_ops.causal_conv1d_pooled(**{**verify_inputs(), name: bad})





@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pooled_verify_kernel_matches_reference_gpu(dtype):
    x = verify_inputs(B=3, T=8, C=3 * 1024, n=9, device="cuda", dtype=dtype)
    pool = x["pool"].clone()
    with nan_poisoned_empty():
        got = conv_ops.causal_conv1d_pooled(**x, parts=3)
    want = conv_ops.causal_conv1d_pooled(**{**x, "pool": pool}, parts=3, backend="torch")
    assert_all_close({"y": got}, {"y": want}, {"y": FLA_TOLS[dtype]})
    assert torch.equal(x["pool"], pool)
    step = conv_ops.causal_conv1d_update_(x["x"][:1, 0], x["weight"], pool, x["slots"][:1], parts=3)
    assert torch.equal(got[:, :1, 0], step)  # the decode kernel's taps, bit for bit


# ---- openk3's Triton kernels: the serving prefill's convolution (a state, packed sequences) ----

_INTERPRETED_VARLEN = """
import torch
from openk3.ops.conv import causal_conv1d
torch.manual_seed(0)
# packed sequences shorter than the state, at its edge and longer than a block of positions; x a
# column slice of a wider projection (row stride != C); B rows with a state and no cu_seqlens
for W, lengths, C in ((4, (1, 2, 7, 63, 3), 70), (2, (5, 1, 40), 9), (4, (3,), 33)):
    cu = torch.tensor((0, *lengths)).cumsum(0)
    x, w = torch.randn(1, int(cu[-1]), C + 5)[..., 2:C + 2], torch.randn(C, 1, W)
    for state in (None, torch.randn(len(lengths), C, W - 1)):
        y, new = causal_conv1d(x, w, state, cu, backend="triton")
        y_ref, new_ref = causal_conv1d(x.double(), w.double(), None if state is None else state.double(),
                                       cu, backend="torch")
        assert ((y.double() - y_ref).abs().max() / y_ref.abs().max()).item() < 1e-5, (W, lengths, "y")
        assert torch.equal(new.double(), new_ref), (W, lengths, "state")
x, w, state = torch.randn(3, 6, 10), torch.randn(10, 1, 4), torch.randn(3, 10, 3)
with torch.no_grad():
    y, new = causal_conv1d(x, w, state, backend="triton")
y_ref, new_ref = causal_conv1d(x, w, state, backend="torch")
assert (y - y_ref).abs().max().item() < 1e-5 and torch.equal(new, new_ref)
# q|k|v written apart (parts=3): each part contiguous, the same values as the columns of y
x, w, state = torch.randn(1, 70, 3 * 16 + 4)[..., 4:], torch.randn(48, 1, 4), torch.randn(2, 48, 3)
cu = torch.tensor([0, 5, 70])
with torch.no_grad():
    (q, k, v), new = causal_conv1d(x, w, state, cu, parts=3, backend="triton")
y_ref, new_ref = causal_conv1d(x, w, state, cu, backend="torch")
assert all(t.is_contiguous() and t.shape == (1, 70, 16) for t in (q, k, v))
assert (torch.cat([q, k, v], -1) - y_ref).abs().max().item() < 1e-5 and torch.equal(new, new_ref)
print("ok")
"""


def test_varlen_kernels_in_the_triton_interpreter():
    """The prefill's kernels on the CPU (TRITON_INTERPRET=1, fp32) against the fp64 reference:
    packed sequences with and without a state, 2 and 4 taps, and rows with a state; the new
    state is a copy of inputs, so exact."""
    from tests.ops.checks import run_triton_interpreted

    run_triton_interpreted(_INTERPRETED_VARLEN)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths", [(1,), (1000,), (*LENGTHS, 200, 64, 65)], ids=["T1", "T1000", "packed"])
@pytest.mark.parametrize("with_state", [False, True], ids=["no_state", "state"])
def test_varlen_triton_matches_reference(dtype, lengths, with_state):
    """Without autograd, ``auto`` takes openk3's varlen kernels for a state or packed input (the
    serving prefill): against the fp32 reference, x a column slice as the fused projection's."""
    C = 384
    x = conv_inputs(1, sum(lengths), C, num_states=len(lengths), device="cuda", with_state=with_state)
    x["x"] = torch.randn(1, sum(lengths), 3 * C, device="cuda")[..., C:2 * C]
    cu = cu_seqlens_of(lengths, device="cuda")
    low = {n: t.to(dtype) for n, t in x.items()}
    with torch.no_grad(), nan_poisoned_empty():
        got = dict(zip(("y", "state"), causal_conv1d(**low, cu_seqlens=cu)))
    want = dict(zip(("y", "state"), causal_conv1d(**{n: t.float() for n, t in low.items()}, cu_seqlens=cu,
                                                  backend="torch")))
    assert got["y"].dtype == got["state"].dtype == dtype
    assert_all_close(got, want, tolerances(want, FLA_TOLS[dtype]))


def test_parts_are_the_columns_of_y():
    x, w, state = torch.randn(2, 9, 12), torch.randn(12, 1, 4), torch.randn(2, 12, 3)
    y, new = causal_conv1d(x, w, state)
    parts, new3 = causal_conv1d(x, w, state, parts=3)
    assert len(parts) == 3 and torch.equal(torch.cat(parts, -1), y) and torch.equal(new3, new)
    with pytest.raises(ValueError, match="`parts` must divide the 12 channels"):
        causal_conv1d(x, w, state, parts=5)
