"""Sampling: filters, exactness of the sampled distribution, per-request seeds, log-probs, errors."""

import pytest
import torch

from openk3.serve.sampler import (
    SamplingParams,
    counter_uniforms,
    filtered_logprobs,
    filters,
    inverse_cdf_sample,
    make_generator,
    sample,
)


def _logits(B=3, V=11, seed=0):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = _logits()
    want = logits.argmax(-1)
    for p in (SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        tokens, _ = sample(logits, [p] * 3, [make_generator(1)] * 3)
        assert torch.equal(tokens, want), p


def test_filtered_distribution():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    one = torch.ones(1)
    lp = filtered_logprobs(logits, one * 0.5, torch.tensor([3]), one)  # top-3 at T=0.5
    want = torch.log_softmax(logits[0, :3] / 0.5, -1)
    torch.testing.assert_close(lp[0, :3], want)
    assert torch.isinf(lp[0, 3:]).all()
    p = torch.softmax(logits[0], -1)  # top-p keeps the smallest prefix reaching p
    lp = filtered_logprobs(logits, one, torch.tensor([0]), one * float(p[0] + p[1] - 1e-3))
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()


def test_samples_follow_the_distribution():
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]]).repeat(20000, 1)
    g = make_generator(0)
    tokens, _ = sample(logits, [SamplingParams(temperature=0.7)] * 20000, [g] * 20000)
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    want = torch.softmax(logits[0] / 0.7, -1)
    assert (freq - want).abs().max() < 0.015  # ~4 standard errors at n = 20000


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = _logits(B=4, V=50)
    p = SamplingParams(temperature=1.0, top_k=20)
    alone, _ = sample(logits[2:3], [p], [make_generator(7)])
    together, _ = sample(logits, [p] * 4, [make_generator(1), None, make_generator(7), None])
    assert together[2] == alone[0]


def _splitmix64_ref(x: int) -> int:
    """SplitMix64's output function on Python ints (the published constants), modulo 2**64."""
    m = 2**64 - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_counter_uniforms_are_keyed_hashes():
    """Row b's draw j is SplitMix64(SplitMix64(SplitMix64(seed) ^ counter) ^ j) >> 11 (recomputed
    with Python ints), whatever the other rows; seeds wrap modulo 2**64 (negative, and the
    ``initial_seed`` of a generator seeded with one); the first known output of SplitMix64 from
    state 0 pins the constants."""
    assert _splitmix64_ref(0) == 0xE220A8397B1DCDAF
    seeds, counters = [0, 7, -1, 2**64 - 1, 2**63 + 5], [0, 12, 3, 3, 1_000_000]
    got = counter_uniforms(seeds, counters, 4)
    assert got.shape == (5, 4) and str(got.dtype) == "int64"
    for b, (seed, counter) in enumerate(zip(seeds, counters)):
        for j in range(4):
            h = _splitmix64_ref(_splitmix64_ref(_splitmix64_ref(seed % 2**64) ^ counter) ^ j)
            assert got[b, j] == h >> 11, (seed, counter, j)
    assert (got[2] == got[3]).all()  # -1 and 2**64 - 1 are one seed
    assert (counter_uniforms([7], [12], 4) == got[1]).all()
    assert torch.Generator().manual_seed(-1).initial_seed() == 2**64 - 1


def test_counter_uniforms_are_uniform_and_new_for_each_counter():
    """20,000 draws (100 seeds x 50 counters x 4) in 20 equal bins of [0, 1): chi-square below
    its 1e-3 point (43.8 with 19 dof); neighbouring counters share no draw."""
    draws = counter_uniforms(list(range(100)) * 50, [c for c in range(50) for _ in range(100)], 4)
    u = torch.from_numpy(draws).double().flatten() * 2.0**-53
    assert 0 <= u.min() and u.max() < 1
    counts = torch.bincount((u * 20).long(), minlength=20).double()
    assert ((counts - 1000) ** 2 / 1000).sum() < 43.8
    assert len(set(draws.flatten().tolist())) == draws.size


def test_inverse_cdf_sample_follows_the_weights():
    """The first token whose fp64 cumulative weight exceeds u * total, on an edge case by hand
    (weights 0 never drawn, u = 0 and u just below 1); 20,000 counter draws follow unnormalised
    weights (each frequency within ~4 standard errors)."""
    w = torch.tensor([[0.0, 0.5, 0.0, 1.5, 0.0]])
    for u, want in ((0.0, 1), (0.2499, 1), (0.25, 3), (1 - 2**-53, 3)):
        assert inverse_cdf_sample(w, torch.tensor([u], dtype=torch.float64)).item() == want, u
    weights = torch.tensor([3.0, 0.0, 1.0, 0.5, 0.5]).repeat(20000, 1)
    u = torch.from_numpy(counter_uniforms(list(range(20000)), [5] * 20000, 1)[:, 0]).double() * 2.0**-53
    freq = torch.bincount(inverse_cdf_sample(weights, u), minlength=5).double() / 20000
    assert (freq - weights[0] / weights[0].sum()).abs().max() < 0.015 and freq[1] == 0


def test_logprob_of_chosen_token():
    logits = _logits(B=2, V=7)
    tokens, lp = sample(logits, [SamplingParams(temperature=1.0)] * 2, [make_generator(3)] * 2)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("top_k", 2**31),
                                         ("max_tokens", -1), ("prompt_logprobs", 21), ("logprobs", 50)])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_greedy_batch_fast_path_and_mixed_batches():
    logits = _logits(B=5, V=40)
    greedy = SamplingParams(temperature=0)
    tokens, lp = sample(logits, [greedy] * 5, [None] * 5)
    assert torch.equal(tokens, logits.argmax(-1)) and torch.equal(lp, torch.zeros(5))
    # a mixed batch: greedy rows still take the argmax, seeded rows match their solo draw
    p = SamplingParams(temperature=0.9, top_p=0.8, seed=5)
    mixed, _ = sample(logits, [greedy, p, greedy, p, SamplingParams(temperature=1.0)],
                      [None, make_generator(5), None, make_generator(6), None])
    solo, _ = sample(logits[1:2], [p], [make_generator(5)])
    assert mixed[0] == logits[0].argmax() and mixed[2] == logits[2].argmax()
    assert mixed[1] == solo[0]


def test_unfiltered_fast_path_is_the_tempered_softmax():
    """Without top-k / top-p the sort is skipped: the same distribution as the sorting path
    (greedy rows one-hot at the argmax, sampled rows the tempered softmax), and ``sample``
    returns it with ``distribution``."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)) * 4
    temperature = torch.tensor([0.0, 0.7, 1.0, 2.5, 0.0])
    top_k, top_p = torch.zeros(5, dtype=torch.long), torch.ones(5)
    fast = filtered_logprobs(logits, temperature, top_k, top_p, filtering=False)
    slow = filtered_logprobs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(fast.exp(), slow.exp(), rtol=0, atol=1e-6)
    want = torch.log_softmax(logits[1:4] / temperature[1:4, None], dim=-1)
    torch.testing.assert_close(fast[1:4], want, rtol=1e-6, atol=1e-6)
    assert (fast[[0, 4]] == 0).sum() == 2 and fast[0].argmax() == logits[0].argmax()
    params = [SamplingParams(temperature=float(t)) for t in temperature]
    assert not filters(params) and filters(params + [SamplingParams(top_k=5)])
    assert not filters([SamplingParams(temperature=0, top_p=0.5)])  # greedy rows never filter
    tokens, picked, probs = sample(logits, params, [make_generator(1)] * 5, distribution=True)
    torch.testing.assert_close(probs, fast.exp())
    torch.testing.assert_close(picked, fast.gather(-1, tokens[:, None])[:, 0])
    assert tokens[0] == logits[0].argmax() and tokens[4] == logits[4].argmax()


def test_tiny_temperature_samples_the_argmax():
    """A positive temperature too small to divide fp32 logits by (1e-40: inf, then NaN
    probabilities, token 0 every time) samples as ``MIN_TEMPERATURE``: the argmax here."""
    logits = _logits(B=3, V=50)
    for filtering in (False, True):
        logp = filtered_logprobs(logits, torch.full((3,), 1e-40), torch.zeros(3, dtype=torch.long),
                                 torch.ones(3), filtering)
        assert not logp.isnan().any() and torch.equal(logp.argmax(-1), logits.argmax(-1))
    tokens, _ = sample(logits, [SamplingParams(temperature=1e-40, top_k=2**31 - 1)] * 3, [make_generator(1)] * 3)
    assert torch.equal(tokens, logits.argmax(-1))
