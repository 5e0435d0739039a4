"""KDA numerics: every path against the per-token reference, the reference against fla-core's.

CPU tests run in fp32 at tiny shapes. The ``gpu`` tests compare fla-core's Triton kernels
(bf16 inputs) with the fp32 chunkwise reference on the same values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import openk3.ops.kda as kda_ops
from openk3.ops.kda import kda, kda_chunk_ref, kda_decode_step, kda_gate, kda_recurrent_ref
from tests.helpers import load_fla_file
from tests.ops.checks import (assert_all_close, cu_seqlens_of, nan_poisoned_empty, rel_err,
                              run_doctests, run_with_grads)

# Relative errors (||actual - expected|| / ||expected||) between two fp32 implementations of
# the same recurrence are rounding only: at most ~1.6e-6 seen (the chunkwise g gradient).
FP32_FWD_TOL = 1e-5
FP32_GRAD_TOL = 2e-5


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def fla_naive():
    return load_fla_file("ops/kda/naive.py")


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """The spec's q/k normalisation, written here independently of openk3."""
    return x / torch.sqrt((x ** 2).sum(-1, keepdim=True) + 1e-6)


def gate_formula(f_BTHK, A_log_H, dt_bias, lower_bound):
    """K3_SPEC §1.2's gate, written independently: fla's ``gate.py`` imports triton at top
    level, so its naive gates cannot be loaded on a CPU-only machine."""
    H, K = f_BTHK.shape[-2:]
    a = A_log_H.exp().view(H, 1)
    x = f_BTHK + dt_bias.view(H, K)
    return -a * F.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(a * x)


def make_inputs(B, T, H, K, V, *, gate, seed, initial_state=True):
    """fp32 KDA inputs. gate: 'bounded' (K3, g in (-5, 0)) or 'unbounded' (Kimi Linear's
    softplus gate; here g reaches -20 and below, far past what the dense chunk path allows)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    g_raw = randn(B, T, H, K)
    if gate == "bounded":
        g = -5 * torch.sigmoid(2 * g_raw)
    else:
        g = -F.softplus(3 * g_raw) * randn(H, 1).exp()
    inputs = dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, H, V), g=g,
                  beta=torch.rand(B, T, H, generator=gen))
    if initial_state:
        inputs["initial_state"] = 0.5 * randn(B, H, K, V)
    return inputs


def tolerances(names, fwd=FP32_FWD_TOL, grad=FP32_GRAD_TOL) -> dict:
    return {name: fwd if name in ("o", "S") else grad for name in names}


@pytest.mark.parametrize("T", [1, 7, 63, 64])
@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("output_final_state", [False, True])
def test_recurrent_matches_fla_naive(fla_naive, T, initial_state, output_final_state):
    inputs = make_inputs(2, T, 2, 16, 12, gate="bounded", seed=T, initial_state=initial_state)

    def ours(**x):
        return kda_recurrent_ref(**x, output_final_state=output_final_state)

    def theirs(q, k, **x):
        # fla's naive recurrence has no L2 norm: feed it normalised q, k
        return fla_naive.naive_recurrent_kda(l2norm(q), l2norm(k), **x,
                                             output_final_state=output_final_state)

    expected = run_with_grads(theirs, inputs)
    actual = run_with_grads(ours, inputs)
    assert ("S" in actual) == output_final_state
    assert actual["o"].dtype == torch.float32
    assert_all_close(actual, expected, tolerances(expected))


@pytest.mark.parametrize("gate,chunk_size,T,initial_state", [
    ("bounded", 16, 63, True),
    ("bounded", 16, 17, True),
    ("bounded", 16, 63, False),
    ("unbounded", 16, 63, True),
    ("unbounded", 16, 17, True),
    ("unbounded", 32, 63, True),
    ("unbounded", 32, 17, False),
])
def test_chunk_matches_recurrent(gate, chunk_size, T, initial_state):
    inputs = make_inputs(2, T, 2, 16, 12, gate=gate, seed=T + chunk_size,
                         initial_state=initial_state)

    def chunk(**x):
        return kda_chunk_ref(**x, output_final_state=True, chunk_size=chunk_size,
                             bounded_gate=gate == "bounded")

    expected = run_with_grads(lambda **x: kda_recurrent_ref(**x, output_final_state=True), inputs)
    actual = run_with_grads(chunk, inputs)
    assert_all_close(actual, expected, tolerances(expected))


def test_chunk_bounded_rejects_overflowing_decay():
    inputs = make_inputs(1, 20, 2, 8, 8, gate="bounded", seed=0)
    inputs["g"] = torch.full_like(inputs["g"], -6.0)  # 16 * -6 = -96 < -85
    with pytest.raises(ValueError, match="bounded_gate"):
        kda_chunk_ref(**inputs, chunk_size=16, bounded_gate=True)
    o, _ = kda_chunk_ref(**inputs, chunk_size=16, bounded_gate=False)
    o_ref, _ = kda_recurrent_ref(**inputs)
    assert rel_err(o, o_ref) < FP32_FWD_TOL


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_gate_matches_formula(lower_bound):
    B, T, H, K = 2, 5, 3, 4
    f = torch.randn(B, T, H, K)
    A_log_H = torch.randn(H)
    dt_bias = torch.randn(H * K)
    expected = gate_formula(f, A_log_H, dt_bias, lower_bound)
    padded = torch.cat([A_log_H, torch.zeros(128 - H)])  # the K3 checkpoint's layout
    for A_log in (A_log_H, padded, A_log_H.view(1, 1, H, 1)):  # last: Kimi Linear's HF layout
        g = kda_gate(f, A_log, dt_bias, lower_bound)
        assert g.dtype == torch.float32 and g.shape == (B, T, H, K)
        torch.testing.assert_close(g, expected)
    g_flat = kda_gate(f.flatten(-2), padded, dt_bias, lower_bound, num_heads=H)
    torch.testing.assert_close(g_flat, expected)
    if lower_bound is not None:  # closed: sigmoid rounds to exactly 0 or 1 in fp32
        assert (g_flat >= lower_bound).all() and (g_flat <= 0).all()


def test_gate_rejects_ambiguous_shapes():
    f = torch.randn(1, 2, 3 * 4)
    with pytest.raises(ValueError, match="num_heads"):
        kda_gate(f, torch.zeros(128), torch.zeros(12))
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f.view(1, 2, 3, 4), torch.zeros(2), torch.zeros(12))
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(f.view(1, 2, 3, 4), torch.zeros(3), torch.zeros(11))


def test_decode_steps_match_reference():
    x = make_inputs(2, 9, 3, 16, 12, gate="bounded", seed=3)
    o_ref, S_ref = kda_recurrent_ref(**x, output_final_state=True)
    state = x["initial_state"]
    before = state.clone()
    outs = []
    for t in range(9):
        o_t, state = kda_decode_step(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t],
                                     x["beta"][:, t], state)
        outs.append(o_t)
    torch.testing.assert_close(x["initial_state"], before, rtol=0, atol=0)
    assert state.dtype == torch.float32
    torch.testing.assert_close(torch.stack(outs, 1), o_ref)
    torch.testing.assert_close(state, S_ref)


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_split_sequence_carries_state(gate):
    x = make_inputs(2, 51, 2, 16, 12, gate=gate, seed=4)
    o_ref, S_ref = kda_recurrent_ref(**x, output_final_state=True)
    part1 = {n: t[:, :21] for n, t in x.items() if n != "initial_state"}
    part2 = {n: t[:, 21:] for n, t in x.items() if n != "initial_state"}
    bounded = gate == "bounded"
    o1, S1 = kda_chunk_ref(**part1, initial_state=x["initial_state"], output_final_state=True,
                           bounded_gate=bounded)
    o2, S2 = kda_chunk_ref(**part2, initial_state=S1, output_final_state=True,
                           bounded_gate=bounded)
    assert rel_err(torch.cat([o1, o2], 1), o_ref) < FP32_FWD_TOL
    assert rel_err(S2, S_ref) < FP32_FWD_TOL


def kda_inputs(B, T, H, K, V, seed, device="cpu", num_states=None):
    """Raw layer-level inputs for ``kda``: f is [B, T, H*K] and A_log is padded to 128.
    num_states: rows of initial_state (one per packed sequence), B by default."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    A_log = torch.cat([torch.empty(H).uniform_(0, 2, generator=gen), torch.zeros(128 - H)])
    inputs = dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, H, V),
                  f=randn(B, T, H * K), beta=torch.rand(B, T, H, generator=gen), A_log=A_log,
                  dt_bias=randn(H * K), initial_state=randn(num_states or B, H, K, V))
    return {name: t.to(device) for name, t in inputs.items()}


def gated_recurrent_ref(lower_bound):
    """``kda`` spelled with the independent gate formula and the per-token recurrence."""
    def run(q, k, v, f, beta, A_log, dt_bias, initial_state=None):
        H = q.shape[2]
        g = gate_formula(f.unflatten(-1, (H, -1)), A_log[:H], dt_bias, lower_bound)
        return kda_recurrent_ref(q, k, v, g, beta, initial_state=initial_state,
                                 output_final_state=True)
    return run


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("T", [1, 20])
def test_kda_torch_backend_matches_reference(lower_bound, T):
    x = kda_inputs(2, T, 3, 16, 12, seed=T)

    def dispatched(**inputs):
        return kda(**inputs, lower_bound=lower_bound, output_final_state=True, backend="torch")

    expected = run_with_grads(gated_recurrent_ref(lower_bound), x)
    actual = run_with_grads(dispatched, x)
    assert actual["S"].dtype == torch.float32
    assert_all_close(actual, expected, tolerances(expected))


def per_sequence(fn, lengths):
    """Run ``fn(**inputs) -> (o, S)`` on each sequence of a packed batch alone, with its own
    initial state; outputs concatenate along T, final states along N."""
    bounds = torch.tensor((0, *lengths)).cumsum(0).tolist()

    def run(q, k, v, f, beta, A_log, dt_bias, initial_state=None):
        outs = [fn(*(t[:, a:b] for t in (q, k, v, f, beta)), A_log, dt_bias,
                   initial_state=None if initial_state is None else initial_state[i:i + 1])
                for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
        return torch.cat([o for o, _ in outs], dim=1), torch.cat([S for _, S in outs])
    return run


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("host_offsets", [False, True])
def test_kda_torch_varlen_matches_per_sequence(lower_bound, initial_state, host_offsets):
    lengths = (1, 7, 63)
    x = kda_inputs(1, sum(lengths), 2, 16, 12, seed=5, num_states=len(lengths))
    if not initial_state:
        del x["initial_state"]
    cu = cu_seqlens_of(lengths)

    def packed(**inputs):
        return kda(**inputs, lower_bound=lower_bound, output_final_state=True, cu_seqlens=cu,
                   cu_seqlens_cpu=cu if host_offsets else None, backend="torch")

    expected = run_with_grads(per_sequence(gated_recurrent_ref(lower_bound), lengths), x)
    actual = run_with_grads(packed, x)
    assert actual["o"].shape == x["v"].shape and actual["S"].shape[0] == len(lengths)
    assert_all_close(actual, expected, tolerances(expected))


def test_kda_varlen_needs_packed_input():
    x = kda_inputs(2, 5, 2, 16, 12, seed=0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda(**x, cu_seqlens=torch.tensor([0, 2, 5]), backend="torch")


def test_kda_fla_backend_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        kda(**kda_inputs(1, 3, 2, 16, 12, seed=0), backend="fla")


@pytest.mark.parametrize("module", ["gate", "naive", "chunk", "decode", "dispatch"])
def test_docstring_examples_run(module):
    run_doctests(getattr(kda_ops, module))


@pytest.mark.parametrize("name,bad", [
    ("q", torch.randn(2, 5, 3)),
    ("k", torch.randn(2, 5, 3, 8)),
    ("v", torch.randn(2, 4, 3, 12)),
    ("f", torch.randn(2, 5, 3 * 15)),
    ("beta", torch.rand(2, 5, 4)),
    ("A_log", torch.zeros(2)),
    ("dt_bias", torch.zeros(3 * 15)),
    ("initial_state", torch.zeros(2, 3, 12, 16)),
    ("backend", "triton"),
    ("lower_bound", 1.0),
])
def test_kda_rejects_bad_arguments(name, bad):
    x = kda_inputs(2, 5, 3, 16, 12, seed=0)
    kwargs = {"backend": "torch", "lower_bound": -5.0} | x | {name: bad}
    with pytest.raises(ValueError, match=f"`{name}`"):
        kda(**kwargs)


# Relative errors of fla's bf16 kernels against the fp32 reference on the same bf16 values.
# Worst seen on an H200 (fla-core 0.6.0, triton 3.6, T up to 4096, both gates): o 4.4e-3,
# S 3.5e-3, initial_state grad 2.9e-3, other grads <= 4.8e-3 except A_log 6.9e-3 and
# dt_bias 7.6e-3 (sums over every token); these leave 2-3x room.
FLA_BF16_TOLS = {"o": 1e-2, "S": 1e-2, "q": 2e-2, "k": 2e-2, "v": 2e-2, "f": 2e-2, "beta": 2e-2,
                 "A_log": 2e-2, "dt_bias": 2e-2, "initial_state": 1e-2}


def bf16_pair(x: dict, beta_dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict]:
    """(bf16 activations + fp32 parameters and state, the same values all in fp32).
    beta_dtype: the KDA layer computes beta = sigmoid(b_proj(x)) in fp32."""
    keep = {"A_log": torch.float32, "dt_bias": torch.float32, "initial_state": torch.float32,
            "beta": beta_dtype}
    low = {n: t.to(keep.get(n, torch.bfloat16)) for n, t in x.items()}
    return low, {n: t.float() for n, t in low.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("T,H", [(63, 8), (1000, 4)])
@pytest.mark.parametrize("beta_dtype", [torch.bfloat16, torch.float32])
def test_fla_matches_torch(lower_bound, T, H, beta_dtype):
    low, full = bf16_pair(kda_inputs(2, T, H, 128, 128, seed=T, device="cuda"), beta_dtype)

    def run(backend):
        return lambda **x: kda(**x, lower_bound=lower_bound, output_final_state=True,
                               backend=backend)

    actual = run_with_grads(run("fla"), low)
    expected = run_with_grads(run("torch"), full)
    assert actual["o"].dtype == torch.bfloat16 and actual["S"].dtype == torch.float32
    assert_all_close(actual, expected, FLA_BF16_TOLS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("grad", [False, True])
def test_fla_single_token_matches_torch(lower_bound, grad):
    # Without autograd a T == 1 step runs fused_recurrent_kda; with it, chunk_kda.
    low, full = bf16_pair(kda_inputs(4, 1, 8, 128, 128, seed=7, device="cuda"))
    with torch.set_grad_enabled(grad):
        if grad:
            low = {n: t.requires_grad_() for n, t in low.items()}
        o, S = kda(**low, lower_bound=lower_bound, output_final_state=True, backend="fla")
        o_ref, S_ref = kda(**full, lower_bound=lower_bound, output_final_state=True,
                           backend="torch")
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert_all_close({"o": o, "S": S}, {"o": o_ref, "S": S_ref}, FLA_BF16_TOLS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fla_varlen_matches_per_sequence(lower_bound):
    # one kernel over the packed batch, written into NaN-poisoned buffers, against the
    # reference run on each sequence alone
    lengths = (1, 63, 200, 17)
    x = kda_inputs(1, sum(lengths), 4, 128, 128, seed=11, device="cuda", num_states=len(lengths))
    low, full = bf16_pair(x)
    cu = cu_seqlens_of(lengths, device="cuda")

    def packed(**inputs):
        return kda(**inputs, lower_bound=lower_bound, output_final_state=True, cu_seqlens=cu,
                   cu_seqlens_cpu=cu.cpu(), backend="fla")

    def torch_kda(*args, **kwargs):
        return kda(*args, **kwargs, lower_bound=lower_bound, output_final_state=True,
                   backend="torch")

    with nan_poisoned_empty():
        actual = run_with_grads(packed, low)
    expected = run_with_grads(per_sequence(torch_kda, lengths), full)
    assert_all_close(actual, expected, FLA_BF16_TOLS)
