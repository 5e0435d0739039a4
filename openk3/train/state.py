"""Training checkpoints: sharded, atomic, keep-last-N, exact resume.

Layout of a run directory::

    RUN_DIR/run_config.json        the resolved RunConfig (+ the ModelConfig it built)
    RUN_DIR/metrics.jsonl          one line of metrics per log interval
    RUN_DIR/checkpoints/step_000100/
        .metadata                  torch.distributed.checkpoint (DCP): every tensor's global shape
                                   and which file holds which of its shards
        __0_0.distcp, __1_0.distcp, ...   the shards, one file per writing rank
        rng_rank0.pt, ...          each rank's RNG state
        trainer.json               step, number of processes, data position, LR schedule
    RUN_DIR/checkpoints/LATEST     name of the newest complete checkpoint
    RUN_DIR/export/                save_pretrained() of the newest checkpoint + tokenizer.json

The state comes from ``openk3.parallel.parallelize.Parallel.state_dict``, sharded as the
run's layout is; every rank writes its own shards (nothing is gathered), and loading reshards
to the layout of the run that resumes (another number of processes, another ``ep``). This file
only persists it. The run directory must be on a filesystem all ranks share.

A checkpoint is written by every rank into one temporary directory; when all have finished
(a barrier), rank 0 renames it into place, then replaces LATEST (write + rename). A crash at
any point leaves the previous checkpoint intact, and the next start or save removes what a
killed one left (``remove_partial_saves``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from openk3.checkpoint.atomic import atomic_directory
from openk3.parallel.collectives import barrier

CKPT_DIR = "checkpoints"
LATEST = "LATEST"
TRAINER_FILE = "trainer.json"
OLD_FORMAT_FILE = "model.pt"  # the full-state checkpoints before sharding


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def _no_single_process_warning() -> Iterator[None]:
    """DCP warns at every save and load without a process group; one process is a layout
    like any other here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _from_rank0(obj):
    """Rank 0's ``obj``, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _shared_atomic_directory(path: Path) -> Iterator[Path]:
    """``atomic_directory(path)`` that every rank writes into: rank 0 makes the temporary
    directory and tells the others its name; once every rank has left the block cleanly (a
    barrier: all have finished writing), rank 0 renames it into place."""
    if _rank_and_world()[0] != 0:
        yield Path(_from_rank0(None))
        barrier()
        return
    with atomic_directory(path) as tmp:
        _from_rank0(str(tmp))
        yield tmp
        barrier()


def save_checkpoint(run_dir: Path, step: int, state: dict, trainer_state: dict,
                    keep_last: int) -> Path:
    """Write ``state`` (``Parallel.state_dict``: this rank's shards), this rank's RNG and
    ``trainer_state`` (JSON: data position, LR schedule) as checkpoint ``step``; returns its
    directory. Collective: every rank calls it, and returns once the checkpoint is LATEST."""
    rank, world = _rank_and_world()
    root = run_dir / CKPT_DIR
    name = f"step_{step:06d}"
    remove_partial_saves(run_dir)
    with _shared_atomic_directory(root / name) as tmp:
        with _no_single_process_warning():
            dcp.save(state, checkpoint_id=tmp)
        torch.save(rng_state(), tmp / _rng_file(rank))
        if rank == 0:
            (tmp / TRAINER_FILE).write_text(json.dumps(
                {"step": step, "world_size": world, **trainer_state}, indent=1))
    if rank == 0:
        _atomic_write_text(root / LATEST, name)
        _prune(root, step, keep_last)
    barrier()
    return root / name


def _prune(root: Path, step: int, keep_last: int) -> None:
    """Keep checkpoint ``step`` (just written, LATEST) and the ``keep_last - 1`` before it, by
    step number (``step_1000000`` sorts before ``step_999999`` by name); remove the rest, and any
    of a later step: a run killed between a checkpoint's rename and LATEST left it, and this run,
    resumed from an earlier one, has gone another way since."""
    steps = {}
    for p in root.iterdir():
        number = p.name.removeprefix("step_")
        if p.is_dir() and p.name.startswith("step_") and number.isdigit():
            steps[int(number)] = p
    earlier = sorted(n for n in steps if n < step)
    for n in earlier[:max(len(earlier) - (keep_last - 1), 0)] + [n for n in steps if n > step]:
        shutil.rmtree(steps[n], ignore_errors=True)


def remove_partial_saves(run_dir: Path) -> None:
    """Remove what killed saves left in ``run_dir``: temporary checkpoint and export
    directories (``.step_*.tmp-*``, ``.export.tmp-*``, ``.export.old-*``). Rank 0 only."""
    if _rank_and_world()[0] != 0:
        return
    for pattern in (f"{CKPT_DIR}/.step_*.tmp-*", f"{CKPT_DIR}/.step_*.old-*", ".export.tmp-*", ".export.old-*"):
        for stale in run_dir.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = run_dir / CKPT_DIR / LATEST
    if not marker.exists():
        return None
    path = run_dir / CKPT_DIR / marker.read_text().strip()
    if not (path / TRAINER_FILE).exists():
        raise ValueError(f"{marker} points to {path}, which is not a complete checkpoint")
    return path


def load_checkpoint(path: Path, state: dict) -> dict:
    """Fill ``state`` in place from checkpoint ``path`` and return its trainer state (step,
    data position, ...). ``state`` is ``Parallel.state_dict`` of the freshly built run: it names
    the shards this run's layout wants, which are read from whatever layout saved them. Each
    rank restores its RNG state when the number of processes is the one that saved (otherwise
    the ranks' streams do not correspond and the seeded state stays). Collective."""
    if (path / OLD_FORMAT_FILE).exists():
        raise ValueError(f"{path} is a checkpoint in the old full-state format ({OLD_FORMAT_FILE}, "
                         "optim.pt); checkpoints are now sharded (torch.distributed.checkpoint) and "
                         "this one cannot be resumed: start a new run (another --out), or load its "
                         "weights from RUN_DIR/export")
    rank, world = _rank_and_world()
    try:
        trainer = json.loads((path / TRAINER_FILE).read_text())
        with _no_single_process_warning():
            dcp.load(state, checkpoint_id=path)
        if trainer["world_size"] == world:
            set_rng_state(torch.load(path / _rng_file(rank), weights_only=True))
    except (OSError, json.JSONDecodeError, KeyError, CheckpointException) as e:
        raise ValueError(f"cannot read training checkpoint {path}: {e}") from e
    return trainer
