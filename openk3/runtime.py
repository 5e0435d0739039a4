"""Where a model runs and how it is loaded: the one place for device and dtype defaults, and
``load_model``, which ``openk3 generate``, ``openk3 serve`` and ``openk3.LLM`` share.

    >>> model, tokenizer, name = load_model(preset="debug", random_init=True, device="cpu")
    >>> name, next(model.parameters()).dtype
    ('openk3-debug', torch.float32)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from openk3.checkpoint import load_pretrained
from openk3.checkpoint.hf import EXPERTS_MODES
from openk3.config import preset as model_preset
from openk3.model import build_model
from openk3.model.moe import set_qat
from openk3.model.packed_experts import pack_experts
from openk3.tokenizer import VisibleTokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """The device called ``name``; None (or ``"auto"``) is CUDA when available, else the CPU.

    Raises ValueError for a malformed name or for CUDA on a machine without it.
    """
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device={name!r}: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={name!r}: openk3 runs on 'cpu' or 'cuda' (or 'auto')")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device={name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (what the kernels are built for); fp32 elsewhere, where bf16 matmuls are slow
    and the PyTorch references are exact."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A dtype or its name in ``DTYPES``; None (or ``"auto"``) is ``default_dtype(device)``."""
    if name is None or name == "auto":
        return default_dtype(device)
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def checkpoint_dir(path: str | Path) -> Path:
    """The weights directory ``path`` names: a training run's directory (it has
    ``run_config.json``) means its ``export/``, anything else is taken as it is."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint={str(path)!r}: no such directory")
    if not (path / "run_config.json").exists():
        return path
    if not (path / "export").is_dir():
        raise ValueError(f"checkpoint={str(path)!r} is a training run without export/ "
                         f"(written when training ends)")
    return path / "export"


def run_qat(path: str | Path) -> str:
    """The ``qat`` mode of the training run in directory ``path`` (its ``run_config.json``);
    ``"none"`` for anything else, for runs saved before QAT existed, and for post-training runs
    (``openk3 rl`` / ``distill``: their ``run_config.json`` holds ``posttrain``, and they export
    plain weights)."""
    run_file = Path(path) / "run_config.json"
    if not run_file.exists():
        return "none"
    try:
        saved = json.loads(run_file.read_text())
        return "none" if "posttrain" in saved else saved["run"].get("qat", "none")
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{run_file}: cannot read the run's configuration ({e})") from e


def model_tokenizer(checkpoint: str | Path | None = None, preset: str | None = None, random_init: bool = False,
                    tokenizer: str | Path | None = None, experts: str = "dequantize"):
    """``load_model``'s checks of its arguments and its tokenizer, without the model: what a
    server process that leaves the model to its engine process checks first (quickly, in its own
    words). Raises ValueError as ``load_model`` does."""
    if checkpoint is not None and preset is not None:
        raise ValueError(f"give checkpoint or preset, not both (checkpoint={str(checkpoint)!r}, "
                         f"preset={preset!r})")
    if checkpoint is None and preset is None:
        raise ValueError("give checkpoint (a directory), or preset with random_init=True")
    if checkpoint is not None and random_init:
        raise ValueError("random_init=True applies to a preset; a checkpoint brings its weights")
    if preset is not None and not random_init:
        raise ValueError(f"preset={preset!r} has no weights: pass random_init=True for random ones")
    if experts not in EXPERTS_MODES:
        raise ValueError(f"experts={experts!r}: choose one of {list(EXPERTS_MODES)}")
    if checkpoint is not None:
        return load_tokenizer(tokenizer if tokenizer is not None else checkpoint_dir(checkpoint))
    return load_tokenizer(tokenizer) if tokenizer is not None else VisibleTokenizer()


def load_model(checkpoint: str | Path | None = None, preset: str | None = None, random_init: bool = False,
               device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
               seed: int = 0, tokenizer: str | Path | None = None, experts: str = "dequantize"):
    """(model in eval mode, tokenizer, name) from a checkpoint directory (or a training run's, see
    ``checkpoint_dir``), or from a preset with random weights (``random_init=True``) for trying
    things without weights.

    ``tokenizer``: a directory holding one, or ``"bytes"`` (``openk3.tokenizer.load_tokenizer``);
    None means the checkpoint's own (an error if it has none), or for random weights the
    ``VisibleTokenizer``, whose every id decodes to visible text.

    A training run trained with ``qat="mxfp4"`` is loaded from its MXFP4 export and runs the
    run's quantisation-aware forward (``openk3.model.moe.set_qat``: MXFP8 expert inputs), with
    ``experts="packed"`` too, so that it computes what the run computed; an HF directory runs
    the experts on the same MXFP4 weights with unquantised inputs.

    ``device`` and ``dtype`` default as in ``resolve_device`` / ``default_dtype``; ``seed`` seeds
    random weights. ``experts="packed"`` keeps the routed experts MXFP4-packed for serving
    (``load_pretrained``'s argument; random weights are quantised with ``pack_experts``). The name is the checkpoint directory's (the run's for a training run), or
    ``openk3-PRESET``. Raises ValueError unless exactly one of ``checkpoint`` / ``preset`` is
    given, and ``random_init`` is set exactly when ``preset`` is.
    """
    tok = model_tokenizer(checkpoint, preset, random_init, tokenizer, experts)  # fails before the weights load
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if checkpoint is not None:
        path = checkpoint_dir(checkpoint)
        model = load_pretrained(path, dtype=dtype, device=device, experts=experts)
        set_qat(model, run_qat(checkpoint))
        weights = path.resolve()  # a run's export/, given or found, is named for its run
        return model.eval(), tok, weights.parent.name if weights.name == "export" else weights.name
    model = build_model(model_preset(preset), device=device, dtype=dtype, seed=seed)
    if experts == "packed":
        pack_experts(model)
    return model.eval(), tok, f"openk3-{preset}"


def load_draft_model(checkpoint: str | Path, device: torch.device, dtype: torch.dtype, target=None):
    """A speculative-decoding draft (in eval mode; the draft uses the target's tokenizer):

    * ``"mtp"``: the MTP layer of ``target`` (one trained with ``--mtp-layers 1``) as an EAGLE-3
      draft (``Eagle3Draft.from_mtp``: the fusion picks h, so it is the MTP layer as trained);
    * an EAGLE-3 draft directory (``openk3 train-draft``; its ``config.json`` has ``model_type``
      ``openk3_eagle3_draft``): ``load_draft(dir, target)``, fp32 (the engine casts it);
    * any other checkpoint directory (or training run): a separate draft model, loaded as
      ``load_model`` loads one, in ``dtype``.
    """
    from openk3.checkpoint.draft import DRAFT_CONFIG_FILE, load_draft
    from openk3.model.draft import DRAFT_MODEL_TYPE, DraftConfig, Eagle3Draft

    if str(checkpoint) == "mtp":
        if target is None or not len(target.mtp):
            raise ValueError("draft='mtp' uses the target's MTP layer, but the target has none "
                             "(num_nextn_predict_layers 0; train it with --mtp-layers 1)")
        with torch.device(target.lm_head.weight.device):
            draft = Eagle3Draft(DraftConfig.for_target(target.cfg, "mtp", init="mtp"))
        draft.from_mtp(target.mtp[0])
        return draft.eval()
    path = checkpoint_dir(checkpoint)
    config = path / DRAFT_CONFIG_FILE
    if config.is_file() and json.loads(config.read_text()).get("model_type") == DRAFT_MODEL_TYPE:
        if target is None:
            raise ValueError(f"draft {str(path)!r} is an EAGLE-3 draft: loading it needs its target model")
        return load_draft(path, target)
    return load_pretrained(path, dtype=dtype, device=device).eval()
