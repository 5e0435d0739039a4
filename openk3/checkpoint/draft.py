"""A draft directory: ``config.json`` (``DraftConfig``) and ``model.safetensors`` (the draft's own
tensors under its module names: ``fc.weight``, ``layer.*`` with the routed experts stacked). The
embedding and head are the target's and are not stored (docs/speculative.md).

    save_draft(draft, "runs/draft")
    draft = load_draft("runs/draft", target)   # refuses a target it was not trained for
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from openk3.checkpoint.atomic import atomic_directory
from openk3.model.draft import DraftConfig, Eagle3Draft, target_fingerprint
from openk3.model.model import KimiForCausalLM

DRAFT_CONFIG_FILE = "config.json"
DRAFT_WEIGHTS_FILE = "model.safetensors"


def save_draft(draft: Eagle3Draft, path: str | os.PathLike,
               extra_files: dict[str, bytes] | None = None) -> None:
    """Write the draft directory ``path`` in one atomic write, with ``extra_files`` (name -> bytes)."""
    with atomic_directory(path) as tmp:
        (tmp / DRAFT_CONFIG_FILE).write_text(json.dumps(draft.cfg.to_dict(), indent=1))
        tensors = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
        save_file(tensors, str(tmp / DRAFT_WEIGHTS_FILE), metadata={"format": "pt"})
        for name, content in (extra_files or {}).items():
            (tmp / name).write_bytes(content)


def load_draft(path: str | os.PathLike, target: KimiForCausalLM) -> Eagle3Draft:
    """The draft in directory ``path``, on the device of ``target`` in fp32, in eval mode.

    Raises ValueError when the directory or a file is missing, when the config is not a draft's,
    when ``target``'s config is not the one the draft was trained for (fingerprints differ), or
    when a tensor is missing, unexpected or of the wrong shape (each named)."""
    path = Path(path)
    config_file, weights_file = path / DRAFT_CONFIG_FILE, path / DRAFT_WEIGHTS_FILE
    for f in (config_file, weights_file):
        if not f.is_file():
            raise ValueError(f"draft directory {str(path)!r} has no {f.name}")
    try:
        cfg = DraftConfig.from_dict(json.loads(config_file.read_text()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{config_file}: not a draft config ({e})") from e
    have = target_fingerprint(target.cfg)
    if have != cfg.target_fingerprint:
        raise ValueError(f"draft {str(path)!r} was trained for another target (config fingerprint "
                         f"{cfg.target_fingerprint}, from {cfg.target_path!r}); this target's is {have} "
                         f"(hidden_size {target.cfg.hidden_size}, vocab_size {target.cfg.vocab_size}, "
                         f"{target.cfg.num_hidden_layers} layers)")
    device = target.lm_head.weight.device
    with torch.device(device):
        draft = Eagle3Draft(cfg)
    try:
        state = load_file(str(weights_file), device=str(device))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights_file}: cannot read the draft's weights ({e})") from e
    want = draft.state_dict()
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(f"{weights_file}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in state.items():
        if t.shape != want[name].shape:
            raise ValueError(f"{weights_file}: tensor {name} has shape {list(t.shape)}, the draft's "
                             f"config wants {list(want[name].shape)}")
    draft.load_state_dict(state)
    return draft.eval()
