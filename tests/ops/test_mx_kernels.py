"""Routed experts from MXFP4-packed weights (``openk3.ops.mx_moe``, ``openk3.model.packed_experts``):
the two references against each other and against ``RoutedExperts`` on dequantised weights,
argument checks by name; the Triton kernels in the CPU interpreter (tiny, fp32, when triton
imports) and, on GPU, against the references (every E2M1 code, NaN-poisoned buffers, sizes that
divide no tile, offsets past 2^31, inside a CUDA graph)."""


import pytest
import torch

import openk3.model.packed_experts
import openk3.ops.mx_moe
from openk3 import preset
from openk3.model.moe import RoutedExperts
from openk3.model.packed_experts import PACKED_GEMV_MAX_PAIRS, PackedRoutedExperts, pack_experts
from openk3.ops.moe import moe_gemv_ref
from openk3.ops.mx_moe import (
    MXFP4Weight,
    mxfp4_grouped_experts,
    mxfp4_grouped_experts_ref,
    mxfp4_moe_gemv,
    mxfp4_moe_gemv_ref,
)
from tests.ops.checks import (
    nan_poisoned_empty,
    rel_err,
    run_doctests,
    run_triton_interpreted,
)

# (E, k, F, D): `small`'s MoE layer, and sizes that fill no kernel tile (the GEMV reads 512
# inputs per step, the grouped GEMM 64 outputs and 64 inputs; widths must be multiples of 32)
SHAPES = {"small": (64, 4, 256, 512), "odd": (5, 2, 96, 160), "odd-wide": (7, 3, 224, 96)}
ACT = {"situ": {"hidden_act": "situ", "situ_beta1": 4.0, "situ_beta2": 25.0},
       "silu": {"hidden_act": "silu", "situ_beta1": 4.0, "situ_beta2": 25.0}}


def packed_weights(E, F, D, device="cpu", seed=0) -> tuple[MXFP4Weight, MXFP4Weight, MXFP4Weight]:
    """w1, w3 [E, F, D], w2 [E, D, F] of uniformly random bytes (every E2M1 code in both nibbles,
    about equally often) and scales of about 0.6 / sqrt(fan_in), so activations stay O(1). Made
    on ``device`` (K3-sized stacks would take long on the host)."""
    gen = torch.Generator(device).manual_seed(seed)

    def one(rows, cols):
        packed = torch.randint(0, 256, (E, rows, cols // 2), generator=gen, dtype=torch.uint8,
                               device=device)
        centre = 127 + round(torch.log2(torch.tensor(0.6 / cols ** 0.5)).item())
        scale = torch.randint(centre - 2, centre + 2, (E, rows, cols // 32), generator=gen,
                              dtype=torch.uint8, device=device)
        return MXFP4Weight(packed, scale)

    return one(F, D), one(F, D), one(D, F)


def packed_module(cfg, D, weights, device="cpu") -> PackedRoutedExperts:
    """PackedRoutedExperts holding ``weights`` (w1, w3, w2) byte for byte."""
    packed = PackedRoutedExperts(cfg, D, device=device)
    for name, w in zip(("w1", "w3", "w2"), weights):
        getattr(packed, f"{name}_packed").copy_(w.packed)
        getattr(packed, f"{name}_scale").copy_(w.scale)
    return packed


def dense_twin(cfg, D, weights) -> RoutedExperts:
    """RoutedExperts holding ``weights``' decoded values (exact in fp32)."""
    dense = RoutedExperts(cfg, D)
    with torch.no_grad():
        for name, w in zip(("w1", "w3", "w2"), weights):
            getattr(dense, name).copy_(w.dequantize())
    return dense


def routing(N, E, k, device="cpu", seed=1):
    """topk_idx [N, k] (k distinct experts per token) and topk_weight [N, k] (positive)."""
    gen = torch.Generator().manual_seed(seed)
    topk_idx = torch.rand(N, E, generator=gen).topk(k).indices
    topk_weight = torch.rand(N, k, generator=gen) + 0.1
    return topk_idx.to(device), topk_weight.to(device)


def sorted_rows(topk_idx, x, E):
    """(xs, counts): x's rows repeated per slot and sorted by expert, as forward_sorted does."""
    flat = topk_idx.reshape(-1)
    order = flat.argsort(stable=True)
    return x[order // topk_idx.shape[1]], torch.bincount(flat, minlength=E)


def config(E, k, F, act="situ"):
    return preset("debug").replace(num_experts=E, num_experts_per_token=k, moe_intermediate_size=F,
                                   hidden_act=act)


def test_examples_in_docstrings_run():
    run_doctests(openk3.ops.mx_moe)
    run_doctests(openk3.model.packed_experts)


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_grouped_reference_equals_the_gemv_reference(act):
    """The two references (sorted loop, per-pair gather) compute the same fp32 function."""
    E, k, F, D = SHAPES["odd"]
    w1, w3, w2 = packed_weights(E, F, D)
    N = 9
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(2))
    topk_idx, topk_weight = routing(N, E, k)
    xs, counts = sorted_rows(topk_idx, x, E)
    ys = mxfp4_grouped_experts(xs, counts, w1, w3, w2, **ACT[act])
    assert ys.dtype == torch.float32 and ys.shape == (N * k, D)
    order = topk_idx.reshape(-1).argsort(stable=True)
    y = torch.zeros(N, D).index_add_(0, order // k, ys * topk_weight.reshape(-1)[order, None])
    want = mxfp4_moe_gemv(x, w1, w3, w2, topk_idx, topk_weight, **ACT[act])
    assert rel_err(y, want) < 1e-6


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("N", [1, 6])
def test_packed_module_equals_routed_experts_on_the_dequantised_weights(act, N):
    """Bitwise on the CPU: the decoded weights are exact in fp32 and the packed module runs the
    same sort, loop, matmuls and sums as RoutedExperts' reference path."""
    E, k, F, D = SHAPES["odd"]
    cfg = config(E, k, F, act)
    weights = packed_weights(E, F, D)
    dense, packed = dense_twin(cfg, D, weights), packed_module(cfg, D, weights)
    with torch.no_grad():
        x = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
        topk_idx, topk_weight = routing(N, E, k)
        got = packed(x, topk_idx, topk_weight)
        assert got.dtype == torch.float32 and torch.equal(got, dense(x, topk_idx, topk_weight))


@pytest.mark.parametrize("N", [1, 6])
def test_packed_module_with_mxfp8_inputs_equals_the_qat_forward(N):
    """Rollout/training agreement (issue P10 item 4), bitwise on the CPU: packed experts with
    ``qat="mxfp4"`` round x and h to MXFP8 as ``run_experts(qat="mxfp4")`` does; the QAT
    module's weights are the decoded bytes, which its MXFP4 quantiser returns unchanged."""
    E, k, F, D = SHAPES["odd"]
    cfg = config(E, k, F)
    weights = packed_weights(E, F, D)
    dense, packed = dense_twin(cfg, D, weights), packed_module(cfg, D, weights)
    dense.qat = "mxfp4"
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
    topk_idx, topk_weight = routing(N, E, k)
    with torch.no_grad():
        plain = packed(x, topk_idx, topk_weight)
        packed.qat = "mxfp4"
        assert "mxfp8 inputs" in repr(packed)
        got = packed(x, topk_idx, topk_weight)
        assert torch.equal(got, dense(x, topk_idx, topk_weight))
    assert rel_err(plain, got) > 1e-3  # the rounding is there: E4M3 keeps 3 mantissa bits


def test_mxfp8_inputs_in_the_gemv_reference_match_the_grouped_reference():
    """The per-pair reference rounds the same x and h: equal up to fp32 summation order, which
    can move an h value across an E4M3 rounding boundary (one step: 2^-4 relative) only rarely."""
    E, k, F, D = SHAPES["odd"]
    w1, w3, w2 = packed_weights(E, F, D)
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(2))
    topk_idx, topk_weight = routing(9, E, k)
    xs, counts = sorted_rows(topk_idx, x, E)
    order = topk_idx.reshape(-1).argsort(stable=True)
    ys = mxfp4_grouped_experts(xs, counts, w1, w3, w2, **ACT["situ"], mxfp8_inputs=True)
    y = torch.zeros(9, D).index_add_(0, order // k, ys * topk_weight.reshape(-1)[order, None])
    args = (x, w1, w3, w2, topk_idx, topk_weight)
    want = mxfp4_moe_gemv(*args, **ACT["situ"], mxfp8_inputs=True)
    assert rel_err(y, want) < 1e-4
    assert rel_err(mxfp4_moe_gemv(*args, **ACT["situ"]), want) > 1e-3


def test_pack_experts_quantises_with_the_export_quantiser_at_4_25_bits_per_weight():
    E, k, F, D = SHAPES["odd"]
    dense = RoutedExperts(config(E, k, F), D)
    with torch.no_grad():
        for w in (dense.w1, dense.w3, dense.w2):
            w.normal_(0, 0.1)
    packed = PackedRoutedExperts.from_experts(dense)
    assert not list(packed.parameters())
    for name in ("w1", "w3", "w2"):
        want = MXFP4Weight.quantize(getattr(dense, name).detach())
        assert torch.equal(packed.weight(name).packed, want.packed)
        assert torch.equal(packed.weight(name).scale, want.scale)
    bits = 8 * sum(b.numel() for b in packed.buffers()) / sum(w.numel() for w in dense.parameters())
    assert bits == 4.25
    assert packed.to(torch.bfloat16).w1_packed.dtype == torch.uint8  # model.to(dtype) keeps bytes


def test_pack_experts_replaces_every_moe_layer_once():
    from openk3 import build_model

    model = pack_experts(build_model(preset("debug").replace(num_nextn_predict_layers=1), device="meta"))
    kinds = [type(m.experts) for m in model.modules() if hasattr(m, "experts")]
    assert kinds and set(kinds) == {PackedRoutedExperts}  # main layers and the MTP layer
    first = model.model.layers[1].mlp.experts
    assert pack_experts(model).model.layers[1].mlp.experts is first


def test_packed_module_refuses_gradients_by_name():
    E, k, F, D = SHAPES["odd"]
    packed = PackedRoutedExperts(config(E, k, F), D)
    topk_idx, topk_weight = routing(2, E, k)
    x = torch.randn(2, D, requires_grad=True)
    with pytest.raises(ValueError, match="PackedRoutedExperts .* serve only.*no_grad"):
        packed(x, topk_idx, topk_weight)
    with pytest.raises(ValueError, match=f"widths divisible by 32: expert input width {D + 16}"):
        PackedRoutedExperts(config(E, k, F), D + 16)


def _bad_args():
    E, k, F, D = SHAPES["odd"]
    w1, w3, w2 = packed_weights(E, F, D)
    topk_idx, topk_weight = routing(3, E, k)
    good = dict(x=torch.randn(3, D), w1=w1, w3=w3, w2=w2, topk_idx=topk_idx,
                topk_weight=topk_weight, **ACT["situ"])
    cases = [
        ("x", torch.randn(1, 3, D), "`x`"),
        ("w1", MXFP4Weight(w1.packed.float(), w1.scale), r"`w1.packed` must be uint8"),
        ("w1", MXFP4Weight(w1.packed, w1.scale.to(torch.int8)), r"`w1.scale` must be uint8"),
        ("w1", MXFP4Weight(w1.packed, w1.scale[:, :, :-1]), r"`w1.scale` must be \[E, rows, cols/32\]"),
        ("w1", MXFP4Weight(w1.packed[:, :, :-8], w1.scale), "not a multiple of the MX block"),
        ("w3", MXFP4Weight(w3.packed[:, :-1], w3.scale[:, :-1]), r"`w3` must hold \[E, 96, 160\]"),
        ("w3", MXFP4Weight(w3.packed.transpose(0, 1).contiguous().transpose(0, 1), w3.scale),
         "`w3` must be laid out like `w1`"),
        ("w2", w1, r"`w2` must hold \[E, 160, 96\]"),
        ("w2", MXFP4Weight(w2.packed[:2], w2.scale[:2]), "`w2` holds 2 experts, w1 5"),
        ("topk_idx", topk_idx.float(), "`topk_idx`"),
        ("topk_weight", topk_weight[:, :1], "`topk_weight`"),
        ("topk_weight", topk_weight.clone().requires_grad_(), "no backward"),
        ("hidden_act", "gelu", "`hidden_act`"),
        ("backend", "cuda", "`backend`"),
    ]
    if not torch.cuda.is_available():
        cases.append(("backend", "triton", "needs CUDA"))
    return good, cases


@pytest.mark.parametrize("case", range(len(_bad_args()[1])))
def test_bad_gemv_arguments_are_refused_by_name(case):
    good, cases = _bad_args()
    name, value, message = cases[case]
    with pytest.raises(ValueError, match=message):
        mxfp4_moe_gemv(**(good | {name: value}))


def test_bad_grouped_arguments_are_refused_by_name():
    E, _k, F, D = SHAPES["odd"]
    w1, w3, w2 = packed_weights(E, F, D)
    xs = torch.randn(4, D)
    with pytest.raises(ValueError, match=r"`counts` must be \[E\] = \[5\] integers"):
        mxfp4_grouped_experts(xs, torch.ones(4, dtype=torch.long), w1, w3, w2, **ACT["situ"])
    with pytest.raises(ValueError, match="`w2` holds 2 experts"):
        mxfp4_grouped_experts(xs, torch.ones(E, dtype=torch.long), w1, w3,
                              MXFP4Weight(w2.packed[:2], w2.scale[:2]), **ACT["situ"])
    with pytest.raises(ValueError, match="no backward"):
        mxfp4_grouped_experts(xs.requires_grad_(), torch.ones(E, dtype=torch.long), w1, w3, w2,
                              **ACT["situ"])


_INTERPRETED = """
import torch
from openk3.ops import mx_kernels
from openk3.ops.mx_moe import mxfp4_grouped_experts_ref, mxfp4_moe_gemv_ref
from tests.ops.test_mx_kernels import ACT, packed_weights, routing, sorted_rows
E, k, F, D = 3, 2, 64, 96
w1, w3, w2 = packed_weights(E, F, D)
w1.scale[0, 0, 0] = 255  # a NaN block: the rows reading it are NaN on both sides
x = torch.randn(5, D)
topk_idx, topk_weight = routing(5, E, k)
got = mx_kernels.mxfp4_moe_gemv_triton(x, w1, w3, w2, topk_idx, topk_weight, **ACT["silu"])
want = mxfp4_moe_gemv_ref(x, w1, w3, w2, topk_idx, topk_weight, **ACT["silu"])
assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
ok = ~want.isnan().any(1)
assert ok.any() and ((got[ok] - want[ok]).norm() / want[ok].norm()) < 1e-6
w1.scale[0, 0, 0] = 120
xs, counts = sorted_rows(topk_idx, x, E)
got = mx_kernels.mxfp4_grouped_triton(xs, counts, w1, w3, w2, **ACT["silu"])
want = mxfp4_grouped_experts_ref(xs, counts, w1, w3, w2, **ACT["silu"])
assert ((got - want).norm() / want.norm()) < 1e-6
print("ok")
"""


def test_kernels_in_the_triton_interpreter():
    """Both Triton paths on the CPU (TRITON_INTERPRET=1, fp32, SwiGLU: the interpreter has no
    libdevice tanh for SiTU), every code in random bytes, a NaN scale; in a subprocess because
    the interpreter is chosen when the kernels are defined."""
    run_triton_interpreted(_INTERPRETED)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def exact_fp32_matmuls():
    """The references' fp32 matmuls must not run in TF32 (it would be the less exact side)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


# The GEMVs and the reference read the same exact decoded weights and do all arithmetic in fp32:
# they differ by summation order and libdevice's tanh against torch's only (as the bf16 GEMVs).
GEMV_TOL = 1e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemv_triton_matches_reference(shape, act, dtype):
    E, k, F, D = SHAPES[shape]
    w1, w3, w2 = packed_weights(E, F, D, "cuda")
    errors = {}
    with torch.no_grad():
        for N in (1, 2, 5, 17, 33):
            x = torch.randn(N, D, device="cuda").to(dtype)
            args = (x, w1, w3, w2, *routing(N, E, k, "cuda", seed=N))
            with nan_poisoned_empty():
                fast = mxfp4_moe_gemv(*args, **ACT[act], backend="triton")
            assert fast.dtype == torch.float32 and fast.shape == (N, D)
            errors[N] = rel_err(fast, mxfp4_moe_gemv_ref(*args, **ACT[act]))
    assert all(e <= GEMV_TOL for e in errors.values()), errors  # `<=` is False for NaN


@pytest.mark.gpu
@needs_cuda
def test_gemv_triton_propagates_nan_scales_per_row():
    E, k, F, D = SHAPES["odd"]
    w1, w3, w2 = packed_weights(E, F, D, "cuda")
    w2.scale[1, 7, 0] = 255  # expert 1's output row 7 reads a NaN block
    topk_idx = torch.tensor([[1, 2], [3, 4]], device="cuda")
    x = torch.randn(2, D, device="cuda")
    got = mxfp4_moe_gemv(x, w1, w3, w2, topk_idx, torch.ones(2, k, device="cuda"), **ACT["situ"])
    assert got[0].isnan().nonzero().flatten().tolist() == [7] and not got[1].isnan().any()


# Grouped GEMM against the fp32 reference: bf16 activations are the reference's inputs too, so
# the difference is h rounded to bf16 between the projections (2^-9 relative per element) and
# fp32 summation order; fp32 activations run the tensor cores in IEEE fp32 (no TF32).
GROUPED_TOL = {torch.bfloat16: 5e-3, torch.float32: 1e-5}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_grouped_triton_matches_reference(shape, act, dtype):
    E, k, F, D = SHAPES[shape]
    w1, w3, w2 = packed_weights(E, F, D, "cuda")
    errors = {}
    with torch.no_grad():
        for N in (1, 7, 100, 300):  # 300 x k rows: several row tiles per expert
            x = torch.randn(N, D, device="cuda").to(dtype)
            xs, counts = sorted_rows(routing(N, E, k, "cuda", seed=N)[0], x, E)
            with nan_poisoned_empty():
                fast = mxfp4_grouped_experts(xs, counts, w1, w3, w2, **ACT[act], backend="triton")
            assert fast.dtype == torch.float32 and fast.shape == (N * k, D)
            errors[N] = rel_err(fast, mxfp4_grouped_experts_ref(xs, counts, w1, w3, w2, **ACT[act]))
    assert all(e <= GROUPED_TOL[dtype] for e in errors.values()), errors


# With MXFP8 inputs both kernels and the references round the same x; h is rounded to E4M3
# after a GEMM whose fp32 summation order differs from the reference's, so now and then one h
# value lands on the other side of a rounding boundary (one E4M3 step, up to 2^-3 relative). Those
# rare steps bound the agreement; the rounding itself moves the outputs ~3% (E4M3's relative
# RMS error), which the test checks is far above the bound.
MXFP8_TOL = 3e-3


def grouped_mxfp8_expected(xs, counts, w1, w3, w2, act, h_dtype):
    """What the grouped kernel computes with MXFP8 inputs, in plain fp32 PyTorch: ``h`` is rounded
    to the activations' dtype and then to MXFP8, as the QAT forward's bf16 grouped_mm path does
    (bf16 h, then the quantiser). Rounding fp32 h straight to E4M3 (the library reference) differs
    from that double rounding for ~3% of bf16 elements, by one E4M3 step."""
    from openk3.ops.moe import _glu_fp32
    from openk3.ops.mx import fake_quant_mxfp8_e4m3

    xq = fake_quant_mxfp8_e4m3(xs).float()
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = xq[start:start + n]
        h = _glu_fp32(xe @ w1.dequantize()[e].T, xe @ w3.dequantize()[e].T, act["hidden_act"],
                      act["situ_beta1"], act["situ_beta2"])
        outs.append(fake_quant_mxfp8_e4m3(h.to(h_dtype)).float() @ w2.dequantize()[e].T)
        start += n
    return torch.cat(outs)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernels_with_mxfp8_inputs_match_the_references(dtype):
    E, k, F, D = SHAPES["small"]
    w1, w3, w2 = packed_weights(E, F, D, "cuda")
    act = ACT["situ"]
    errors = {}
    with torch.no_grad():
        for N in (1, 5, 33):
            x = torch.randn(N, D, device="cuda").to(dtype)
            args = (x, w1, w3, w2, *routing(N, E, k, "cuda", seed=N))
            want = mxfp4_moe_gemv_ref(*args, **act, mxfp8_inputs=True)
            fast = mxfp4_moe_gemv(*args, **act, backend="triton", mxfp8_inputs=True)
            errors["gemv", N] = rel_err(fast, want)
            assert rel_err(mxfp4_moe_gemv_ref(*args, **act), want) > 5 * MXFP8_TOL
        for N in (7, 300):
            x = torch.randn(N, D, device="cuda").to(dtype)
            xs, counts = sorted_rows(routing(N, E, k, "cuda", seed=N)[0], x, E)
            want = grouped_mxfp8_expected(xs, counts, w1, w3, w2, act, dtype)
            if dtype == torch.float32:
                assert torch.equal(want, mxfp4_grouped_experts_ref(xs, counts, w1, w3, w2, **act,
                                                                   mxfp8_inputs=True))
            fast = mxfp4_grouped_experts(xs, counts, w1, w3, w2, **act, backend="triton",
                                         mxfp8_inputs=True)
            errors["grouped", N] = rel_err(fast, want)
    assert all(e <= MXFP8_TOL for e in errors.values()), errors


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_grouped_triton_is_no_worse_than_grouped_mm_on_dequantised_bf16_weights():
    """bf16: the packed grouped GEMM (fp32 gate/up, bf16 h) against the fp32 truth is at least as
    close as the bf16 path of RoutedExperts (grouped_mm: bf16 gate, up, h and outputs)."""
    E, k, F, D = SHAPES["small"]
    w1, w3, w2 = packed_weights(E, F, D, "cuda")
    dense = RoutedExperts(config(E, k, F), D).cuda().to(torch.bfloat16).requires_grad_(False)
    for name, w in zip(("w1", "w3", "w2"), (w1, w3, w2)):
        getattr(dense, name).copy_(w.dequantize(torch.bfloat16))
    N = PACKED_GEMV_MAX_PAIRS // k + 1  # past the GEMVs of both: the grouped paths
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    topk_idx, topk_weight = routing(N, E, k, "cuda")
    packed = packed_module(config(E, k, F), D, (w1, w3, w2), "cuda")
    with torch.no_grad():
        got = packed(x, topk_idx, topk_weight)
        bf16 = dense(x, topk_idx, topk_weight)
        truth = moe_gemv_ref(x, w1.dequantize(), w3.dequantize(), w2.dequantize(), topk_idx,
                             topk_weight, **ACT["situ"])
    assert rel_err(got, truth) <= rel_err(bf16, truth) + 1e-4, (rel_err(got, truth), rel_err(bf16, truth))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_gemv_reads_experts_past_2_31_bytes():
    """K3's expert sizes with E = 400: each packed stack holds 2.2e9 bytes, so the offsets of the
    last experts overflow int32 (the kernels compute them in int64). The reference decodes only
    the experts used."""
    E, k, F, D = 400, 16, 3072, 3584
    w1, w3, w2 = packed_weights(E, F, D, "cuda")
    topk_idx = torch.stack([torch.arange(E - k, E), torch.arange(0, 2 * k, 2).flip(0)]).cuda()
    topk_weight = torch.rand(2, k, device="cuda")
    x = torch.randn(2, D, device="cuda", dtype=torch.bfloat16)
    with nan_poisoned_empty():
        fast = mxfp4_moe_gemv(x, w1, w3, w2, topk_idx, topk_weight, **ACT["situ"], backend="triton")
    used, local = topk_idx.unique(return_inverse=True)
    sub = [MXFP4Weight(w.packed[used], w.scale[used]) for w in (w1, w3, w2)]
    want = mxfp4_moe_gemv_ref(x, *sub, local, topk_weight, **ACT["situ"])
    assert rel_err(fast, want) <= GEMV_TOL
    xs, counts = sorted_rows(topk_idx, x, E)
    grouped = mxfp4_grouped_experts(xs, counts, w1, w3, w2, **ACT["situ"], backend="triton")
    want_rows = mxfp4_grouped_experts_ref(xs, counts[used], *sub, **ACT["situ"])
    assert rel_err(grouped, want_rows) <= GROUPED_TOL[torch.bfloat16]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_packed_experts_replay_in_a_cuda_graph_with_new_inputs():
    E, k, F, D = SHAPES["small"]
    N = 8
    weights = packed_weights(E, F, D, "cuda")
    packed = packed_module(config(E, k, F), D, weights, "cuda")
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    topk_idx, topk_weight = routing(N, E, k, "cuda")
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile the kernels before the capture, as serving does
            packed(x, topk_idx, topk_weight)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with nan_poisoned_empty(), torch.cuda.graph(graph):
            out = packed(x, topk_idx, topk_weight)
        for seed in (3, 4):
            new = (torch.randn(N, D, device="cuda", dtype=torch.bfloat16),
                   *routing(N, E, k, "cuda", seed=seed))
            for static, value in zip((x, topk_idx, topk_weight), new):
                static.copy_(value)
            graph.replay()
            assert rel_err(out, mxfp4_moe_gemv_ref(new[0], *weights, *new[1:], **ACT["situ"])) <= GEMV_TOL
