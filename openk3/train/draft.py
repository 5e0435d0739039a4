"""``openk3 train-draft``: train an EAGLE-3 draft (``openk3/model/draft.py``) against a frozen target.

Per step, on a batch of token windows [B, T] (``TokenStream``, the target's tokenizer):

    h, bank  = target.model.hidden_and_blocks(x)          no grad; the target is frozen
    p_t      = softmax(lm_head(h_t))                        the target's distribution of x_{t+1}
    g^0, ..., g^{S-1} = draft_unroll(draft, fc(bank[lo], bank[mid], h), x)
    loss     = sum_i ttt_decay^i  L(p_{t+i+1}, softmax(lm_head(g^i_t)))   over t <= T - 2 - i

with L the chosen loss (``--loss``: ``lk`` = ``lk_alpha_loss``, ``kl`` = ``kl_loss``, ``lk-lambda``
= ``lk_lambda_loss``, ``openk3/train/draft_loss.py``). Only the draft's parameters are optimised
(AdamW); the target, its embedding and head have ``requires_grad=False``. The acceptance
``alpha_i = mean sum_x min(p, q)`` of every depth i is logged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from openk3.checkpoint.draft import save_draft
from openk3.config import _DictIO
from openk3.model.draft import INITS, LOSSES, DraftConfig, Eagle3Draft, draft_unroll
from openk3.runtime import checkpoint_dir, load_model, resolve_device, resolve_dtype
from openk3.train.data import prepare_data
from openk3.train.draft_loss import acceptance_rate, kl_loss, lk_alpha_loss, lk_lambda_loss
from openk3.train.optim import lr_multiplier
from openk3.train.stream import TokenStream
from openk3.train.trainer import StopFlag, TrainingDiverged

DRAFT_METRICS_FILE = "metrics.jsonl"


@dataclass
class DraftRunConfig(_DictIO):
    """One draft-training run. Every ``openk3 train-draft`` flag is a field of the same name."""

    checkpoint: str = ""          # the target: an HF checkpoint directory or a training run
    out: str = "runs/draft"       # the draft directory written (must not exist yet)
    loss: str = "lk"              # "lk" (-log alpha), "kl" or "lk-lambda"
    eta: float = 3.0              # lk-lambda's decay rate: lambda = exp(-eta * mean alpha)
    init: str = "random"          # "random" or "mtp" (the target's MTP layer: --mtp-layers 1)
    data: tuple[str, ...] = ()    # files, directories or JSONL; empty = the embedded stdlib corpus
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 400
    ttt_steps: int = 3            # S: draft steps unrolled on the draft's own states
    ttt_decay: float = 0.8        # the loss of step i is weighted ttt_decay ** i (EAGLE-3)
    lr: float = 1e-3              # AdamW
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1     # cosine decay to lr * min_lr_ratio
    clip_grad: float = 1.0        # 0: no clipping
    log_interval: int = 10
    save_interval: int = 200      # also saved at the last step
    seed: int = 0
    device: str = "auto"          # "auto", "cpu", "cuda"
    dtype: str = "auto"           # the target's: "auto" (bf16 on CUDA, fp32 on CPU), "float32", "bfloat16"

    def __post_init__(self) -> None:
        self.data = tuple(self.data)

        def bad(name: str, why: str) -> ValueError:
            flag = "--" + name.replace("_", "-")
            return ValueError(f"{flag} {getattr(self, name)!r}: {why}")

        if not self.checkpoint:
            raise bad("checkpoint", "required: the target's checkpoint directory or training run")
        if self.loss not in LOSSES:
            raise bad("loss", f"choose one of {LOSSES}")
        if self.init not in INITS:
            raise bad("init", f"choose one of {INITS}")
        for name in ("seq_len", "batch_size", "steps", "ttt_steps", "log_interval", "save_interval"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be positive")
        if self.seq_len <= self.ttt_steps:
            raise bad("seq_len", f"must exceed --ttt-steps {self.ttt_steps} (step i counts T - 1 - i positions)")
        for name in ("warmup_steps", "weight_decay", "clip_grad", "eta"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if not 0 < self.ttt_decay <= 1:
            raise bad("ttt_decay", "must be in (0, 1]")
        if not self.lr > 0:
            raise bad("lr", "must be positive")
        if not 0 <= self.min_lr_ratio <= 1:
            raise bad("min_lr_ratio", "must be in [0, 1]")
        for name, allowed in (("device", ("auto", "cpu", "cuda")), ("dtype", ("auto", "float32", "bfloat16"))):
            if getattr(self, name) not in allowed:
                raise bad(name, f"choose one of {allowed}")


def draft_loss(name: str, eta: float = 3.0):
    """The loss function ``(target_logits [N, V], draft_logits [N, V]) -> scalar`` of ``--loss``."""
    return {"lk": lk_alpha_loss, "kl": kl_loss,
            "lk-lambda": lambda p, q: lk_lambda_loss(p, q, eta=eta)}[name]


def ttt_losses(target, draft: Eagle3Draft, input_ids: torch.Tensor, steps: int, loss_fn, decay: float,
               ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(the loss to differentiate, sum_i decay^i loss_i; the losses loss_i; the acceptances
    alpha_i) of ``steps`` unrolled draft steps over [B, T] ``input_ids``. Step i counts the
    positions ``t <= T - 2 - i``: the draft's logits at t against the target's at t + i + 1. The
    target runs under no_grad; gradients reach the draft only."""
    with torch.no_grad():
        hidden, bank = target.model.hidden_and_blocks(input_ids)
        target_logits = target.lm_head(hidden)  # [B, T, V]
    outs = draft_unroll(draft, draft.fuse(hidden, bank), target.model.embed_tokens, input_ids, steps)
    T = input_ids.shape[1]
    losses, alphas = [], []
    for i, g in enumerate(outs):
        q = target.lm_head(g[:, :T - 1 - i].to(target.lm_head.weight.dtype)).flatten(0, 1)
        p = target_logits[:, i + 1:].flatten(0, 1)
        losses.append(loss_fn(p, q))
        alphas.append(acceptance_rate(p, q))
    return sum(decay ** i * loss for i, loss in enumerate(losses)), losses, alphas


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load_target(cfg: DraftRunConfig, device: torch.device, dtype: torch.dtype):
    path = Path(cfg.checkpoint)
    if not path.is_dir():
        raise ValueError(f"--checkpoint {cfg.checkpoint!r}: no such directory")
    target, _, _ = load_model(path, device=device, dtype=dtype)
    target.requires_grad_(False)  # frozen: no gradients, no optimiser state
    return target, checkpoint_dir(path)


def build_draft(cfg: DraftRunConfig, target, target_path: str) -> Eagle3Draft:
    """A fresh draft for ``target`` (fp32, on the target's device), ``--init`` applied."""
    dcfg = DraftConfig.for_target(target.cfg, target_path, loss=cfg.loss, init=cfg.init,
                                  ttt_steps=cfg.ttt_steps, ttt_decay=cfg.ttt_decay)
    with torch.device(target.lm_head.weight.device):
        draft = Eagle3Draft(dcfg)
    draft.init_weights(cfg.seed)
    if cfg.init == "mtp":
        if not len(target.mtp):
            raise ValueError(f"--init mtp: the target {target_path!r} has no MTP layer "
                             "(num_nextn_predict_layers 0); train it with --mtp-layers 1, or use --init random")
        draft.from_mtp(target.mtp[0])
    return draft


def train_draft(cfg: DraftRunConfig) -> dict:
    """Train a draft for ``cfg.checkpoint`` and write it to ``cfg.out``; returns a summary dict
    (``losses`` and ``alphas``: per step, per unrolled depth)."""
    out = Path(cfg.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {cfg.out!r} already exists; choose another directory")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    target, target_dir = _load_target(cfg, device, dtype)
    tokenizer = target_dir / "tokenizer.json"
    if not tokenizer.is_file():
        raise ValueError(f"--checkpoint {cfg.checkpoint!r}: no tokenizer.json in {target_dir} "
                         "(the training data is tokenised with the target's tokenizer)")
    data = prepare_data(list(cfg.data) or None, tokenizer_path=tokenizer, log=_log)
    if data.vocab_size > target.cfg.vocab_size:
        raise ValueError(f"{tokenizer}: {data.vocab_size} tokens, more than the target's vocab_size "
                         f"{target.cfg.vocab_size}")
    draft = build_draft(cfg, target, str(target_dir))
    draft.train()
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    stream = TokenStream(data.train_path, data.dtype, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    loss_fn = draft_loss(cfg.loss, cfg.eta)
    use_amp = device.type == "cuda" and dtype != torch.float32
    autocast = (lambda: torch.autocast("cuda", dtype=dtype)) if use_amp else nullcontext
    n_params = sum(p.numel() for p in draft.parameters())
    _log(f"openk3 train-draft: target {target_dir} ({target.cfg.num_hidden_layers} layers, d "
         f"{target.cfg.hidden_size}), draft {n_params:,} parameters, fused blocks "
         f"{draft.cfg.fused_blocks} + last, init {cfg.init}, loss {cfg.loss}, TTT {cfg.ttt_steps} steps")
    rows: list[dict] = []
    losses, alphas = [], []
    warmup = min(cfg.warmup_steps, cfg.steps - 1)
    t_last, step_last = time.perf_counter(), 0
    tokens_per_step = cfg.batch_size * cfg.seq_len

    def save(step: int) -> None:
        draft.cfg = dataclasses.replace(draft.cfg, train_steps=step)
        save_draft(draft, out, {DRAFT_METRICS_FILE: "".join(json.dumps(r) + "\n" for r in rows).encode()})

    with StopFlag("openk3 train-draft") as flag:
        for step in range(1, cfg.steps + 1):
            lr = cfg.lr * lr_multiplier(step - 1, cfg.steps, warmup, "cosine", cfg.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr
            inputs, _ = stream.next_batch()
            with autocast():
                loss, step_losses, step_alphas = ttt_losses(target, draft, inputs.to(device), cfg.ttt_steps,
                                                            loss_fn, cfg.ttt_decay)
            loss_f = loss.item()
            if not math.isfinite(loss_f):
                raise TrainingDiverged(f"non-finite draft loss {loss_f} at step {step}; lower --lr")
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.clip_grad if cfg.clip_grad > 0 else 1e30)
            if not math.isfinite(float(grad_norm)):  # the update would put it into the weights
                raise TrainingDiverged(f"non-finite gradient norm {float(grad_norm)} at step {step} "
                                       "(loss finite); stopping before the update; lower --lr")
            opt.step()
            opt.zero_grad(set_to_none=True)
            per_step = [l.item() for l in step_losses]
            alpha = [a.item() for a in step_alphas]
            losses.append(per_step)
            alphas.append(alpha)
            if step % cfg.log_interval == 0 or step == cfg.steps:
                now = time.perf_counter()
                tok_s = tokens_per_step * (step - step_last) / max(now - t_last, 1e-9)
                t_last, step_last = now, step
                row = {"step": step, "loss": loss_f, "loss_per_depth": per_step, "alpha": alpha,
                       "lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": tok_s}
                rows.append(row)
                _log(f"step {step:>6}  loss {loss_f:.4f}  lr {lr:.2e}  gnorm {float(grad_norm):.2f}  "
                     f"{tok_s:,.0f} tok/s  alpha " + " ".join(f"{a:.3f}" for a in alpha))
            if flag.stop or step % cfg.save_interval == 0 or step == cfg.steps:
                save(step)
            if flag.stop:  # Ctrl-C: the draft of this step is saved, stop
                _log(f"openk3 train-draft: stopped after step {step}; draft in {out}")
                break
    return {"losses": losses, "alphas": alphas, "out": str(out)}
