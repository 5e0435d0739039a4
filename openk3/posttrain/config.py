"""``PostTrainConfig``: every setting of ``openk3 rl`` and ``openk3 distill`` and its default, in
one place (each flag is a field of the same name); ``EvalConfig`` the same for ``openk3 eval``.
Design and the formulas: docs/posttraining.md."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openk3.config import _DictIO
from openk3.posttrain.tasks import parse_task

EFFORTS = ("low", "medium", "high")  # K3's three effort levels
EFFORT_CHOICES = ("none", *EFFORTS, "mixed")
LOSSES = ("grpo", "k15")
POSTTRAIN_CONFIG_FILE = "run_config.json"  # {"posttrain": PostTrainConfig, "model": ModelConfig}
# What `openk3 distill` changes from `openk3 rl`'s defaults: the teachers' per-token reward
# alone drives the update (the task still supplies prompts and the accuracy metric).
DISTILL_DEFAULTS = {"out": "runs/distill", "reward_weight": 0.0}


def effort_prefix(effort: str) -> str:
    """The prompt-side control text of an effort level: ``"<low>"`` etc., nothing for ``none``."""
    return "" if effort == "none" else f"<{effort}>"


@dataclass
class PostTrainConfig(_DictIO):
    """One RL / distillation run. The task reward, the length penalty and MOPD's per-token
    reward combine as docs/posttraining.md ("Objective") writes them.

    Policy and data:
        checkpoint: the initial policy, a training run or an HF checkpoint directory (required).
        task: one or more task specs, ``NAME`` or ``NAME:key=value:...`` (``tasks.parse_task``:
            ``arithmetic:digits=2``); each new prompt group draws its task in turn.
        task_options: keyword arguments for every task (JSON on the command line); a spec's own
            ``key=value`` wins.
        teacher: MOPD teachers, ``DOMAIN:EFFORT=PATH`` each; EFFORT ``*`` serves every effort.
    Rollouts (from the serving engine, temperature 1, no top-p / top-k):
        prompts_per_step: complete prompt groups per training step (the batch); the engine
            keeps up to ``prompts_per_step x group_size`` trajectories in flight.
        group_size: G samples per prompt (the group of the baseline and the length penalty).
        max_new_tokens: completion budget; a completion also ends at its first newline or eos.
        partial_rollouts: keep the engine's batch full: generation goes in rounds, and a step
            ends as soon as ``prompts_per_step`` groups are complete; the unfinished trajectories
            are resumed first in the next step (off: each step's groups run to the end).
        finish_fraction: lambda, the fraction of a round's trajectories whose finishing ends the
            round; the freed slots then take new groups (``openk3/posttrain/partial.py``).
        max_model_len: the engine's context (prompt + completion).
        score_workers: sandbox runs at once when a step's code completions are scored (all of
            the step's at once: each run is mostly a Python start-up, ~35 ms of one core).
    Effort (prompt-side control text ``<low>``, ``<medium>``, ``<high>``):
        effort: "none" (no control text), one level, or "mixed" (each group draws one).
        length_penalty, length_penalty_low/_medium/_high: weight of Kimi k1.5's length reward
            for effort none / low / medium / high (0: off).
    Objective:
        loss: "grpo" (group-relative advantage, clipped ratio) or "k15" (Kimi k1.5's squared loss).
        std_normalize: GRPO divides the advantage by the group's reward std.
        clip_eps: GRPO's ratio clip, [1 - eps, 1 + eps].
        tau: k1.5's regularisation strength.
        kl_coef: weight of the k3 KL estimate to the initial policy (0: no reference model).
        reward_weight: weight of the task reward (plus length reward) in the advantage.
        mopd_weight: weight of MOPD's per-token reward (with teachers).
        mopd_clip: R, MOPD's reward clip [-R, R].
    Optimisation (per-head Muon + AdamW as in pre-training, constant learning rate):
        max_steps, optimizer, lr, weight_decay, clip_grad (0: none), micro_batch_size
        (sequences per forward pass; gradients accumulate over a step's groups).
    Bookkeeping: log_interval, ckpt_interval, keep_last (checkpoints kept), seed, device,
        dtype (the rollout engine's and teachers'; the trainer keeps fp32 master weights).
    """

    checkpoint: str = ""
    out: str = "runs/rl"
    resume: bool = False
    task: tuple[str, ...] = ("arithmetic",)
    task_options: dict = dataclasses.field(default_factory=dict)
    teacher: tuple[str, ...] = ()
    # rollouts
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 32
    partial_rollouts: bool = True
    finish_fraction: float = 0.75
    max_model_len: int = 512
    score_workers: int = 16
    # effort
    effort: str = "none"
    length_penalty: float = 0.0
    length_penalty_low: float = 0.5
    length_penalty_medium: float = 0.2
    length_penalty_high: float = 0.0
    # objective
    loss: str = "grpo"
    std_normalize: bool = True
    clip_eps: float = 0.2
    tau: float = 0.1
    kl_coef: float = 0.0
    reward_weight: float = 1.0
    mopd_weight: float = 1.0
    mopd_clip: float = 5.0
    # optimisation
    max_steps: int = 100
    optimizer: str = "muon"
    lr: float = 3e-5
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    micro_batch_size: int = 64
    # bookkeeping
    log_interval: int = 1
    ckpt_interval: int = 20
    keep_last: int = 2
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        self.task, self.teacher = tuple(self.task), tuple(self.teacher)

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: {why}")

        if not self.checkpoint:
            raise bad("checkpoint", "required: the initial policy (a training run or checkpoint directory)")
        if not self.task:
            raise bad("task", "name at least one task")
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "max_model_len", "max_steps",
                     "micro_batch_size", "log_interval", "ckpt_interval", "keep_last", "score_workers"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be positive")
        if self.group_size < 2:
            raise bad("group_size", "must be at least 2 (the baseline is the group's mean reward)")
        if not 0 < self.finish_fraction <= 1:
            raise bad("finish_fraction", "must be in (0, 1]")
        if self.max_new_tokens >= self.max_model_len:
            raise bad("max_new_tokens", f"must leave room for the prompt in --max-model-len {self.max_model_len}")
        for name in ("length_penalty", "length_penalty_low", "length_penalty_medium", "length_penalty_high",
                     "clip_eps", "tau", "kl_coef", "reward_weight", "mopd_weight", "weight_decay",
                     "clip_grad"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if not self.mopd_clip > 0:
            raise bad("mopd_clip", "must be positive")
        if not self.lr > 0:
            raise bad("lr", "must be positive")
        choices = {"effort": EFFORT_CHOICES, "loss": LOSSES, "optimizer": ("muon", "adamw"),
                   "device": ("auto", "cpu", "cuda"), "dtype": ("auto", "float32", "bfloat16")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise bad(name, f"choose one of {allowed}")
        given: dict[tuple[str, str], str] = {}
        for spec in self.teacher:
            domain, effort, _ = parse_teacher(spec)
            if (domain, effort) in given:
                raise ValueError(f"--teacher {spec!r}: a teacher for {domain}:{effort} is already given "
                                 f"({given[domain, effort]!r})")
            given[domain, effort] = spec
        if self.teacher and self.loss != "grpo":
            raise bad("loss", "MOPD's per-token reward needs the per-token policy-gradient loss: --loss grpo")
        if not self.teacher and self.reward_weight == 0:
            raise bad("reward_weight", "is 0 and there is no --teacher: nothing to learn from")

    @property
    def capacity(self) -> int:
        """Trajectories a round keeps in flight (and the engine's ``max_num_seqs``)."""
        return self.prompts_per_step * self.group_size

    def length_penalty_weight(self, effort: str) -> float:
        return {"none": self.length_penalty, "low": self.length_penalty_low,
                "medium": self.length_penalty_medium, "high": self.length_penalty_high}[effort]


def check_teacher_coverage(cfg: PostTrainConfig, domains: list[tuple[str, str]]) -> None:
    """With ``--teacher``: a teacher for every (task name, domain) of ``domains`` at every
    effort the run can draw (``--effort mixed``: each level), checked before any model loads;
    the run would otherwise stop at the first group that draws an uncovered one."""
    if not cfg.teacher:
        return
    given = {parse_teacher(spec)[:2] for spec in cfg.teacher}
    for spec, domain in domains:
        for effort in EFFORTS if cfg.effort == "mixed" else (cfg.effort,):
            if (domain, effort) not in given and (domain, "*") not in given:
                raise ValueError(f"--teacher {cfg.teacher!r}: no teacher for --task {spec!r} (domain {domain!r}) "
                                 f"at effort {effort!r}: add {domain}:{effort}=PATH or {domain}:*=PATH")


def parse_teacher(spec: str) -> tuple[str, str, str]:
    """``"DOMAIN:EFFORT=PATH"`` -> (domain, effort, path); EFFORT is a level, ``none`` or ``*``."""
    key, sep, path = spec.partition("=")
    domain, colon, effort = key.partition(":")
    if not (sep and colon and domain and path):
        raise ValueError(f"--teacher {spec!r}: expected DOMAIN:EFFORT=PATH, e.g. math:high=runs/math-teacher")
    if effort not in (*EFFORTS, "none", "*"):
        raise ValueError(f"--teacher {spec!r}: effort {effort!r}; choose one of {(*EFFORTS, 'none', '*')}")
    return domain, effort, path


# Fields that may change when resuming: how long the run goes, how often it logs and saves, where
# it runs. Everything else defines the run and must match the saved one.
RESUMABLE_FIELDS = ("resume", "out", "max_steps", "log_interval", "ckpt_interval", "keep_last", "device")


def resolve_posttrain_config(given: dict[str, Any], defaults: dict[str, Any] | None = None) -> PostTrainConfig:
    """The config of ``openk3 rl`` / ``openk3 distill`` (``defaults``: ``DISTILL_DEFAULTS``) from
    the flags given. With ``resume`` and a saved ``OUT/run_config.json`` the saved fields are
    kept; a given flag outside ``RESUMABLE_FIELDS`` that differs is an error naming both values."""
    fields = {**(defaults or {}), **given}
    saved_file = Path(fields.get("out", PostTrainConfig.out)) / POSTTRAIN_CONFIG_FILE
    if not (given.get("resume") and saved_file.exists()):
        return PostTrainConfig(**fields)
    try:
        saved = json.loads(saved_file.read_text())["posttrain"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{saved_file}: cannot read the saved post-training run ({e})") from e
    norm = (lambda v: list(v) if isinstance(v, tuple) else v)
    conflicts = [f"--{k.replace('_', '-')} {v!r} (the run has {saved.get(k)!r})"
                 for k, v in given.items() if k not in RESUMABLE_FIELDS and norm(v) != saved.get(k)]
    if conflicts:
        raise ValueError(f"--resume: {'; '.join(conflicts)} conflict with the run saved in {saved_file}; "
                         f"only {', '.join('--' + f.replace('_', '-') for f in RESUMABLE_FIELDS[2:])} may change")
    return PostTrainConfig.from_dict({**saved, **given, "resume": True})


@dataclass
class EvalConfig(_DictIO):
    """One task-accuracy evaluation (``openk3 eval``, ``openk3.posttrain.evaluate``).

        checkpoint: the model, a training / RL run or an HF checkpoint directory, as
            ``PostTrainConfig.checkpoint`` (required).
        task: task specs, ``NAME`` or ``NAME:key=value:...`` (``tasks.parse_task``); each is
            evaluated on its own problems.
        task_options: keyword arguments for every task (JSON on the command line), as ``rl``'s;
            a spec's own ``key=value`` wins.
        num_problems: problems per task, drawn from the held-out stream
            ``random.Random(f"openk3-eval/{NAME}/{seed}")``, which no training stream uses (those
            are seeded with integers).
        seed: picks the held-out problems (and, at temperature > 0, the sampling noise).
        temperature: 0 is greedy; above 0 samples (no top-p / top-k).
        max_new_tokens: completion budget; a completion also ends at the problem's stop strings.
        effort: "none" or a level whose control text precedes each prompt, as in ``rl``.
        batch_size: sequences the serving engine runs at once.
        score_workers: sandbox runs at once for the code task.
        out: a JSON file for the results (empty: none).
        device, dtype: where and in what the engine runs ("auto": CUDA + bf16 when available).
    """

    checkpoint: str = ""
    task: tuple[str, ...] = ("arithmetic",)
    task_options: dict = dataclasses.field(default_factory=dict)
    num_problems: int = 200
    seed: int = 0
    temperature: float = 0.0
    max_new_tokens: int = 32
    effort: str = "none"
    batch_size: int = 64
    score_workers: int = 16
    out: str = ""
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        self.task = tuple(self.task)

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: {why}")

        if not self.checkpoint:
            raise bad("checkpoint", "required: the model to evaluate (a run or checkpoint directory)")
        if not self.task:
            raise bad("task", "name at least one task")
        if len(set(self.task)) != len(self.task):
            raise bad("task", "a task is named twice")
        for spec in self.task:
            try:
                parse_task(spec, self.task_options)
            except ValueError as e:
                raise ValueError(f"--task {spec!r}: {e}") from None
        for name in ("num_problems", "max_new_tokens", "batch_size", "score_workers"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be positive")
        if not 0 <= self.temperature <= 100:
            raise bad("temperature", "must be in [0, 100] (0: greedy)")
        choices = {"effort": ("none", *EFFORTS), "device": ("auto", "cpu", "cuda"),
                   "dtype": ("auto", "float32", "bfloat16")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise bad(name, f"choose one of {allowed}")


