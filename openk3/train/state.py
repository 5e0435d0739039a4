"""Training checkpoints: atomic, keep-last-N, exact resume.

Layout of a run directory::

    RUN_DIR/run_config.json        the resolved RunConfig (+ the ModelConfig it built)
    RUN_DIR/metrics.jsonl          one line of metrics per log interval
    RUN_DIR/checkpoints/step_000100/{model.pt, optim.pt, trainer.json}
    RUN_DIR/checkpoints/LATEST     name of the newest complete checkpoint
    RUN_DIR/export/                save_pretrained() of the newest checkpoint + tokenizer.json

A checkpoint is written to a temporary directory and renamed into place, then LATEST is
replaced (write + rename); a crash at any point leaves the previous checkpoint intact.
With FSDP the full (unsharded) state is gathered to rank 0, which alone writes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

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


def _gather_expert_state(model_sd: dict, optim_sd: dict, optimizers, ep_params: dict,
                         ep_group=None) -> None:
    """Replace the rank-local expert shares (MoonEP) by the full [E, ...] tensors, in place."""
    from openk3.parallel.expert_parallel import gather_experts

    for fqn, p in ep_params.items():  # same order on every rank: these are collectives
        full = gather_experts(p.detach(), ep_group)
        state = next((opt.state[p] for opt in optimizers if p in opt.state), {})
        moments = {k: gather_experts(v, ep_group) for k, v in sorted(state.items())
                   if torch.is_tensor(v) and v.shape == p.shape}
        if _is_main():
            model_sd[fqn] = full.cpu()
            optim_sd["state"].setdefault(fqn, {}).update({k: v.cpu() for k, v in moments.items()})


def _slice_expert_state(model_sd: dict, optim_sd: dict, ep_params: dict, ep_group=None) -> None:
    from openk3.parallel.expert_parallel import home_share

    for fqn in ep_params:
        E = model_sd[fqn].shape[0]
        model_sd[fqn] = home_share(model_sd[fqn], ep_group)
        for k, v in optim_sd["state"].get(fqn, {}).items():
            if torch.is_tensor(v) and v.dim() and v.shape[0] == E:
                optim_sd["state"][fqn][k] = home_share(v, ep_group)


def save_checkpoint(run_dir: Path, step: int, model, optimizers, trainer_state: dict,
                    keep_last: int, ep_params: dict | None = None, ep_group=None) -> Path | None:
    """Collective under FSDP/EP (every rank calls it); rank 0 writes. Returns the directory.
    Expert shares of MoonEP (``ep_params``) are gathered, so the files hold all E experts."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizers, options=opts)
    if ep_params:
        _gather_expert_state(model_sd, optim_sd, optimizers, ep_params, ep_group)
    if not _is_main():
        return None
    root = run_dir / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        torch.save(model_sd, tmp / "model.pt")
        torch.save({"optim": optim_sd, "rng": rng_state()}, tmp / "optim.pt")
        (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _atomic_write_text(root / LATEST, name)
    kept = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    for old in kept[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = run_dir / CKPT_DIR / LATEST
    if not marker.exists():
        return None
    path = run_dir / CKPT_DIR / marker.read_text().strip()
    if not (path / "trainer.json").exists():
        raise ValueError(f"{marker} points to {path}, which is not a complete checkpoint")
    return path


def load_checkpoint(path: Path, model, optimizers, ep_params: dict | None = None,
                    ep_group=None) -> dict:
    """Restore model, optimisers and RNG in place; returns the trainer state (step, data...).
    With MoonEP, each rank takes its experts' rows of the saved [E, ...] tensors."""
    try:
        model_sd = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        extra = torch.load(path / "optim.pt", map_location="cpu", weights_only=False)
        trainer = json.loads((path / "trainer.json").read_text())
    except (OSError, RuntimeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read training checkpoint {path}: {e}") from e
    if ep_params:
        _slice_expert_state(model_sd, extra["optim"], ep_params, ep_group)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_state_dict(model, optimizers, model_state_dict=model_sd, optim_state_dict=extra["optim"],
                   options=opts)
    set_rng_state(extra["rng"])
    return trainer
