"""``kda_decode_``: one decode token per row with the states in a pool, updated in place,
against ``kda`` on the gathered states (the path the serving decode step took before), and
fla's continuous-batching kernel against the reference (in Triton's interpreter on the CPU,
and on the GPU)."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.kda import kda, kda_decode_, kda_verify, kda_verify_pooled
from tests.ops.checks import assert_all_close, nan_poisoned_empty, run_triton_interpreted


def pooled(B=3, H=2, K=16, n=7, seed=0, device="cpu", dtype=torch.float32, T=1):
    """Layer inputs of T tokens per row (one: a decode step; raw beta logits, A_log zero-padded to 128 as in the K3
    checkpoint), a pool of n states and B distinct slots in no particular order."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    x = {"q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, H, K), "f": randn(B, T, H * K),
         "beta_logits": randn(B, T, H),
         "A_log": torch.cat([torch.empty(H).uniform_(0, 2, generator=gen), torch.zeros(128 - H)]),
         "dt_bias": randn(H * K), "pool": randn(n, H, K, K), "slots": torch.randperm(n, generator=gen)[:B]}
    return {name: t.to(device, dtype if name in ("q", "k", "v", "f", "beta_logits") else t.dtype)
            for name, t in x.items()}


def through_kda(x, lower_bound, backend="torch"):
    """What the decode step did before: gather, ``kda`` with sigmoided beta, scatter."""
    pool = x["pool"].clone()
    o, S = kda(x["q"], x["k"], x["v"], x["f"], torch.sigmoid(x["beta_logits"].float()), x["A_log"],
               x["dt_bias"], lower_bound=lower_bound, initial_state=pool[x["slots"]],
               output_final_state=True, backend=backend)
    pool[x["slots"]] = S
    return o, pool


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_matches_kda_on_gathered_states_and_leaves_other_rows(lower_bound):
    x = pooled()
    o_want, pool_want = through_kda(x, lower_bound)
    o = kda_decode_(**x, lower_bound=lower_bound)
    assert torch.equal(o, o_want)
    assert torch.equal(x["pool"], pool_want)  # the slots' rows replaced, every other row as it was


def test_steps_carry_the_state():
    x = pooled(B=2, n=3, seed=1)
    start = x["pool"].clone()
    for _ in range(3):
        kda_decode_(**x)
    want = pooled(B=2, n=3, seed=1)
    want["pool"] = start
    for _ in range(4):
        o_want, want["pool"] = through_kda(want, -5.0)
    assert torch.equal(kda_decode_(**x), o_want)


@pytest.mark.parametrize("name,bad,match", [
    ("q", torch.randn(3, 2, 2, 16), "one token per row"),
    ("pool", torch.randn(7, 2, 16, 16).transpose(2, 3), "contiguous"),
    ("pool", torch.randn(7, 2, 16, 16).double(), "fp32"),
    ("slots", torch.tensor([0, 1]), "slots"),
])
def test_rejects_bad_arguments(name, bad, match):
    with pytest.raises(ValueError, match=match):
        kda_decode_(**{**pooled(), name: bad})


def test_inference_only():
    x = pooled()
    x["q"].requires_grad_(True)
    with pytest.raises(ValueError, match="inference-only"):
        kda_decode_(**x)


_INTERPRETED = """
import torch
from openk3.ops.kda.pooled import _decode_fla, _verify_pooled_fla, kda_decode_, kda_verify_pooled
from tests.ops.test_kda_pooled import pooled
for lower_bound in (-5.0, None):
    x = pooled(B=3, H=2, K=16, n=6, seed=2)
    pool = x["pool"].clone()
    want = kda_decode_(**{**x, "pool": pool}, lower_bound=lower_bound, backend="torch")
    got = _decode_fla(x["q"], x["k"], x["v"], x["f"].view(3, 1, 2, 16), x["beta_logits"], x["A_log"],
                      x["dt_bias"], x["pool"], x["slots"], lower_bound, None, True)
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    assert (x["pool"] - pool).abs().max() < 1e-4, (x["pool"] - pool).abs().max()
    others = [i for i in range(6) if i not in x["slots"].tolist()]
    assert torch.equal(x["pool"][others], pool[others])
for lower_bound in (-5.0, None):
    x = pooled(B=3, H=2, K=16, n=6, seed=6, T=5)
    pool = x["pool"].clone()
    want = kda_verify_pooled(**x, lower_bound=lower_bound, backend="torch")
    got = _verify_pooled_fla(x["q"], x["k"], x["v"], x["f"].view(3, 5, 2, 16), x["beta_logits"], x["A_log"],
                             x["dt_bias"], x["pool"][x["slots"]], lower_bound, None, True)
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    assert torch.equal(x["pool"], pool)
print("ok")
"""


def test_fla_pooled_modes_in_the_triton_interpreter():
    """fla's kernel on the CPU (TRITON_INTERPRET=1, fp32) in the modes the pooled ops use:
    ``kda_decode_``'s, states read from and written to the pool rows of ``slots``; and
    ``kda_verify_pooled``'s, T tokens per row from the gathered states, no state written; beta's
    sigmoid in the kernel in both (one subprocess: fla's import is most of its time)."""
    pytest.importorskip("fla")
    run_triton_interpreted(_INTERPRETED)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fla_matches_reference_gpu(lower_bound):
    # bf16 activations, fp32 states (the serving dtypes), K = V = 128 as in every K3 layer
    x = pooled(B=5, H=4, K=128, n=9, seed=3, device="cuda", dtype=torch.bfloat16)
    full = {n: t.float() if t.dtype == torch.bfloat16 else t.clone() for n, t in x.items()}
    with torch.no_grad(), nan_poisoned_empty():
        o = kda_decode_(**x, lower_bound=lower_bound)
    o_ref = kda_decode_(**full, lower_bound=lower_bound, backend="torch")
    assert o.dtype == torch.bfloat16
    assert_all_close({"o": o, "S": x["pool"]}, {"o": o_ref, "S": full["pool"]}, {"o": 1e-2, "S": 1e-2})


# ---- kda_verify_pooled: T tokens per row from pool rows, which are not written ----

@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_verify_matches_kda_verify_on_gathered_states_and_writes_nothing(lower_bound):
    x = pooled(T=4, seed=4)
    x["slots"][-1] = x["slots"][0]  # a repeated slot (padding rows share the scratch slot)
    pool = x["pool"].clone()
    o = kda_verify_pooled(**x, lower_bound=lower_bound)
    o_want, _ = kda_verify(x["q"], x["k"], x["v"], x["f"], torch.sigmoid(x["beta_logits"].float()), x["A_log"],
                           x["dt_bias"], initial_state=pool[x["slots"]], lower_bound=lower_bound,
                           output_states=False, backend="torch")
    assert torch.equal(o, o_want)
    assert torch.equal(x["pool"], pool)


def test_verify_first_token_is_the_decode_step():
    x = pooled(T=3, seed=5)
    o = kda_verify_pooled(**x)
    step = {**{n: t[:, :1] for n, t in x.items() if n in ("q", "k", "v", "f", "beta_logits")},
            "pool": x["pool"].clone()}
    o_step = kda_decode_(**{**x, **step})
    assert_all_close({"o": o[:, :1]}, {"o": o_step}, {"o": 1e-6})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fla_verify_matches_reference_gpu(lower_bound):
    x = pooled(B=5, H=4, K=128, n=9, seed=7, device="cuda", dtype=torch.bfloat16, T=8)
    full = {n: t.float() if t.dtype == torch.bfloat16 else t.clone() for n, t in x.items()}
    pool = x["pool"].clone()
    with torch.no_grad(), nan_poisoned_empty():
        o = kda_verify_pooled(**x, lower_bound=lower_bound)
    o_ref = kda_verify_pooled(**full, lower_bound=lower_bound, backend="torch")
    assert o.dtype == torch.bfloat16
    assert_all_close({"o": o}, {"o": o_ref}, {"o": 1e-2})
    assert torch.equal(x["pool"], pool)
