"""MoonEP dispatch/combine over gloo equals the single-process MoE layer (fp32, skewed routing)."""

from __future__ import annotations

import copy
import functools
import os
import socket

import pytest
import torch
import torch.distributed as dist

from openk3 import preset
from openk3.model.moe import MoE
from openk3.parallel.expert_parallel import apply_moonep, send_matrix
from openk3.parallel.moonep import plan
from tests import forkserver

S = 24  # tokens per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layer(num_experts: int, skew: str) -> MoE:
    torch.manual_seed(0)
    cfg = preset("debug").replace(num_experts=num_experts, num_experts_per_token=3)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        if skew == "one_rank":  # rank 0's home experts win every token
            moe.gate.e_score_correction_bias[: num_experts // 4] = 5.0
        elif skew == "zipf":
            moe.gate.e_score_correction_bias.copy_(1.0 / torch.arange(1, num_experts + 1) ** 0.7)
    return moe


# every case of one world size runs in one set of processes (a spawn costs each process a torch
# import and a gloo rendezvous: most of these tests' time)
CASES = {2: [("one_rank", True), ("zipf", True), ("one_rank", False)], 4: [("one_rank", True), ("zipf", True)]}


def _worker(rank: int, world: int, port: int) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        return {(rank, skew, replicate): _case(rank, world, skew, replicate) for skew, replicate in CASES[world]}
    finally:
        dist.destroy_process_group()


def _case(rank: int, world: int, skew: str, replicate: bool) -> dict:
    ref = _layer(16, skew)
    ep = copy.deepcopy(ref)
    apply_moonep(ep, replicate=replicate)
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(world * S, ref.cfg.hidden_size, generator=g, requires_grad=True)
    cot = torch.randn(world * S, ref.cfg.hidden_size, generator=g)
    (ref(x_all) * cot).sum().backward()
    mine = slice(rank * S, (rank + 1) * S)
    x = x_all.detach()[mine].clone().requires_grad_(True)
    out = ep(x)
    (out * cot[mine]).sum().backward()
    with torch.no_grad():
        want = ref(x_all.detach()[mine])
    G = 16 // world
    home = slice(rank * G, (rank + 1) * G)
    def rel(a, b):  # max error relative to the reference's largest entry
        a = torch.zeros_like(b) if a is None else a  # experts that saw no pair: no gradient
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    errs = {
        "out": rel(out, want),
        "dx": rel(x.grad, x_all.grad[mine]),
        "w1": rel(ep.experts.w1.grad, ref.experts.w1.grad[home]),
        "w2": rel(ep.experts.w2.grad, ref.experts.w2.grad[home]),
        "w3": rel(ep.experts.w3.grad, ref.experts.w3.grad[home]),
    }
    router = ep.gate.weight.grad.clone()
    dist.all_reduce(router)  # the router is replicated: data-parallel sum of its gradient
    errs["router"] = rel(router, ref.gate.weight.grad)
    p = ep.experts.last_plan
    errs["balanced"] = bool((p.rank_load() == S * 3).all())
    errs["rank_load"] = p.rank_load().tolist()
    errs["replicas"] = p.num_replicas()
    return errs


@functools.cache
def _results(world: int) -> dict:
    """{(rank, skew, replicate): errors} of every case in ``CASES[world]``."""
    return {key: errs for rank in forkserver.spawn(_worker, world, (world, _free_port())) for key, errs in rank.items()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("skew", ["one_rank", "zipf"])
def test_moonep_layer_equals_single_process(world, skew):
    results = _results(world)
    for rank in range(world):
        errs = results[rank, skew, True]
        assert errs["balanced"], errs
        for key in ("out", "dx", "w1", "w2", "w3", "router"):
            assert errs[key] < 1e-6, (rank, key, errs)  # fp32: only summation order differs
    if skew == "one_rank":
        assert results[0, skew, True]["replicas"] > 0  # the skew really needed replicas


def test_home_only_baseline_is_exact_and_ragged():
    """replicate=False (the benchmark's baseline): same numbers, every pair on its home rank."""
    results = _results(2)
    for rank in range(2):
        errs = results[rank, "one_rank", False]
        for key in ("out", "dx", "w1", "w2", "w3", "router"):
            assert errs[key] < 1e-6, (rank, key, errs)
        assert errs["replicas"] == 0
    load = results[0, "one_rank", False]["rank_load"]
    assert load[0] > load[1]  # the skew stays on rank 0's experts: ragged


def test_send_matrix_rows_and_columns():
    g = torch.Generator().manual_seed(0)
    R, E = 4, 16
    counts_all = torch.randint(0, 9, (R, E), generator=g)
    counts_all[:, 0] += 40  # skew
    total = int(counts_all.sum())
    counts_all[0, 1] += (-total) % R
    p = plan(counts_all.sum(0), R)
    M = send_matrix(counts_all, p.assignment)
    assert torch.equal(M.sum(1), counts_all.sum(1))  # each rank sends all its pairs
    assert torch.equal(M.sum(0), p.rank_load())  # each rank receives its balanced share
