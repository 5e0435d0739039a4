"""Speculative sampling: greedy equals plain greedy decoding, the emitted tokens follow the
target exactly (chi-square, and the same check rejects wrong rules), the expected acceptance
count, seeded rows independent of the batch, the batch against the per-sequence reference,
the engine's temperature / top-k / top-p processing, argument errors; the greedy batch's path
(``greedy_verify``, ``sample_drafts`` without probabilities) against the general one."""

import pytest
import torch

import openk3.serve.speculative as spec
from openk3.serve.sampler import SamplingParams, make_generator, sample
from openk3.serve.draft import sample_drafts
from openk3.serve.speculative import greedy_verify, sampling_probs, speculative_sample

# Upper 1e-3 points of the chi-square distribution by degrees of freedom (scipy.stats.chi2.isf(1e-3, df);
# the same values are in the NIST/SEMATECH e-Handbook table 1.3.6.7.4). A correct sampler fails
# one check with probability 1e-3; the draws are seeded, so a run is reproducible either way.
CHI2_CRIT_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467}

# V = 5, K = 2: draft and target deliberately far apart (alpha_1 = 0.4, alpha_2 = 0.5). At
# position 1 the draft never proposes token 0 (q = 0) and the target never emits token 4 (p = 0),
# so token 0 comes only from the residual and a proposed 4 is always rejected.
P = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0], [0.1, 0.4, 0.1, 0.3, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]],
                 dtype=torch.float64)
Q = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4], [0.3, 0.1, 0.3, 0.1, 0.2]], dtype=torch.float64)
N = 40_000


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of the token counts against ``probs`` [V] and its degrees of freedom
    (cells with probability > 0, minus one). A token of probability 0 must never appear."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts.tolist()}"
    expected = counts.sum() * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def draws(p: torch.Tensor = P, q: torch.Tensor = Q, n: int = N, seed: int = 0):
    """n sequences with the same p [K+1, V] and q [K, V], drafts sampled from q; one batched call
    (one shared generator). Returns (num_accepted [n], tokens [n, K+1])."""
    g = make_generator(seed)
    K, V = q.shape
    drafts = torch.multinomial(q.float(), n, replacement=True, generator=g).T.contiguous()  # [n, K]
    return speculative_sample(drafts, q.expand(n, K, V), p.expand(n, K + 1, V), None,
                              [SamplingParams()] * n, [g] * n)


def assert_follows_target(num_accepted, tokens, p=P):
    stat, df = chi_square(tokens[:, 0], p[0])
    assert stat < CHI2_CRIT_1E3[df], f"first token: chi2 = {stat:.1f} with {df} dof"
    second = tokens[num_accepted >= 1, 1]  # the first draft token accepted: the next follows p_2
    assert second.numel() > N // 4
    stat, df = chi_square(second, p[1])
    assert stat < CHI2_CRIT_1E3[df], f"second token: chi2 = {stat:.1f} with {df} dof"


def test_critical_values_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df, crit in CHI2_CRIT_1E3.items():
        assert abs(stats.chi2.isf(1e-3, df) - crit) < 1e-3


def test_greedy_equals_plain_greedy_decoding():
    B, K, V = 6, 4, 17
    logits = torch.randn(B, K + 1, V, generator=torch.Generator().manual_seed(1)) * 3
    best = logits.argmax(-1)                                          # [B, K+1]
    drafts = best[:, :K].clone()
    first_miss = [0, 1, 2, 3, 4, 4]                                   # 4: every draft token right
    for b, i in enumerate(first_miss):
        if i < K:
            drafts[b, i] = (drafts[b, i] + 1) % V
            drafts[b, i + 1:] = torch.randint(0, V, (K - i - 1,))     # after a miss: anything
    greedy = [SamplingParams(temperature=0)] * B
    q = torch.nn.functional.one_hot(drafts, V).float()               # a greedy draft
    n, tokens = speculative_sample(drafts, q, sampling_probs(logits, greedy), None, greedy, [None] * B)
    assert n.tolist() == first_miss
    for b in range(B):
        plain = [int(sample(logits[b, i:i + 1], greedy[:1], [None])[0]) for i in range(n[b] + 1)]
        assert tokens[b, :n[b] + 1].tolist() == plain
        assert (tokens[b, n[b] + 1:] == -1).all()


def test_emitted_tokens_follow_the_target():
    assert_follows_target(*draws())


@pytest.mark.parametrize("rule,wrong", [
    ("residual", lambda p, q: p),                    # resample from p, not from max(0, p - q)
    ("acceptance_prob", lambda p_d, q_d: p_d),       # accept with p(d), not min(1, p(d) / q(d))
])
def test_chi_square_rejects_a_wrong_rule(monkeypatch, rule, wrong):
    # (Dropping the min in min(1, p/q) is no error: u < 1 <= p/q accepts either way.)
    monkeypatch.setattr(spec, rule, wrong)
    n, tokens = draws()
    with pytest.raises(AssertionError, match="chi2"):
        assert_follows_target(n, tokens)


def test_expected_acceptance_count():
    alpha = torch.minimum(P[:2], Q).sum(-1)                           # [0.4, 0.5]
    want = float(alpha[0] + alpha[0] * alpha[1])                      # sum_k prod_{i<=k} alpha_i
    n, _ = draws(seed=1)
    sd = float(n.double().std()) / N ** 0.5                           # ~0.004
    assert abs(float(n.double().mean()) - want) < 5 * sd


def _batch(B=5, K=5, V=12, seed=0):
    """drafts [B, K] sampled from q [B, K, V], a mixture of p [B, K+1, V] and noise, so that
    both early rejections and long accepted runs occur."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g, dtype=torch.float64) * 2, -1)
    q = 0.8 * p[:, :K] + 0.2 * q
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    return drafts, q, p


def test_seeded_rows_do_not_depend_on_the_batch():
    drafts, q, p = _batch(B=5, K=5)
    num_draft = [5, 3, 0, 2, 4]
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(5)]
    params[3] = SamplingParams(temperature=0)
    row, k = 1, num_draft[1]
    alone_gen, batch_gens = make_generator(7), [make_generator(1), make_generator(7), None, None, make_generator(2)]
    for _ in range(3):  # consecutive steps: the generator's state after a step is the same too
        alone = speculative_sample(drafts[row:row + 1, :k], q[row:row + 1, :k], p[row:row + 1, :k + 1],
                                   None, params[row:row + 1], [alone_gen])
        together = speculative_sample(drafts, q, p, num_draft, params, batch_gens)
        assert together[0][row] == alone[0][0]
        assert together[1][row, :k + 1].tolist() == alone[1][0].tolist()


def test_batch_equals_reference():
    B, K, V = 12, 5, 12
    drafts, q, p = _batch(B, K, V, seed=3)
    num_draft = [5, 0, 1, 2, 3, 4, 5, 5, 2, 5, 5, 3]
    q[2, 0, drafts[2, 0]] = 0.0              # a proposal the draft gives probability 0: rejected
    q[3] = p[3, :K]                          # p == q: every proposal accepted ...
    q[3, 1, drafts[3, 1]] = 0.0              # ... but this one, whose residual p - q is all zero
    p[3, 1, drafts[3, 1]] = 0.0              #     (q == p after this): the fallback samples p
    p[3, 1] /= p[3, 1].sum()
    q[3, 1] = p[3, 1]
    params = [SamplingParams(temperature=0 if b in (5, 9) else 1.0) for b in range(B)]
    padded = drafts.clone()
    for b, k in enumerate(num_draft):
        padded[b, k:] = -1                   # padding is never read as a token
    n, tokens = speculative_sample(padded, q, p, num_draft, params, [make_generator(b) for b in range(B)])
    for b, k in enumerate(num_draft):
        ref_n, ref_tokens = spec.speculative_sample_ref(drafts[b, :k], q[b, :k], p[b, :k + 1],
                                                   params[b].temperature == 0, make_generator(b))
        assert n[b] == ref_n and tokens[b, :ref_n + 1].tolist() == ref_tokens, b
    assert n[2] == 0 and n[3] == 1 and tokens[3, 1] != drafts[3, 1]
    assert (n > 2).any() and (n == 0).any()


def test_engine_processing_of_the_target():
    K, V = 2, 8
    logits = torch.randn(1, K + 1, V, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    p = sampling_probs(logits, [params])
    one = torch.ones(1)
    for i in range(K + 1):
        want = spec.filtered_logprobs(logits[:, i], one * 0.7, torch.tensor([4]), one * 0.9).exp()
        torch.testing.assert_close(p[:, i], want, rtol=0, atol=0)
    assert ((p > 0).sum(-1) <= 4).all() and ((p > 0).sum(-1) >= 2).all()
    # K = 0 is plain sampling: the same draws and token as sampler.sample, seed for seed
    for seed in range(20):
        n, tokens = speculative_sample(torch.zeros(1, 0, dtype=torch.long), p[:, :0], p[:, :1], None,
                                       [params], [make_generator(seed)])
        assert n == 0 and tokens[0, 0] == sample(logits[:, 0], [params], [make_generator(seed)])[0][0]
    # a uniform draft proposes tokens outside top-k / top-p: always rejected, output still exact
    q = torch.full((K, V), 1.0 / V)
    n, tokens = draws(p[0].double(), q.double(), seed=2)
    assert_follows_target(n, tokens, p[0].double())


def test_greedy_batch_is_one_hot_at_the_sampled_token():
    """A greedy batch skips the filtering: one-hot at ``sampler.sample``'s token, which is what
    the filtering gives too (without ties)."""
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(6))
    greedy = [SamplingParams(temperature=0)] * 3
    p = sampling_probs(logits, greedy)
    zero, one = torch.zeros(12), torch.ones(12)
    want = spec.filtered_logprobs(logits.flatten(0, 1), zero, torch.zeros(12, dtype=torch.long), one).exp()
    torch.testing.assert_close(p.flatten(0, 1), want, rtol=0, atol=0)
    assert torch.equal(p.argmax(-1), sample(logits.flatten(0, 1), greedy * 4, [None] * 12)[0].view(3, 4))


def test_acceptance_and_residual_edge_cases():
    assert spec.acceptance_prob(torch.tensor(0.5), torch.tensor(0.0)) == 0   # q(d) = 0: reject
    assert spec.acceptance_prob(torch.tensor(0.5), torch.tensor(0.25)) == 1
    p = torch.tensor([0.5, 0.5, 0.0])
    assert torch.equal(spec.residual(p, p), p)                                 # all zero: p
    assert torch.equal(spec.residual(p, torch.tensor([0.25, 0.75, 0.0])), torch.tensor([0.25, 0.0, 0.0]))


@pytest.mark.parametrize("change,name", [
    ({"draft_tokens": torch.zeros(2, 3, dtype=torch.int32)}, "draft_tokens"),
    ({"draft_probs": torch.zeros(2, 3, 6)}, "draft_probs"),
    ({"target_probs": torch.zeros(2, 3, 5)}, "target_probs"),
    ({"num_draft": [3, 4]}, "num_draft"),
    ({"params": [SamplingParams()]}, "params"),
])
def test_bad_arguments_are_named(change, name):
    args = {"draft_tokens": torch.zeros(2, 3, dtype=torch.long), "draft_probs": torch.zeros(2, 3, 5),
            "target_probs": torch.zeros(2, 4, 5), "num_draft": None, "params": [SamplingParams()] * 2,
            "generators": [None, None]}
    with pytest.raises(ValueError, match=name):
        speculative_sample(**(args | change))


@pytest.mark.parametrize("num_draft", [None, [4, 0, 2, 3, 1, 4, 4, 2]])
def test_greedy_verify_equals_speculative_sample(num_draft):
    """The greedy batch's path against ``speculative_sample`` with one-hot probabilities: logits
    with ties (small integers: the first index wins, as ``sampler.sample``), drafts right for a
    while and then wrong, padding beyond a row's ``num_draft`` that equals the target's argmax
    (so the padding must be masked, not merely unlikely to match)."""
    B, K, V = 8, 4, 6
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 3, (B, K + 1, V), generator=g).float()
    best = logits.argmax(-1)
    drafts = best[:, :K].clone()
    for b, miss in enumerate([0, 1, 2, 3, 4, 4, 1, 2]):
        if miss < K:
            drafts[b, miss] = (drafts[b, miss] + 1) % V
    greedy = [SamplingParams(temperature=0)] * B
    q = torch.nn.functional.one_hot(drafts, V).float()
    want = speculative_sample(drafts, q, sampling_probs(logits, greedy), num_draft, greedy, [None] * B)
    got = greedy_verify(drafts, logits, num_draft)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (got, want)
    assert got[0].tolist() == ([0, 1, 2, 3, 4, 4, 1, 2] if num_draft is None else [0, 0, 2, 3, 1, 4, 1, 2])


@pytest.mark.parametrize("change,match", [
    ({"draft_tokens": torch.zeros(2, 3, dtype=torch.int32)}, "draft_tokens"),
    ({"target_logits": torch.zeros(2, 3, 5)}, "target_logits"),
    ({"num_draft": [3, 4]}, "num_draft"),
])
def test_greedy_verify_names_bad_arguments(change, match):
    args = {"draft_tokens": torch.zeros(2, 3, dtype=torch.long), "target_logits": torch.zeros(2, 4, 5),
            "num_draft": None}
    with pytest.raises(ValueError, match=match):
        greedy_verify(**(args | change))


def test_greedy_drafts_carry_no_probabilities():
    """A greedy batch's drafting loop draws each chain's argmax and returns no probabilities; a
    batch with one sampled request takes the general loop (one-hot rows for the greedy ones).
    The chains: the next logits are a fixed table's row of the token drawn."""
    V, K = 7, 3
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(5))
    start = torch.randn(2, V, generator=torch.Generator().manual_seed(6))
    ks = [3, 1]

    def advance(i, drawn):
        return table[drawn]

    greedy = [SamplingParams(temperature=0)] * 2
    tokens, probs = sample_drafts(start, ks, K, greedy, [None, None], advance)
    assert probs is None
    want = [start[0].argmax()]
    for _ in range(2):
        want.append(table[want[-1]].argmax())
    assert tokens.tolist() == [[int(t) for t in want], [int(start[1].argmax()), -1, -1]]
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=0)]
    tokens2, probs2 = sample_drafts(start, ks, K, mixed, [None, make_generator(0)], advance)
    assert torch.equal(tokens2[0], tokens[0])
    assert torch.equal(probs2[0], torch.nn.functional.one_hot(tokens[0], V).float())


def test_docstring_example():
    from tests.ops.checks import run_doctests
    run_doctests(spec)
