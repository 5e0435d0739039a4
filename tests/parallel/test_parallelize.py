"""``parallelize``: one process is the plain single-device path; 2 gloo processes (FSDP2, and
FSDP2 + MoonEP) give the gradient norm, weights, optimiser state (gathered from the sharded
state dict) and exported model of one process that trains on the same global batch."""

from __future__ import annotations

import copy
import datetime
import functools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from openk3.config import preset
from openk3.model import build_model
from openk3.model.moe import Router
from openk3.parallel.expert_parallel import MoonEPExperts
from openk3.parallel.fsdp import apply_fsdp
from openk3.parallel.parallelize import parallelize
from openk3.train.optim import build_optimizers
from openk3.train.trainer import Env
from tests import forkserver

TINY = dict(num_hidden_layers=2, full_attn_layers=[2], hidden_size=64, linear_head_dim=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=32,
            intermediate_size=96, moe_intermediate_size=32, moe_latent_size=48,
            attn_res_block_size=2, vocab_size=300)
MAX_NORM = 0.05  # small enough that every test step clips


def _model():
    return build_model(preset("debug").replace(**TINY), device="cpu", seed=0).train()


def _batch(rows: int) -> torch.Tensor:
    return torch.randint(0, 300, (rows, 17), generator=torch.Generator().manual_seed(1))


def _backward(model, ids) -> None:
    logits = model(ids[:, :-1]).logits
    F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()


def _step(opts) -> None:
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _grads(model) -> list:
    return [None if p.grad is None else p.grad.tolist() for p in model.parameters()]


def _env(rank=0, world=1) -> Env:
    return Env(rank, world, torch.device("cpu"), torch.float32)


def _assert_state_close(got, want, where: str = "", exact: bool = False) -> None:
    """Nested state dicts equal: tensors to fp32 summation-order tolerance (bit for bit if
    ``exact``), the rest exactly (a loaded optimiser holds its tuples as lists)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_state_close(got[key], want[key], f"{where}.{key}", exact)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_state_close(g, w, f"{where}[{i}]", exact)
    elif torch.is_tensor(want):
        # atol 1e-5: after the optimiser steps, Adam's m / sqrt(v) turns fp32 summation-order
        # differences of near-zero gradients into weight differences of up to 2.2e-6 (measured:
        # lm_head, weights ~0.08, on a 2-core AVX2 CPU of 2026-12-01; other CPUs gave < 1e-6)
        rtol, atol = (0.0, 0.0) if exact else (1e-5, 1e-5)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=where)
    else:
        assert got == want, where


def full_state(state):
    """A sharded state dict (``Parallel.state_dict``) with every DTensor gathered in full (on
    every rank; collective)."""
    if isinstance(state, dict):
        return {k: full_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [full_state(v) for v in state]
    return state.full_tensor() if isinstance(state, DTensor) else state


def test_one_process_is_the_single_device_path():
    model, ref = _model(), _model()
    parallel = parallelize(model, _env())
    assert parallel.model is model and parallel.gathered_model() is model
    opts, ref_opts = build_optimizers(model, 1e-2, 0.1), build_optimizers(ref, 1e-2, 0.1)
    ids = _batch(2)
    _backward(model, ids)
    _backward(ref, ids)
    parallel.reduce_gradients()
    assert _grads(model) == _grads(ref)  # nothing to reduce with one process
    norm = parallel.clip_grad_norm_(MAX_NORM)
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
    assert _grads(model) == _grads(ref)
    _step(opts)
    _step(ref_opts)
    state = parallel.state_dict(opts)
    want = get_state_dict(ref, ref_opts, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    _assert_state_close(state, {"model": want[0], "optim": want[1]})

    fresh = _model()
    fresh_parallel = parallelize(fresh, _env())
    fresh_opts = build_optimizers(fresh, 1e-2, 0.1)
    fresh_parallel.load_state_dict(copy.deepcopy(state), fresh_opts)
    _assert_state_close(fresh_parallel.state_dict(fresh_opts), state)


def test_ep_must_divide_the_world_and_the_experts():
    with pytest.raises(ValueError, match="RunConfig.ep=2: must divide the number of processes"):
        parallelize(_model(), _env(), ep=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (ep, replicate, collapsed): FSDP, + MoonEP, + plain EP; plain EP with every token routed to
# rank 0's experts (rank 1's got no gradient, skipped the clipping's all-reduce: a hang)
CASES = [(1, True, False), (2, True, False), (2, False, False), (2, False, True)]


def _worker(rank: int, world: int, port: int) -> dict:
    """Every case in one set of processes (a spawn costs each a torch import and a rendezvous).
    A failing case raises, naming itself; the other rank then fails at its next collective."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a collective one rank skips fails in a minute instead of hanging the suite
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        torch.set_num_threads(1)
        for ep, replicate, collapsed in CASES:
            try:
                _case(rank, world, ep, replicate, collapsed)
            except Exception as e:
                raise AssertionError(f"rank {rank}, ep={ep}, replicate={replicate}, "
                                     f"collapsed={collapsed}: {e}") from e
            results[rank, ep, replicate, collapsed] = "ok"
        _routers_stay_fp32(rank, world)
        results[rank, "bf16"] = "ok"
        return results
    finally:
        dist.destroy_process_group()


def _routers_stay_fp32(rank: int, world: int) -> None:
    """Under a bf16 policy (CUDA's) the routers compute with fp32 weights, the rest with bf16."""
    model = _model()
    apply_fsdp(model, _env(rank, world), param_dtype=torch.bfloat16)
    seen: dict[str, set] = {"router": set(), "other": set()}
    for module in model.modules():
        kind = "router" if isinstance(module, Router) else "other" if isinstance(module, torch.nn.Linear) else None
        if kind:
            module.register_forward_pre_hook(
                lambda m, args, kind=kind: seen[kind].add(m.weight.dtype) and None)
    _backward(model, _batch(2 * world).chunk(world)[rank])
    assert seen == {"router": {torch.float32}, "other": {torch.bfloat16}}, seen
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for m in model.modules() if isinstance(m, Router) for p in m.parameters())


def _collapse(model) -> None:
    """Every token's experts among the first half (rank 0's under ep 2)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Router):
                m.e_score_correction_bias[: model.cfg.num_experts // 2] = 100.0


def _case(rank: int, world: int, ep: int, replicate: bool, collapsed: bool) -> None:
    ids = _batch(2 * world)
    ref = _model()  # one process, the whole global batch
    if collapsed:
        _collapse(ref)
    ref_opts = build_optimizers(ref, 1e-2, 0.1)
    _backward(ref, ids)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    _step(ref_opts)

    model = _model()
    if collapsed:
        _collapse(model)
    parallel = parallelize(model, _env(rank, world), ep=ep, ep_replicate=replicate)
    assert all(m.replicate is replicate for m in model.modules() if isinstance(m, MoonEPExperts))
    opts = build_optimizers(model, 1e-2, 0.1)
    _backward(model, ids.chunk(world)[rank])
    parallel.reduce_gradients()
    norm = parallel.clip_grad_norm_(MAX_NORM)
    _step(opts)
    state = full_state(parallel.state_dict(opts))  # checkpoints: tests/train/test_checkpoint_dcp.py
    plain = parallel.gathered_model()
    if rank == 0:
        want = get_state_dict(ref, ref_opts, options=StateDictOptions(full_state_dict=True))
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        _assert_state_close(state, {"model": want[0], "optim": want[1]})
        _assert_state_close(plain.state_dict(), want[0])
    else:
        assert plain is None


@functools.cache
def _results() -> dict:
    return {key: ok for rank in forkserver.spawn(_worker, 2, (2, _free_port())) for key, ok in rank.items()}


def test_routers_stay_fp32_under_a_bf16_policy():
    """FSDP2 with CUDA's bf16 policy (here on gloo): each router is a unit of its own in fp32."""
    results = _results()
    assert results[0, "bf16"] == results[1, "bf16"] == "ok"


@pytest.mark.parametrize("ep, replicate, collapsed", CASES,
                         ids=["fsdp", "fsdp+moonep", "fsdp+plain-ep", "fsdp+plain-ep-collapsed"])
def test_two_processes_equal_one(ep, replicate, collapsed):
    """One step on 2 processes: the gradient norm, weights, optimiser state and exported model
    of one process on the global batch; with ep 2 MoonEP's experts, or plain expert
    parallelism (``ep_replicate=False``, the baseline MoonEP is measured against)."""
    results = _results()
    assert results[0, ep, replicate, collapsed] == results[1, ep, replicate, collapsed] == "ok"
