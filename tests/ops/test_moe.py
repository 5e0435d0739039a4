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


def route_case(N: int, k: int, E: int, hot: bool, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    """topk_idx [N, k]: k distinct experts per token, uniform or all tokens on the same k."""
    if hot:
        return torch.arange(k, device=device).repeat(N, 1)
    return routing(N, E, k, device, seed)[0]


def check_grouped(topk_idx: torch.Tensor, E: int, got) -> None:
    """``group_pairs``' outputs against the stable sort's."""
    order, token, counts = openk3.ops.moe.sort_pairs(topk_idx, E)
    position, token_of_row, got_counts, ends = got
    assert torch.equal(position, openk3.ops.moe.inverse_order(order))
    assert torch.equal(token_of_row, token)
    assert torch.equal(got_counts, counts) and got_counts.dtype == torch.int64
    assert torch.equal(ends, counts.cumsum(0).to(torch.int32)) and ends.dtype == torch.int32


_ROUTE_CASES = [(1, 4, 64, False), (300, 4, 64, False), (300, 4, 64, True), (37, 3, 5, False),
                (700, 2, 40, False), (8, 16, 896, False), (4096, 4, 64, False)]

_ROUTE_INTERPRETED = """
from openk3.ops.moe_kernels import group_pairs_triton, route_fits
from tests.ops.test_moe import _ROUTE_CASES, check_grouped, route_case
import triton
for N, k, E, hot in _ROUTE_CASES:  # one block and several, 5 and 896 experts (masked columns)
    assert route_fits(N * k, E), (N, k, E)
    topk_idx = route_case(N, k, E, hot, seed=N)
    check_grouped(topk_idx, E, group_pairs_triton(topk_idx, E))
    if N == 4096:  # the narrowest tile the blocks fit (what moe_route_bench compares)
        check_grouped(topk_idx, E, group_pairs_triton(topk_idx, E, triton.next_power_of_2(-(-N * k // 256))))
assert not route_fits(65537, 64) and route_fits(65536, 64) and not route_fits(1024, 896)
try:  # past the widest histogram tile: refused, not a silently wrong order
    group_pairs_triton(route_case(512, 2, 896, False), 896)
except ValueError as e:
    assert "1024 pairs over 896 experts exceed the routing tile" in str(e), e
else:
    raise AssertionError("group_pairs_triton took 1,024 pairs over 896 experts")
try:
    group_pairs_triton(route_case(4096, 4, 64, False), 64, 8)  # 64 blocks of pairs
except ValueError as e:
    assert "tile_rows = 8 must be a power of two >= the 64 blocks" in str(e), e
else:
    raise AssertionError("group_pairs_triton took a tile narrower than its blocks")
print("ok")
"""


def test_route_kernels_in_the_triton_interpreter():
    """The expert order in two kernels equals the stable sort's: positions, tokens, counts and
    offsets, several blocks of pairs, a hot expert, expert counts that are not powers of two."""
    run_triton_interpreted(_ROUTE_INTERPRETED)


def test_group_pairs_reference_is_the_stable_sort():
    for N, k, E, hot in _ROUTE_CASES[:5]:
        topk_idx = route_case(N, k, E, hot, seed=N)
        check_grouped(topk_idx, E, openk3.ops.moe.group_pairs(topk_idx, E))


@pytest.mark.gpu
@needs_cuda
def test_group_pairs_on_the_gpu_and_the_experts_unchanged():
    """On CUDA without autograd ``group_pairs`` takes the kernels up to ``ROUTE_MAX_PAIRS``
    (65,536 pairs of `small`: 16,384 tokens) and the sort above; both equal the stable sort. The grouped experts
    give the same bits through either."""
    from openk3.model.moe import run_experts

    for N, k, E, hot in _ROUTE_CASES + [(16384, 4, 64, False), (16384, 4, 64, True), (16385, 4, 64, False)]:
        topk_idx = route_case(N, k, E, hot, "cuda", seed=N)
        with torch.no_grad():  # with autograd (training) the sort, always
            check_grouped(topk_idx, E, openk3.ops.moe.group_pairs(topk_idx, E))
    ex = experts(64, 4, 256, 512, "situ", "cuda", torch.bfloat16)
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    topk_idx, topk_weight = routing(1024, 64, 4, "cuda")
    with torch.no_grad():
        fast = ex.forward_sorted(x, topk_idx, topk_weight)
        order, token, counts = openk3.ops.moe.sort_pairs(topk_idx, 64)
        ys = run_experts(ex.cfg, ex.w1, ex.w3, ex.w2, x[token], counts)
        assert torch.equal(fast, openk3.ops.moe.combine_pairs(ys, order, topk_weight))


@pytest.mark.gpu
@needs_cuda
def test_token_counts_do_not_compile_the_routing_kernels_again():
    """The router's top-k, the routing and the combine kernels take any token count of 16 and
    more without a new compile (Triton specialises an int argument by its divisibility by 16 and
    its being 1 unless told not to, and compiles each value of a constexpr): the EAGLE draft's
    packed pass over prompt chunks of 256 to 1,019 tokens compiled them up to six times inside
    serving steps (~0.3-0.5 s each). Below 16 tokens the top-k's tile (``TOKENS``) follows the
    count's power of two, which the decode graphs' captures compile. The kernels' in-process
    caches are emptied first, so what earlier tests compiled hides nothing."""
    knobs = pytest.importorskip("triton.knobs")
    from openk3.ops.moe_kernels import _combine_kernel, _route_count_kernel, _route_place_kernel
    from openk3.ops.router import router_topk
    from openk3.ops.router_triton import router_topk_kernel

    for kernel in (router_topk_kernel, _route_count_kernel, _route_place_kernel, _combine_kernel):
        kernel.device_caches.clear()
    ex = experts(64, 4, 256, 512, "situ", "cuda", torch.bfloat16)
    bias = torch.zeros(64, device="cuda")
    compiled, before = [], knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(getattr(kw.get("fn"), "name", "?"))
    try:
        # 64 to 2,000 tokens: 1 to 32 blocks of pairs (the old tile: 1, 8, 16 and 32 rows)
        for i, N in enumerate((1024, 773, 1019, 64, 300, 2000, 777)):
            x = torch.randn(N, 512, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                _, topk_idx, topk_weight = router_topk(torch.randn(N, 64, device="cuda"), bias, k=4)
                ex.forward_sorted(x, topk_idx, topk_weight)
            if i == 0:
                assert {"router_topk_kernel", "_route_place_kernel"} <= set(compiled)  # the hook sees them
                compiled.clear()
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = before
    assert compiled == []


def grouped_case(P: int, E: int, F: int, D: int, act: str, empty: bool, device="cpu", dtype=torch.float32,
                 seed: int = 0):
    """(experts, xs [P, D], counts [E]): P expert-sorted rows over random counts (with
    ``empty``, every other expert gets none)."""
    ex = experts(E, 1, F, D, act, device, dtype, seed)
    g = torch.Generator().manual_seed(seed)
    share = torch.rand(E, generator=g) * (torch.arange(E) % 2 == 0 if empty else 1)
    counts = (share / share.sum() * P).floor().long()
    counts[0] += P - counts.sum()
    xs = torch.randn(P, D, generator=g).to(device, dtype)
    return ex, xs, counts.to(device)


_GROUPED_INTERPRETED = """
import torch
from openk3.model.moe import run_experts
from openk3.ops.moe_grouped_triton import grouped_experts_triton
from tests.ops.test_moe import grouped_case
# row tiles that end inside an expert and at its end, experts with no rows, several N and K
# tiles, widths that are not multiples of the blocks (SwiGLU: the interpreter has no libdevice
# tanh; SiTU-GLU runs in the GPU test)
for P, E, F, D, act, empty, blocks in ((100, 5, 48, 40, "silu", False, (16, 32, 16, 4, 1)),
                                      (70, 6, 40, 72, "silu", True, (16, 16, 32, 4, 2)),
                                      (130, 64, 32, 48, "silu", True, None)):
    ex, xs, counts = grouped_case(P, E, F, D, act, empty, seed=P)
    ends = counts.cumsum(0).to(torch.int32)
    c = ex.cfg
    got = grouped_experts_triton(xs, ends, ex.w1, ex.w3, ex.w2, hidden_act=c.hidden_act,
                                 situ_beta1=c.situ_beta1, situ_beta2=c.situ_beta2, blocks=blocks)
    want = run_experts(c, ex.w1.double(), ex.w3.double(), ex.w2.double(), xs.double(), counts)
    assert got.shape == (P, D) and got.dtype == torch.float32
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, (P, E, F, D, err)
print("ok")
"""


def test_grouped_kernels_in_the_triton_interpreter():
    """The grouped experts in two kernels (gate/up with the GLU, down) against the per-expert
    loop of ``run_experts`` in fp64 (SwiGLU)."""
    run_triton_interpreted(_GROUPED_INTERPRETED)


@pytest.mark.gpu
@needs_cuda
def test_grouped_kernels_match_grouped_mm():
    """On the GPU in bf16, openk3's grouped kernels (a prefill pass's MoE) against ``grouped_mm``
    and the fp32 loop: no further from fp32 than ``grouped_mm`` (which rounds gate and up to
    bf16 before the GLU), at `small`'s layer (64 experts, 512 -> 256) for 1,024 and 4,096 tokens,
    some experts empty."""
    import openk3.model.moe as moe_model

    for P, empty in ((4096, False), (16384, True), (333, True)):
        ex, xs, counts = grouped_case(P, 64, 256, 512, "situ", empty, "cuda", torch.bfloat16, seed=P)
        ex32 = ex.float()
        with torch.no_grad(), nan_poisoned_empty():
            got = moe_model.run_experts(ex.cfg, ex.w1, ex.w3, ex.w2, xs, counts)
            saved = openk3.ops.moe.GROUPED_TRITON_MAX_PAIRS
            openk3.ops.moe.GROUPED_TRITON_MAX_PAIRS = 0
            try:
                ref = moe_model.run_experts(ex.cfg, ex.w1, ex.w3, ex.w2, xs, counts)
            finally:
                openk3.ops.moe.GROUPED_TRITON_MAX_PAIRS = saved
            exact = moe_model.run_experts(ex32.cfg, ex32.w1, ex32.w3, ex32.w2, xs.float(), counts)
        assert got.dtype == torch.bfloat16 and not got.isnan().any(), P
        assert rel_err(got, exact) <= rel_err(ref, exact) + 1e-3, (P, rel_err(got, exact), rel_err(ref, exact))
