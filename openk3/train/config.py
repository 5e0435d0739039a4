"""Training-run configuration: ``RunConfig`` (every ``openk3 train`` flag is one of its fields)
and the run presets, which share the model presets' names."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openk3.config import PRESETS, ModelConfig, _DictIO, preset
from openk3.model.moe import check_qat_dims
from openk3.ops.mx import QAT_MODES


@dataclass
class RunConfig(_DictIO):
    """One training run. Every ``openk3 train`` flag is a field of the same name.

    ``preset`` names the ModelConfig preset; ``model_overrides`` (JSON on the command line)
    changes single ModelConfig fields, e.g. ``{"num_hidden_layers": 4}``.
    """

    preset: str = "debug"
    model_overrides: dict = dataclasses.field(default_factory=dict)
    out: str = "runs/debug"
    resume: bool = False
    # data
    data: tuple[str, ...] = ()  # files, directories or JSONL; empty = the embedded stdlib corpus
    tokenizer: str | None = None  # a tokenizer.json; None trains a byte-level BPE of vocab_size
    vocab_size: int | None = None  # None: the model preset's vocab_size
    seq_len: int = 256
    # phases at other lengths before seq_len: "SEQ_LEN:STEPS" each, in order, e.g.
    # ("4096:1000", "65536:200") trains 1000 steps at 4K, 200 at 64K, then seq_len (docs/long_context.md)
    seq_len_schedule: tuple[str, ...] = ()
    batch_size: int = 8  # sequences per rank per micro-step
    grad_accum: int = 1
    # optimisation
    max_steps: int = 400
    optimizer: str = "muon"  # "muon" (per-head Muon + AdamW) or "adamw"
    lr: float = 1e-2  # shared by Muon (RMS-matched) and AdamW; best of a sweep on debug, docs/muon.md
    weight_decay: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # "cosine" or "wsd"
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0
    balance: str = "qb"  # "qb", "sign", "aux" or "none"
    ep: int = 1  # expert parallelism (MoonEP): ranks per expert group; divides the process count
    # with ep > 1: MoonEP's exact balance (replicas of the step's hot experts, every rank the same
    # number of pairs); False: plain expert parallelism, every pair to its expert's home rank
    ep_replicate: bool = True
    cp: int = 1  # context parallelism: ranks sharing each sequence; divides the process count
    aux_loss_coef: float = 1e-2
    # quantisation-aware training of the routed experts (docs/mxfp4.md): "mxfp4" trains them on
    # MXFP4 weights and MXFP8 inputs (fake-quantised, straight-through gradients to the fp32
    # masters) and exports them packed; "none" keeps them in the training dtype
    qat: str = "none"
    # multi-token prediction: MTP layers (0 or 1; the model's num_nextn_predict_layers) and the
    # weight of their loss in the training loss (DeepSeek-V3's 0.3, its value for most of pre-training)
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3
    # bookkeeping
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 4
    ckpt_interval: int = 100
    keep_last: int = 2
    seed: int = 0
    device: str = "auto"  # "auto", "cpu", "cuda"
    dtype: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU), "float32", "bfloat16"
    # torch.compile each decoder layer's attention and MLPs (docs/training.md); None: on CUDA only
    compile: bool | None = None
    # replay each training step as CUDA graphs (openk3.train.graphed: one GPU, no FSDP, EP
    # or CP); None: wherever that applies, falling back to eager steps if capture fails
    cuda_graph: bool | None = None
    activation_checkpointing: bool = False  # recompute each decoder layer in backward: less memory
    # samples printed at the end
    num_samples: int = 3
    sample_tokens: int = 80
    sample_temperature: float = 0.8

    def __post_init__(self) -> None:
        self.data = tuple(self.data)
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"RunConfig.{name}={getattr(self, name)!r}: {why}")

        if self.preset not in PRESETS:
            raise bad("preset", f"choose one of {sorted(PRESETS)}")
        for name in ("seq_len", "batch_size", "grad_accum", "max_steps", "log_interval", "ep", "cp",
                     "eval_interval", "eval_batches", "ckpt_interval", "keep_last"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be positive")
        for name in ("warmup_steps", "num_samples", "sample_tokens"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if self.warmup_steps >= self.max_steps:
            raise bad("warmup_steps", f"must be below max_steps={self.max_steps}")
        if self.vocab_size is not None and self.vocab_size < 260:
            raise bad("vocab_size", "must be at least 260 (256 bytes + special tokens)")
        if not 0 < self.lr < math.inf:
            raise bad("lr", "must be positive and finite")
        if self.mtp_layers not in (0, 1):
            raise bad("mtp_layers", "must be 0 or 1 (the model's num_nextn_predict_layers: "
                      "openk3 builds at most one multi-token-prediction layer)")
        for name in ("weight_decay", "clip_grad", "mtp_loss_weight", "aux_loss_coef"):
            if not 0 <= getattr(self, name) < math.inf:  # NaN fails too
                raise bad(name, "must be >= 0 and finite")
        if not 0 <= self.sample_temperature <= 100:  # checked here, not after the run by the sampler
            raise bad("sample_temperature", "must be in [0, 100]")
        if not 0 <= self.min_lr_ratio <= 1:
            raise bad("min_lr_ratio", "must be in [0, 1]")
        choices = {"optimizer": ("muon", "adamw"), "schedule": ("cosine", "wsd"),
                   "balance": ("qb", "sign", "aux", "none"), "device": ("auto", "cpu", "cuda"),
                   "dtype": ("auto", "float32", "bfloat16"), "qat": QAT_MODES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise bad(name, f"choose one of {allowed}")
        for length in self.seq_lens():
            if length % self.cp:
                raise bad("cp", f"must divide every sequence length (seq_len and "
                          f"seq_len_schedule), not {length}: ranks hold equal shards")
        if self.cp > 1 and self.mtp_layers:
            raise bad("cp", "context parallelism needs mtp_layers=0 (MTP inputs shift across "
                      "the ranks' boundaries)")
        model_cfg = self.model_config()  # model overrides are validated by ModelConfig itself
        if self.qat != "none":
            try:
                check_qat_dims(model_cfg)
            except ValueError as e:
                raise bad("qat", str(e)) from None

    def _phases(self) -> list[tuple[int, int]]:
        """``seq_len_schedule`` as (seq_len, steps) pairs; raises ValueError on a bad entry."""
        phases = []
        for entry in self.seq_len_schedule:
            try:
                length, steps = (int(x) for x in str(entry).split(":"))
            except ValueError:
                length = steps = 0
            if length <= 0 or steps <= 0:
                raise ValueError(f"RunConfig.seq_len_schedule={self.seq_len_schedule!r}: entry "
                                 f"{entry!r} is not SEQ_LEN:STEPS with both positive, e.g. 4096:1000")
            phases.append((length, steps))
        return phases

    def seq_lens(self) -> list[int]:
        """Every sequence length the run trains at: the schedule's, then seq_len."""
        return [length for length, _ in self._phases()] + [self.seq_len]

    def seq_len_at(self, step: int) -> int:
        """The sequence length of (1-based) training step ``step``."""
        done = 0
        for length, steps in self._phases():
            done += steps
            if step <= done:
                return length
        return self.seq_len

    def model_config(self) -> ModelConfig:
        cfg = preset(self.preset)
        changes = dict(self.model_overrides)
        if self.vocab_size is not None:
            changes["vocab_size"] = self.vocab_size
        if changes.get("num_nextn_predict_layers", self.mtp_layers) != self.mtp_layers:
            raise ValueError(f"RunConfig.model_overrides sets num_nextn_predict_layers="
                             f"{changes['num_nextn_predict_layers']!r} but RunConfig.mtp_layers="
                             f"{self.mtp_layers}: set the MTP layers with mtp_layers (--mtp-layers)")
        changes["num_nextn_predict_layers"] = self.mtp_layers
        try:
            return cfg.replace(**changes)
        except TypeError as e:
            raise ValueError(f"RunConfig.model_overrides={self.model_overrides!r}: {e}") from e


RUN_PRESETS = {
    # the README's main job: CPU, a few minutes, loss clearly falling
    "debug": dict(),
    # CPU, minutes: tower + language model from scratch on rendered images (openk3/vision)
    "debug-vl": dict(preset="debug-vl", out="runs/debug-vl", batch_size=32, max_steps=600, lr=3e-3,
                     warmup_steps=30, log_interval=20, eval_interval=200),
    # one GPU, bf16
    "small": dict(preset="small", out="runs/small", seq_len=4096, batch_size=4, max_steps=2000,
                  lr=2e-3, warmup_steps=100, log_interval=20, eval_interval=250, ckpt_interval=500,
                  num_samples=2, sample_tokens=128),
    # one node, FSDP2 over several GPUs (torchrun), bf16
    "medium": dict(preset="medium", out="runs/medium", seq_len=4096, batch_size=2, max_steps=5000,
                   lr=1.5e-3, warmup_steps=200, log_interval=20, eval_interval=500, ckpt_interval=1000,
                   num_samples=2, sample_tokens=128),
}


def run_preset(name: str, **overrides: Any) -> RunConfig:
    """The run defaults for model preset ``name`` (run presets share the model presets' names)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    base = RUN_PRESETS.get(name, dict(preset=name, out=f"runs/{name}"))
    return RunConfig(**{**base, **overrides})


RUN_CONFIG_FILE = "run_config.json"  # in the run directory: {"run": RunConfig, "model": ...}

# Fields that may differ from the saved run when resuming: how long it runs, how often it logs,
# evaluates and saves, what it prints at the end, and where and how it runs. ``batch_size`` is
# per rank: resuming on another number of processes changes it, and the data stream refuses any
# change of the global batch (world size / cp x batch_size). ``qat`` may be switched on for the
# rest of a run: a bf16 run continued with --qat mxfp4 is quantisation-aware fine-tuning, as K3
# trains its experts after bf16 pre-training. Every other field defines the run itself (model,
# data, optimiser, schedule shape, seed) and must match.
RESUMABLE_FIELDS = ("resume", "out", "max_steps", "log_interval", "eval_interval", "eval_batches",
                    "ckpt_interval", "keep_last", "num_samples", "sample_tokens",
                    "sample_temperature", "device", "batch_size", "compile", "cuda_graph",
                    "activation_checkpointing", "cp", "qat", "ep_replicate")


def _same(a: Any, b: Any) -> bool:
    """Equality across a JSON round trip (tuples come back as lists)."""
    norm = (lambda v: list(v) if isinstance(v, tuple) else v)
    return norm(a) == norm(b)


def resolve_run_config(given: dict[str, Any]) -> tuple[RunConfig, list[str]]:
    """The ``RunConfig`` of ``openk3 train``: ``given`` holds only the flags the user set.

    A new run starts from the run preset of ``given["preset"]`` (default ``debug``). If the
    preset's warm-up is not below an explicitly given ``max_steps``, the warm-up is clamped to a
    tenth of the run (a notice says so); an explicit ``warmup_steps`` that does not fit stays an
    error. With ``resume`` and a ``RUN_DIR/run_config.json`` (``RUN_DIR``: ``out``, or the
    preset's), every saved field is kept; a given flag outside ``RESUMABLE_FIELDS`` that differs
    from the saved value is an error naming both values. Returns the config and the notices to
    print.
    """
    name = given.get("preset", "debug")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    fields = {**RUN_PRESETS.get(name, dict(preset=name, out=f"runs/{name}")), **given}
    saved_file = Path(fields.get("out", RunConfig.out)) / RUN_CONFIG_FILE
    if given.get("resume") and saved_file.exists():
        try:
            saved = json.loads(saved_file.read_text())["run"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{saved_file}: cannot read the saved run ({e})") from e
        if saved.get("vocab_size") is None:  # the preset's then: a flag naming that same size agrees
            saved = {**saved, "vocab_size": RunConfig.from_dict(saved).model_config().vocab_size}
        conflicts = [f"--{k.replace('_', '-')} {v!r} (the run has {saved.get(k)!r})"
                     for k, v in given.items() if k not in RESUMABLE_FIELDS and not _same(v, saved.get(k))]
        if conflicts:
            raise ValueError(f"--resume: {'; '.join(conflicts)} conflict with the run saved in "
                             f"{saved_file}. Only "
                             f"{', '.join('--' + f.replace('_', '-') for f in RESUMABLE_FIELDS[2:])} "
                             "may change on resume; start a new run (another --out) to change the rest")
        return RunConfig.from_dict({**saved, **given, "resume": True}), []
    notices: list[str] = []
    warmup = fields.get("warmup_steps", RunConfig.warmup_steps)
    max_steps = fields.get("max_steps", RunConfig.max_steps)
    if "warmup_steps" not in given and isinstance(max_steps, int) and 0 < max_steps <= warmup:
        fields["warmup_steps"] = max_steps // 10
        notices.append(f"warm-up clamped to {fields['warmup_steps']} steps (the preset's {warmup} "
                       f"is not below --max-steps {max_steps}); set --warmup-steps to choose")
    return RunConfig(**fields), notices
