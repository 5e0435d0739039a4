"""Training checkpoints: atomic, keep-last-N, exact resume.

Layout of a run directory::

    RUN_DIR/run_config.json        the resolved RunConfig (+ the ModelConfig it built)
    RUN_DIR/metrics.jsonl          one line of metrics per log interval
    RUN_DIR/checkpoints/step_000100/{model.pt, optim.pt, trainer.json}
    RUN_DIR/checkpoints/LATEST     name of the newest complete checkpoint
    RUN_DIR/export/                save_pretrained() of the newest checkpoint + tokenizer.json

A checkpoint is written to a temporary directory and renamed into place, then LATEST is
replaced (write + rename); a crash at any point leaves the previous checkpoint intact, and the
next save removes what a killed one left (``openk3.checkpoint.atomic``).
The state dicts come from ``openk3.parallel.parallelize.Parallel.state_dict``: full (unsharded,
all experts), gathered to rank 0, which alone writes. This file only persists them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from openk3.checkpoint.atomic import atomic_directory

CKPT_DIR = "checkpoints"
LATEST = "LATEST"


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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


def save_checkpoint(run_dir: Path, step: int, model_sd: dict, optim_sd: dict, trainer_state: dict,
                    keep_last: int) -> Path | None:
    """Write full model and optimiser state dicts (``Parallel.state_dict``), this process's RNG
    and ``trainer_state`` as checkpoint ``step``. Every rank may call it; rank 0 alone writes and
    returns the directory."""
    if not _is_main():
        return None
    root = run_dir / CKPT_DIR
    name = f"step_{step:06d}"
    remove_partial_saves(run_dir)
    with atomic_directory(root / name) as tmp:
        torch.save(model_sd, tmp / "model.pt")
        torch.save({"optim": optim_sd, "rng": rng_state()}, tmp / "optim.pt")
        (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
    _atomic_write_text(root / LATEST, name)
    kept = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    for old in kept[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return root / name


def remove_partial_saves(run_dir: Path) -> None:
    """Remove what killed saves left in ``run_dir``: temporary checkpoint and export
    directories (``.step_*.tmp-*``, ``.export.tmp-*``, ``.export.old-*``). Rank 0 only."""
    if not _is_main():
        return
    for pattern in (f"{CKPT_DIR}/.step_*.tmp-*", f"{CKPT_DIR}/.step_*.old-*", ".export.tmp-*", ".export.old-*"):
        for stale in run_dir.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = run_dir / CKPT_DIR / LATEST
    if not marker.exists():
        return None
    path = run_dir / CKPT_DIR / marker.read_text().strip()
    if not (path / "trainer.json").exists():
        raise ValueError(f"{marker} points to {path}, which is not a complete checkpoint")
    return path


def load_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """Read a checkpoint on this rank and restore its RNG state. Returns (model state dict,
    optimiser state dict, trainer state: step, data position...) for ``Parallel.load_state_dict``."""
    try:
        model_sd = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        extra = torch.load(path / "optim.pt", map_location="cpu", weights_only=False)
        trainer = json.loads((path / "trainer.json").read_text())
    except (OSError, RuntimeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read training checkpoint {path}: {e}") from e
    set_rng_state(extra["rng"])
    return model_sd, extra["optim"], trainer
