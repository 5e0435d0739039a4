"""Multi-teacher on-policy distillation (MOPD, K3): teachers keyed by (domain, effort) score the
student's own samples token by token.

    r_t = clip(stopgrad(log pi_T(y_t | x, y_<t) - log pi_S(y_t | effort, x, y_<t)), -R, R)

The teacher is the one registered for the sample's (domain, effort) (``*`` serves every effort).
It reads the prompt *without* the effort control text: a teacher is a specialist trained for
its domain and effort, and the control text is the student's way of being told which one to
imitate. ``log pi_S`` is the log-probability recorded at sampling, from the same forward as the
rollout (docs/posttraining.md, "MOPD"). Teachers and student share one tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from openk3.posttrain.config import parse_teacher
from openk3.posttrain.objective import completion_logprobs
from openk3.runtime import checkpoint_dir, load_model


def mopd_rewards(teacher_logp: torch.Tensor, student_logp: torch.Tensor, clip: float) -> torch.Tensor:
    """Per-token rewards [B, L] from log-probabilities [B, L] (no gradient flows back)."""
    return (teacher_logp.detach() - student_logp.detach()).clamp(-clip, clip)


class Teachers:
    """The teacher models (frozen, eval mode, on ``device`` in ``dtype``) of ``--teacher``
    specs ``DOMAIN:EFFORT=PATH``. ``student_dir``: the student's checkpoint directory, whose
    tokenizer every teacher must share."""

    def __init__(self, specs: tuple[str, ...], device: torch.device, dtype: torch.dtype,
                 student_vocab: int, student_dir: Path | None = None):
        self.models: dict[tuple[str, str], torch.nn.Module] = {}
        self.paths: dict[tuple[str, str], str] = {}
        loaded: dict[str, torch.nn.Module] = {}
        for spec in specs:
            domain, effort, path = parse_teacher(spec)
            if (domain, effort) in self.models:
                raise ValueError(f"--teacher {spec!r}: a teacher for {domain}:{effort} is already given")
            if path not in loaded:
                try:
                    _check_tokenizer(spec, checkpoint_dir(path), student_dir)
                    model, _, _ = load_model(path, device=device, dtype=dtype)
                except ValueError as e:  # name the teacher (a missing path said only "no tokenizer")
                    raise e if str(e).startswith("--teacher") else ValueError(f"--teacher {spec!r}: {e}") from e
                if model.cfg.vocab_size != student_vocab:
                    raise ValueError(f"--teacher {spec!r}: vocab_size {model.cfg.vocab_size}, the student's "
                                     f"is {student_vocab}; teachers must share the student's tokenizer")
                loaded[path] = model.requires_grad_(False)
            self.models[domain, effort] = loaded[path]
            self.paths[domain, effort] = path

    def __bool__(self) -> bool:
        return bool(self.models)

    def pick(self, domain: str, effort: str) -> tuple[str, str]:
        """The key of the teacher for a sample of ``domain`` at ``effort``."""
        for key in ((domain, effort), (domain, "*")):
            if key in self.models:
                return key
        raise ValueError(f"MOPD: no teacher for domain {domain!r} at effort {effort!r}; given: "
                         f"{', '.join(f'{d}:{e}' for d, e in self.models)} (add --teacher {domain}:{effort}=PATH "
                         f"or {domain}:*=PATH)")

    @torch.no_grad()
    def logprobs(self, key: tuple[str, str], prompts: list[list[int]], completions: list[list[int]],
                 length: int) -> torch.Tensor:
        """The teacher's log-probabilities of the completions [len(prompts), length]."""
        logp, _ = completion_logprobs(self.models[key], prompts, completions)
        return torch.nn.functional.pad(logp.float(), (0, length - logp.shape[1]))


def _check_tokenizer(spec: str, teacher_dir: Path, student_dir: Path | None) -> None:
    if student_dir is None:
        return
    for name in ("tokenizer.json", "tiktoken.model"):
        a, b = teacher_dir / name, student_dir / name
        if a.exists() and b.exists() and a.read_bytes() != b.read_bytes():
            raise ValueError(f"--teacher {spec!r}: {a} differs from the student's {b}; MOPD compares "
                             "log-probabilities token by token, so teacher and student share one tokenizer")
