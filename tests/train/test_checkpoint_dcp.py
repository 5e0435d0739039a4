"""Sharded checkpoints (``torch.distributed.checkpoint``) written and read by
``openk3.train.state`` from ``Parallel.state_dict``: one process writes the same format (one
shard) and resumes bit for bit; a checkpoint moves between layouts (one process <-> two with
FSDP2 + MoonEP ``ep=2``), re-slicing FSDP's shards and the expert shares; the old full-state
format is refused. Training runs that resume (2 and 4 processes, 4 -> 2, a save killed midway)
are in ``tests/train/test_trainer.py``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from openk3.parallel.parallelize import parallelize
from openk3.train.optim import build_optimizers
from openk3.train.state import latest_checkpoint, load_checkpoint, save_checkpoint
from openk3.train.trainer import Env
from tests import forkserver
from tests.parallel.test_parallelize import (_assert_state_close, _backward, _batch, _free_port, _model,
                                             _step, full_state)


def _setup(device: str, world: int = 1, rank: int = 0, ep: int = 1):
    """(parallel, optimisers) of the fresh tiny model on ``device`` (fp32) in this layout."""
    model = _model().to(device)
    parallel = parallelize(model, Env(rank, world, torch.device(device), torch.float32), ep=ep)
    return parallel, build_optimizers(model, 1e-2, 0.1)


def _train_step(parallel, opts, world: int = 1, rank: int = 0) -> None:
    """One step on this rank's part of a batch of 4."""
    _backward(parallel.model, _batch(4).chunk(world)[rank].to(next(parallel.model.parameters()).device))
    parallel.reduce_gradients()
    _step(opts)


def _resumed(path, device: str, world: int = 1, rank: int = 0, ep: int = 1):
    """(parallel, optimisers, trainer state) of the fresh tiny model loaded from checkpoint ``path``."""
    parallel, opts = _setup(device, world, rank, ep)
    state = parallel.state_dict(opts)
    trainer = load_checkpoint(path, state)
    parallel.load_state_dict(state, opts)
    return parallel, opts, trainer


def test_one_process_writes_one_shard_and_resumes_bit_for_bit(tmp_path):
    parallel, opts = _setup("cpu")
    _train_step(parallel, opts)
    torch.manual_seed(7)
    path = save_checkpoint(tmp_path, 1, parallel.state_dict(opts), {"data": {"batches_drawn": 1}},
                           keep_last=2)
    after_save = torch.rand(3)
    assert latest_checkpoint(tmp_path) == path
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "rng_rank0.pt",
                                                      "trainer.json"]
    resumed, resumed_opts, trainer = _resumed(path, "cpu")
    assert trainer == {"step": 1, "world_size": 1, "data": {"batches_drawn": 1}}
    assert torch.equal(torch.rand(3), after_save)  # the RNG continues where the save left it
    _assert_state_close(resumed.state_dict(resumed_opts), parallel.state_dict(opts), exact=True)


def test_old_full_state_checkpoint_is_refused(tmp_path):
    path = tmp_path / "step_000003"
    path.mkdir()
    for name in ("model.pt", "optim.pt", "trainer.json"):
        (path / name).write_text("{}")
    with pytest.raises(ValueError, match="old full-state format"):
        load_checkpoint(path, {})


def _two_process_worker(rank: int, world: int, port: int, device: str, tmp) -> str:
    """Resume the one-process checkpoint ``tmp/one`` with ``ep=2``, check it against the state
    that was saved, take a step, save ``tmp/two`` and, on rank 0, its state gathered in full."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        device = f"{device}:{rank}" if device == "cuda" else device
        parallel, opts, _ = _resumed(latest_checkpoint(tmp / "one"), device, world, rank, ep=2)
        loaded = full_state(parallel.state_dict(opts))
        if rank == 0:
            want = torch.load(tmp / "one.pt", map_location=device, weights_only=False)
            _assert_state_close(loaded, want, exact=True)
        _train_step(parallel, opts, world, rank)
        save_checkpoint(tmp / "two", 2, parallel.state_dict(opts), {}, keep_last=1)
        saved = full_state(parallel.state_dict(opts))
        if rank == 0:
            torch.save(saved, tmp / "two.pt")
        return "ok"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")])])
def test_checkpoint_moves_between_one_process_and_moonep_on_two(tmp_path, device):
    """1 process -> 2 processes with ep=2 (FSDP shards and expert shares cut from whole tensors)
    -> 1 process: every weight and optimiser moment arrives bit for bit. On CUDA the shards
    travel through NCCL and are written from GPU memory."""
    parallel, opts = _setup(device)
    _train_step(parallel, opts)
    save_checkpoint(tmp_path / "one", 1, parallel.state_dict(opts), {}, keep_last=1)
    torch.save(parallel.state_dict(opts), tmp_path / "one.pt")
    assert forkserver.spawn(_two_process_worker, 2, (2, _free_port(), device, tmp_path)) == ["ok", "ok"]
    two = latest_checkpoint(tmp_path / "two")
    assert sorted(p.name for p in two.iterdir() if p.suffix == ".distcp") == ["__0_0.distcp", "__1_0.distcp"]
    resumed, resumed_opts, trainer = _resumed(two, device)
    assert trainer == {"step": 2, "world_size": 2}
    want = torch.load(tmp_path / "two.pt", map_location=device, weights_only=False)
    _assert_state_close(resumed.state_dict(resumed_opts), want, exact=True)
