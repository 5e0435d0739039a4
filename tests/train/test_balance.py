"""Router load balancing: Quantile Balancing (exact and histogram), the sign step, the Switch loss."""

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.balance_synthetic import SyntheticRouter, simulate
from openk3.config import preset
from openk3.model.moe import MoE, Router
from openk3.train.balance import (Balancer, expert_loads, histogram_quantile, load_max_over_mean,
                                  margin_bin_edges, qb_histogram, qb_margins, qb_update_exact,
                                  qb_update_histogram, sign_update, switch_aux_loss, target_load)
from tests import forkserver


def _scores(N, E, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(spread * torch.randn(N, E, generator=g) + torch.randn(E, generator=g))


def _bias(E, seed, scale):
    b = scale * torch.randn(E, generator=torch.Generator().manual_seed(seed + 1000))
    return b - b.mean()


def _exact_quantile(scores, bias, k):
    r = qb_margins(scores, bias, k)
    N, E = r.shape
    return r.kthvalue(N - target_load(N, k, E), dim=0).values  # (q+1)-th largest, [E]


def test_margins_separate_chosen_from_not_chosen():
    s, b, k = _scores(257, 16, 0), _bias(16, 0, 0.1), 3
    r = qb_margins(s, b, k)
    chosen = torch.zeros_like(r, dtype=torch.bool).scatter_(1, (s + b).topk(k, -1).indices, True)
    assert torch.equal(r > 0, chosen)
    assert torch.equal((r == 0).sum(-1), torch.ones(257, dtype=torch.long))  # the runner-up


@pytest.mark.parametrize("E,k,N", [(64, 4, 4096), (896, 16, 4096)])
def test_qb_balances_the_same_batch(E, k, N):
    s = SyntheticRouter(E).batch(N)
    b = torch.zeros(E)
    q = target_load(N, k, E)
    # Thresholds a_i held fixed: expert j keeps exactly the margins above its (q+1)-th largest,
    # i.e. q of them, less any that tie with it (runner-ups sit at margin 0 exactly).
    r, t = qb_margins(s, b, k), _exact_quantile(s, b, k)
    new = qb_update_exact(s, b, k)
    torch.testing.assert_close(new, (b - t) - (b - t).mean())
    assert abs(new.mean().item()) < 1e-6
    assert ((r > t).sum(0) <= q).all() and ((r >= t).sum(0) >= q + 1).all()
    # Re-routing (the thresholds move with the biases): iterating on one batch converges to q.
    loads = [expert_loads((s + b).topk(k, -1).indices, E).float() / q]
    for _ in range(5):
        b = qb_update_exact(s, b, k)
        loads.append(expert_loads((s + b).topk(k, -1).indices, E).float() / q)
    assert loads[0].max() > 10  # strongly skewed to start with
    assert loads[1].max() < 3.0  # measured 1.47 (E=64), 2.92 (E=896)
    assert loads[-1].max() < 1.1 and loads[-1].min() > 0.85  # measured 1.055/0.879, 1.055/0.918


def test_qb_update_of_routers_side_by_side_is_each_routers():
    # Balancer.update stacks its routers' scores [L, N, E] and biases [L, E]: one kernel per op
    # must give each router exactly its own update (and the bias shape is checked)
    E, k, N = 64, 4, 1000
    s = torch.stack([SyntheticRouter(E, seed=i).batch(N) for i in range(3)])
    b = torch.randn(3, E) * 0.1
    new = qb_update_exact(s, b, k)
    assert new.shape == (3, E)
    for i in range(3):
        assert torch.equal(new[i], qb_update_exact(s[i], b[i], k))
    with pytest.raises(ValueError, match="bias must be"):
        qb_update_exact(s, b[0], k)


@pytest.mark.parametrize("E,k,tokens,qb_max,sign_min", [(64, 4, 4096, 1.35, 9.0),
                                                        (896, 16, 4096, 1.8, 40.0)])
def test_qb_converges_lower_and_faster_than_sign(E, k, tokens, qb_max, sign_min):
    """Fresh batches from one skewed router; the bias is learned online (benchmarks/balance_synthetic)."""
    h = simulate(("qb", "sign"), E, k, steps=10, tokens=tokens)
    assert h["qb"][0] == h["sign"][0] > 10  # same start: the skewed router with zero bias
    # measured over steps 4-10: qb <= 1.24 (E=64), <= 1.67 (E=896; q = 73, so sampling noise
    # alone gives ~1.4); sign >= 10.3, >= 44.4
    assert max(h["qb"][3:]) < qb_max
    assert min(h["sign"][3:]) > sign_min


@settings(max_examples=40, deadline=None)
@given(N=st.integers(5, 300), E=st.integers(3, 40), k_frac=st.floats(0, 1), seed=st.integers(0, 10**6),
       bias_scale=st.sampled_from([0.0, 1e-3, 0.1, 2.0]), num_bins=st.sampled_from([4, 16, 64, 1024]))
def test_histogram_quantile_within_one_bin_of_exact(N, E, k_frac, seed, bias_scale, num_bins):
    k = 1 + int(k_frac * (E - 2))
    s, b = _scores(N, E, seed, spread=3.0), _bias(E, seed, bias_scale)
    edges = margin_bin_edges(b, num_bins)
    counts = qb_histogram(s, b, k, edges)
    assert counts[:, 0].sum() == 0 and counts[:, -1].sum() == 0  # the default range holds every margin
    assert torch.equal(counts.sum(-1), torch.full((E,), N))
    t, t_hat = _exact_quantile(s, b, k), histogram_quantile(counts, edges, k)
    # t_hat is the upper edge of the bin holding t: t <= t_hat, and no edge lies in between
    m = torch.bucketize(t, edges, right=True)
    assert (t <= t_hat).all() and torch.equal(t_hat, edges[m])
    # log-spaced bins: the bin at t is min_width wide near 0, else at most (rho - 1)|t| wide
    width, min_width, rho = edges[m] - edges[m - 1], edges[num_bins // 2 + 1], edges[-1] / edges[-2]
    assert (width <= torch.maximum(min_width, (rho - 1) * t.abs()) * 1.0001).all()
    new_hist = qb_update_histogram(s, b, k, num_bins)
    assert ((new_hist - qb_update_exact(s, b, k)).abs() <= width.max() + 1e-6).all()


def test_default_bins_are_log_spaced_and_finest_at_zero():
    b = _bias(896, 0, 0.2)
    e = margin_bin_edges(b)  # 1024 bins
    assert e.numel() == 1025 and e[512] == 0 and torch.all(e[1:] > e[:-1])
    assert e[-1].item() == pytest.approx(1 + (b.max() - b.min()).item(), rel=1e-5)
    assert e[513].item() == pytest.approx(1e-6)
    ratio = e[514:] / e[513:-1]
    assert ratio.min().item() == pytest.approx(ratio.max().item(), rel=1e-3) and ratio.max() < 1.03


def test_out_of_range_margins_are_counted_and_the_quantile_clamps():
    N, E, k = 500, 12, 3
    s, b = _scores(N, E, 1, spread=3.0), _bias(E, 1, 0.05)
    r, t = qb_margins(s, b, k), _exact_quantile(s, b, k)
    lo, hi = -0.05, 0.05
    edges = margin_bin_edges(b, 10, (lo, hi))
    counts = qb_histogram(s, b, k, edges)
    assert torch.equal(counts[:, 0], (r < lo).sum(0)) and torch.equal(counts[:, -1], (r >= hi).sum(0))
    assert counts[:, 0].sum() > 0 and counts[:, -1].sum() > 0
    assert torch.equal(counts.sum(-1), torch.full((E,), N))
    t_hat = histogram_quantile(counts, edges, k)
    inside = (t >= lo) & (t < hi)
    assert (~inside).any() and inside.any()
    assert torch.equal(t_hat[t < lo], torch.full_like(t_hat[t < lo], lo))
    assert torch.equal(t_hat[t >= hi], torch.full_like(t_hat[t >= hi], hi))
    assert ((t_hat - t)[inside] >= 0).all() and ((t_hat - t)[inside] <= (hi - lo) / 10 + 1e-6).all()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _ReplayRouter(Router):
    """A router whose forward returns fixed scores [N, E] (routed with its current bias), so a
    test controls exactly what the Balancer's hook collects."""

    def __init__(self, scores: torch.Tensor, k: int, bias: torch.Tensor):
        super().__init__(preset("debug").replace(num_experts=scores.shape[1], num_experts_per_token=k))
        self.scores = scores
        self.e_score_correction_bias.copy_(bias)

    def forward(self, x):
        topk_idx = (self.scores + self.e_score_correction_bias).topk(self.cfg.num_experts_per_token, -1).indices
        return self.scores, topk_idx, self.scores.gather(1, topk_idx)


def _dp_worker(rank, world_size, port, scores, bias, k):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))
    try:
        shard = scores.tensor_split(world_size)[rank]  # uneven shards on purpose
        E = scores.shape[1]
        topk_idx = (shard + bias).topk(k, -1).indices
        router = _ReplayRouter(shard, k, bias)
        balancer = Balancer("qb", E, k).attach(router)
        router(None)
        balancer.update()  # world size > 1: switches to the histogram
        out = {"hist": qb_update_histogram(shard, bias, k), "balancer": router.e_score_correction_bias,
               "sign": sign_update(topk_idx, bias, E, gamma=0.01)}
        return out if rank == 0 else None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_histogram_equals_one_process(world_size):
    N, E, k = 1003, 64, 4
    s, b = SyntheticRouter(E, seed=world_size).batch(N), _bias(E, 3, 0.1)
    out = forkserver.spawn(_dp_worker, world_size, (world_size, _free_port(), s, b, k), timeout=60)[0]
    whole = qb_update_histogram(s, b, k)
    assert torch.equal(out["hist"], whole) and torch.equal(out["balancer"], whole)
    edges = margin_bin_edges(b)
    m = torch.bucketize(_exact_quantile(s, b, k), edges, right=True)
    assert ((whole - qb_update_exact(s, b, k)).abs() <= (edges[m] - edges[m - 1]).max() + 1e-6).all()
    assert torch.equal(out["sign"], sign_update((s + b).topk(k, -1).indices, b, E, gamma=0.01))


def test_switch_aux_loss_is_one_when_uniform_and_differentiable():
    N, E, k = 64, 8, 2
    s = torch.full((N, E), 0.3, requires_grad=True)
    balanced = (torch.arange(N).unsqueeze(-1) * k + torch.arange(k)) % E  # every expert N*k/E times
    loss = switch_aux_loss(s, balanced, E)
    assert loss.item() == pytest.approx(1.0)
    skewed_s = _scores(N, E, 0).requires_grad_(True)
    skewed = switch_aux_loss(skewed_s, skewed_s.detach().topk(k, -1).indices, E)
    assert skewed.item() > 1.0
    skewed.backward()
    assert skewed_s.grad is not None and skewed_s.grad.abs().sum() > 0


def test_sign_update_moves_against_the_load():
    E = 4
    topk_idx = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3]])  # loads 4, 2, 1, 1; mean 2
    new = sign_update(topk_idx, torch.zeros(E), E, gamma=0.5)
    assert torch.equal(new, torch.tensor([-0.5, 0.0, 0.5, 0.5]))


def test_load_max_over_mean():
    topk_idx = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3]])  # loads 4, 2, 1, 1
    assert load_max_over_mean(topk_idx, 4) == 2.0


def _moe_stack(num_layers: int = 2) -> torch.nn.Sequential:
    """MoE layers in a row: a model with one router per layer, as the Balancer sees a KimiForCausalLM."""
    cfg = preset("debug")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[MoE(cfg) for _ in range(num_layers)]).train()
    with torch.no_grad():
        for name, p in model.named_parameters():  # experts are torch.empty until initialised
            p.normal_(0, 0.5 if name.endswith("gate.weight") else 0.05)
    return model


def _routing(model, x):
    """Each layer's router output for the input ``model(x)`` gives it, computed without hooks."""
    out = []
    with torch.no_grad():
        for m in model:
            scores, topk_idx, _ = Router.forward(m.gate, x.reshape(-1, x.shape[-1]))
            out.append((scores, topk_idx))
            x = m(x)
    return out


def test_routers_are_batched_by_shape_and_size(monkeypatch):
    import openk3.train.balance as balance

    monkeypatch.setattr(balance, "QB_BATCH_NUMEL", 80)
    scores = [torch.zeros(10, 4)] * 3 + [torch.zeros(5, 4)] + [torch.zeros(10, 4)] * 2
    assert balance._batches(scores) == [[0, 1], [2], [3], [4, 5]]
    monkeypatch.setattr(balance, "QB_BATCH_NUMEL", 1)  # too small for one: one router a batch
    assert balance._batches(scores[:2]) == [[0], [1]]


def test_balancer_on_moe_layers():
    model = _moe_stack()
    cfg = model[0].cfg
    E, k = cfg.num_experts, cfg.num_experts_per_token
    balancers = {m: Balancer(m, E, k).attach(model) for m in ("none", "aux", "qb", "sign")}
    x = torch.randn(4, 16, cfg.hidden_size)
    routing = _routing(model, x)
    model(x)
    old = [m.gate.e_score_correction_bias.clone() for m in model]
    balancers["none"].update()
    balancers["aux"].update()
    assert all(torch.equal(m.gate.e_score_correction_bias, b) for m, b in zip(model, old))
    balancers["qb"].update()
    for m, b, (scores, _) in zip(model, old, routing):
        assert torch.equal(m.gate.e_score_correction_bias, qb_update_exact(scores, b, k))
    aux = balancers["aux"].aux_loss()
    torch.testing.assert_close(aux, sum(switch_aux_loss(s, idx, E) for s, idx in routing))
    assert balancers["qb"].aux_loss().item() == 0.0
    stats = balancers["sign"].stats()
    assert stats == [load_max_over_mean(idx, E) for _, idx in routing] and all(v >= 1.0 for v in stats)
    with pytest.raises(ValueError, match="method"):
        Balancer("adam", E, k)
    with pytest.raises(ValueError, match="no routing"):
        Balancer("qb", E, k).attach(_moe_stack()).update()
    with pytest.raises(ValueError, match="attach"):
        Balancer("qb", E, k).update()
    with pytest.raises(ValueError, match="num_experts=8"):
        Balancer("qb", 16, k).attach(model)
    with pytest.raises(ValueError, match="already attached"):
        balancers["qb"].attach(model)


def test_hook_collects_one_routing_per_layer_per_training_forward():
    """Every training forward replaces each layer's routing (never adds to it); micro-batches of
    different sizes show which forward was collected."""
    model = _moe_stack(3)
    cfg = model[0].cfg
    E, k = cfg.num_experts, cfg.num_experts_per_token
    balancer = Balancer("sign", E, k, gamma=0.1).attach(model)
    first, second = torch.randn(2, 8, cfg.hidden_size), torch.randn(3, 5, cfg.hidden_size)
    model(first)
    model(second)
    routing = _routing(model, second)
    assert balancer.stats() == [load_max_over_mean(idx, E) for _, idx in routing]
    old = [m.gate.e_score_correction_bias.clone() for m in model]
    balancer.update()  # the sign step on the second forward's 15 tokens per layer, not 31
    for m, b, (_, idx) in zip(model, old, routing):
        assert torch.equal(m.gate.e_score_correction_bias, sign_update(idx, b, E, gamma=0.1))


def test_eval_forwards_and_detached_hooks_collect_nothing():
    model = _moe_stack()
    cfg = model[0].cfg
    E, k = cfg.num_experts, cfg.num_experts_per_token
    balancer = Balancer("qb", E, k).attach(model)
    x, other = torch.randn(2, 8, cfg.hidden_size), torch.randn(2, 8, cfg.hidden_size)
    model.eval()(x)
    with pytest.raises(ValueError, match="no routing"):
        balancer.stats()
    model.train()(x)
    model.eval()(other)  # evaluation between training steps leaves the training routing alone
    want = [load_max_over_mean(idx, E) for _, idx in _routing(model, x)]
    assert balancer.stats() == want
    balancer.detach()
    model.train()(other)
    assert balancer.stats() == want  # no hook: the training forward was not collected
    fresh = Balancer("qb", E, k).attach(model)
    fresh.detach()
    model(other)
    with pytest.raises(ValueError, match="no routing"):
        fresh.stats()


def test_aux_loss_gradient_reaches_the_router_through_collected_scores():
    model = _moe_stack()
    cfg = model[0].cfg
    balancer = Balancer("aux", cfg.num_experts, cfg.num_experts_per_token).attach(model)
    model(torch.randn(2, 8, cfg.hidden_size))
    balancer.aux_loss().backward()  # the aux loss alone: its gradient can only come through the hook
    for m in model:
        assert m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0
    # nothing after the last router feeds the loss: the graph ran through the collected scores
    assert all(p.grad is None for n, p in model[-1].named_parameters() if not n.startswith("gate."))
    sign = Balancer("sign", cfg.num_experts, cfg.num_experts_per_token).attach(model)
    model(torch.randn(2, 8, cfg.hidden_size))
    assert not sign.aux_loss().requires_grad  # other methods keep no graph
