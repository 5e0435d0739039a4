"""Routed experts for a few tokens (``openk3.ops.moe``): the gather reference against the
per-expert loop, ``RoutedExperts`` on either path, argument checks; on GPU the Triton kernels
against the reference (NaN-poisoned buffers, inside a CUDA graph)."""

import pytest
import torch

import openk3.ops.moe
from openk3 import preset
from openk3.model.moe import RoutedExperts
from openk3.ops.moe import GEMV_MAX_PAIRS, moe_gemv, moe_gemv_ref
from tests.ops.checks import nan_poisoned_empty, rel_err, run_doctests, run_triton_interpreted

# (E, k, F, D): `small`'s MoE layer, and sizes that divide no block of the kernels
SHAPES = {"small": (64, 4, 256, 512), "odd": (5, 2, 48, 40), "odd-wide": (7, 3, 200, 136)}


def experts(E, k, F, D, act="situ", device="cpu", dtype=torch.float32, seed=0) -> RoutedExperts:
    """RoutedExperts with random weights scaled so that activations stay O(1)."""
    cfg = preset("debug").replace(num_experts=E, num_experts_per_token=k, moe_intermediate_size=F,
                                  hidden_act=act)
    ex = RoutedExperts(cfg, D)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w, fan_in in ((ex.w1, D), (ex.w3, D), (ex.w2, F)):
            w.copy_(torch.randn(w.shape, generator=gen) * 2 / fan_in ** 0.5)
    return ex.to(device, dtype)


def routing(N, E, k, device="cpu", seed=1):
    """topk_idx [N, k] (k distinct experts per token) and topk_weight [N, k] (positive)."""
    gen = torch.Generator().manual_seed(seed)
    topk_idx = torch.rand(N, E, generator=gen).topk(k).indices
    topk_weight = torch.rand(N, k, generator=gen) + 0.1
    return topk_idx.to(device), topk_weight.to(device)


def act_of(cfg) -> dict:
    """moe_gemv's activation arguments from a ModelConfig."""
    return dict(hidden_act=cfg.hidden_act, situ_beta1=cfg.situ_beta1, situ_beta2=cfg.situ_beta2)


def test_examples_in_docstrings_run():
    run_doctests(openk3.ops.moe)


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("N", [1, 3, 17])
def test_reference_equals_the_per_expert_loop(act, N):
    E, k, F, D = SHAPES["odd"]
    ex = experts(E, k, F, D, act)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(2))
    topk_idx, topk_weight = routing(N, E, k)
    with torch.no_grad():
        looped = ex.forward_sorted(x, topk_idx, topk_weight)  # run_experts' loop on CPU
        gathered = moe_gemv_ref(x, ex.w1, ex.w3, ex.w2, topk_idx, topk_weight, **act_of(ex.cfg))
    assert gathered.dtype == torch.float32 and gathered.shape == (N, D)
    assert rel_err(gathered, looped) < 1e-6


def test_routed_experts_give_the_same_output_on_either_path(monkeypatch):
    E, k, F, D = SHAPES["odd"]
    ex = experts(E, k, F, D)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(2))
    topk_idx, topk_weight = routing(3, E, k)
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["hidden_act"])
        return moe_gemv(*args, **kwargs)

    monkeypatch.setattr("openk3.model.moe.moe_gemv", spy)
    monkeypatch.setattr("openk3.model.moe.use_moe_gemv", lambda x, num_pairs: True)  # as on CUDA
    with torch.no_grad():
        gemv = ex(x, topk_idx, topk_weight)
        sorted_ = ex.forward_sorted(x, topk_idx, topk_weight)
    assert calls == ["situ"] and rel_err(gemv, sorted_) < 1e-6
    trained = ex(x, topk_idx, topk_weight)  # gradients needed: the sorted path, never the GEMVs
    assert calls == ["situ"] and trained.requires_grad and rel_err(trained, sorted_) < 1e-6


def test_cpu_tensors_never_take_the_gemvs():
    """The kernels are CUDA's; on CPU, RoutedExperts keeps the sorted path at any size."""
    assert not openk3.ops.moe.use_moe_gemv(torch.zeros(1, 4), num_pairs=1)


def _bad_args():
    E, k, F, D = SHAPES["odd"]
    ex = experts(E, k, F, D)
    topk_idx, topk_weight = routing(3, E, k)
    good = dict(x=torch.randn(3, D), w1=ex.w1.detach(), w3=ex.w3.detach(), w2=ex.w2.detach(),
                topk_idx=topk_idx, topk_weight=topk_weight, **act_of(ex.cfg))
    cases = [
        ("x", torch.randn(1, 3, D), "`x`"),
        ("w1", torch.randn(E, F, D + 1), "`w1`"),
        ("w3", torch.randn(E, D, F).transpose(1, 2), "`w3`"),
        ("w2", torch.randn(E, F, D), "`w2`"),
        ("topk_idx", topk_idx[:2], "`topk_idx`"),
        ("topk_idx", topk_idx.float(), "`topk_idx`"),
        ("topk_weight", topk_weight[:, :1], "`topk_weight`"),
        ("hidden_act", "gelu", "`hidden_act`"),
        ("backend", "cuda", "`backend`"),
        ("w2", ex.w2, "no backward"),  # a parameter that needs gradients
    ]
    if not torch.cuda.is_available():
        cases.append(("backend", "triton", "needs CUDA"))
    return good, cases


@pytest.mark.parametrize("case", range(len(_bad_args()[1])))
def test_bad_arguments_are_refused_by_name(case):
    good, cases = _bad_args()
    name, value, message = cases[case]
    with pytest.raises(ValueError, match=message):
        moe_gemv(**(good | {name: value}))


_INTERPRETED = """
import torch
from openk3.ops.moe import moe_gemv_ref
from openk3.ops.moe_kernels import moe_gemv_triton
from tests.ops.test_moe import SHAPES, act_of, experts, routing
for shape, N in (("odd", 3), ("odd-wide", 2)):
    E, k, F, D = SHAPES[shape]
    ex = experts(E, k, F, D, "silu")
    with torch.no_grad():
        x = torch.randn(N, D)
        args = (x, ex.w1, ex.w3, ex.w2, *routing(N, E, k, seed=N))
        fast, ref = moe_gemv_triton(*args, **act_of(ex.cfg)), moe_gemv_ref(*args, **act_of(ex.cfg))
    err = ((fast - ref).norm() / ref.norm()).item()
    assert fast.shape == (N, D) and err < 1e-5, (shape, err)
print("ok")
"""


def test_kernels_in_the_triton_interpreter():
    """The Triton kernels on the CPU (TRITON_INTERPRET=1, fp32) against the reference, at sizes
    that fill no tile (`small`'s layer runs in the GPU tests: ~8 s in the interpreter). SwiGLU
    only: the interpreter has no libdevice ``tanh`` (SiTU runs in the GPU tests)."""
    run_triton_interpreted(_INTERPRETED)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Both sides read the same (bf16-rounded) weights and do all arithmetic in fp32: they differ by
# summation order and libdevice's tanh against torch's only, so bf16 weights get the same
# tolerance as fp32 ones (the CPU interpreter of the kernels gave <= 1.5e-6).
TOL = 1e-5


@pytest.fixture
def exact_fp32_matmuls():
    """The reference's fp32 matmuls must not run in TF32 (it would be the less exact side)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_triton_matches_reference(shape, act, dtype):
    E, k, F, D = SHAPES[shape]
    ex = experts(E, k, F, D, act, "cuda", dtype)
    errors = {}
    with torch.no_grad():
        for N in (1, 2, 5, 17, 33, 64):
            x = torch.randn(N, D, device="cuda").to(dtype)
            args = (x, ex.w1, ex.w3, ex.w2, *routing(N, E, k, "cuda", seed=N))
            with nan_poisoned_empty():  # every buffer the kernels should fill starts as NaN
                fast = moe_gemv(*args, **act_of(ex.cfg), backend="triton")
            assert fast.dtype == torch.float32 and fast.shape == (N, D)
            errors[N] = rel_err(fast, moe_gemv_ref(*args, **act_of(ex.cfg)))
    assert all(e <= TOL for e in errors.values()), errors  # `<=` is False for NaN


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_triton_reads_experts_past_2_31_elements():
    """K3's expert sizes with E = 200: each stacked weight holds 2.2e9 elements, so the offsets of
    the last experts overflow int32 (the kernels compute them in int64)."""
    E, k, F, D = 200, 16, 3072, 3584
    act = act_of(preset("k3"))
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    w1, w3 = (torch.randn(E, F, D, **bf16) / D ** 0.5 for _ in range(2))
    w2 = torch.randn(E, D, F, **bf16) / F ** 0.5
    topk_idx = torch.stack([torch.arange(E - k, E), torch.arange(0, 2 * k, 2).flip(0)]).cuda()
    topk_weight = torch.rand(2, k, device="cuda")
    x = torch.randn(2, D, **bf16)
    with nan_poisoned_empty():
        fast = moe_gemv(x, w1, w3, w2, topk_idx, topk_weight, **act, backend="triton")
    # one token at a time: the reference gathers 3 GB of fp32 weights per token
    want = torch.cat([moe_gemv_ref(x[t:t + 1], w1, w3, w2, topk_idx[t:t + 1], topk_weight[t:t + 1],
                                   **act) for t in range(2)])
    assert rel_err(fast, want) <= TOL


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_routed_experts_replay_in_a_cuda_graph_with_new_inputs():
    E, k, F, D = SHAPES["small"]
    N = 8
    ex = experts(E, k, F, D, "situ", "cuda", torch.bfloat16)
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    topk_idx, topk_weight = routing(N, E, k, "cuda")
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile the kernels before the capture, as serving does
            ex(x, topk_idx, topk_weight)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with nan_poisoned_empty(), torch.cuda.graph(graph):  # the NaN fills replay too
            out = ex(x, topk_idx, topk_weight)
        for seed in (3, 4):
            new = (torch.randn(N, D, device="cuda", dtype=torch.bfloat16),
                   *routing(N, E, k, "cuda", seed=seed))
            for static, value in zip((x, topk_idx, topk_weight), new):
                static.copy_(value)
            graph.replay()
            assert rel_err(out, moe_gemv_ref(new[0], ex.w1, ex.w3, ex.w2, *new[1:],
                                             **act_of(ex.cfg))) <= TOL


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_routed_experts_take_the_gemvs_for_few_pairs_and_are_closer_to_fp32():
    """bf16 experts: few pairs without autograd run the Triton kernels (bitwise their output:
    they are deterministic), more than GEMV_MAX_PAIRS the grouped path. Against the fp32
    weights, the GEMVs (fp32 h and sums) are no worse than the grouped path (bf16 h and expert
    outputs)."""
    E, k, F, D = SHAPES["small"]
    ex32 = experts(E, k, F, D, "situ", "cuda")
    ex = experts(E, k, F, D, "situ", "cuda", torch.bfloat16)
    many = GEMV_MAX_PAIRS // k + 1
    for N in (1, 16, many):
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        topk_idx, topk_weight = routing(N, E, k, "cuda")
        with torch.no_grad():
            out = ex(x, topk_idx, topk_weight)
            gemv = moe_gemv(x, ex.w1, ex.w3, ex.w2, topk_idx, topk_weight, **act_of(ex.cfg))
            grouped = ex.forward_sorted(x, topk_idx, topk_weight)
            exact = ex32.forward_sorted(x.float(), topk_idx, topk_weight)
        if N == many:  # both the grouped path (written for index_add_'s atomics, since replaced)
            assert rel_err(out, grouped) < 1e-6, N
        else:
            assert torch.equal(out, gemv), N
        assert rel_err(gemv, exact) <= rel_err(grouped, exact) + 1e-4, N


def combine_case(N: int, k: int, D: int, E: int, device: str = "cpu", dtype=torch.float32, seed: int = 0):
    """Expert outputs in expert order with the sort that produced them: (ys, order, topk_weight)."""
    g = torch.Generator(device=device).manual_seed(seed)
    topk_idx = torch.rand(N, E, device=device, generator=g).topk(k).indices
    order, _, _ = openk3.ops.moe.sort_pairs(topk_idx, E)
    ys = torch.randn(N * k, D, device=device, generator=g).to(dtype)
    return ys, order, torch.rand(N, k, device=device, generator=g)


_COMBINE_INTERPRETED = """
import torch
from openk3.ops.moe import combine_pairs
from openk3.ops.moe_kernels import combine_pairs_triton
from tests.ops.test_moe import combine_case
for N, k, D, E in ((1, 4, 40, 6), (9, 2, 136, 5), (13, 3, 600, 7)):  # partial tiles, two column tiles
    ys, order, w = combine_case(N, k, D, E, seed=N)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel())
    fast, ref = combine_pairs_triton(ys, position, w), combine_pairs(ys, order, w)  # CPU: the torch path
    assert fast.dtype == torch.float32 and fast.shape == (N, D)
    assert (fast - ref).abs().max().item() <= 1e-6 * ref.abs().max().item(), (N, k, D)
print("ok")
"""


def test_combine_kernel_in_the_triton_interpreter():
    """The experts' weighted sum in one kernel (prefill, no autograd) on the CPU against the
    gather/product/sum of ``combine_pairs``: same fp32 products summed in choice order, so equal
    up to a fused multiply-add's rounding."""
    run_triton_interpreted(_COMBINE_INTERPRETED)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_combine_kernel_matches_the_autograd_path(dtype):
    """``combine_pairs`` without autograd (the kernel) against itself with autograd (the torch
    ops), at `small`'s layer (k = 4, D = 512) and K3's (k = 16, D = 3584: several column tiles)."""
    for N, k, D, E in ((1, 4, 512, 64), (4099, 4, 512, 64), (37, 16, 3584, 896)):
        ys, order, w = combine_case(N, k, D, E, "cuda", dtype, seed=N)
        with torch.no_grad(), nan_poisoned_empty():
            fast = openk3.ops.moe.combine_pairs(ys, order, w)
        ref = openk3.ops.moe.combine_pairs(ys.requires_grad_(), order, w).detach()
        assert fast.dtype == torch.float32
        assert (fast - ref).abs().max().item() <= 1e-6 * ref.abs().max().item(), (N, k, D)


@pytest.mark.parametrize("E", [64, 40000])
def test_sort_pairs_is_the_stable_sort_by_expert(E):
    """16-bit sort keys (32-bit past 32,767 experts) give int64's stable order, tokens and counts."""
    g = torch.Generator().manual_seed(E)
    topk_idx = torch.rand(37, E, generator=g).topk(4).indices
    order, token_of_pair, counts = openk3.ops.moe.sort_pairs(topk_idx, E)
    want = topk_idx.reshape(-1).argsort(stable=True)
    assert torch.equal(order, want) and torch.equal(token_of_pair, want // 4)
    assert torch.equal(counts, torch.bincount(topk_idx.reshape(-1), minlength=E))
