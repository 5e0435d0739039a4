"""``openk3 train --preset debug-vl``: the tower, projector and language model trained together
from scratch by next-token prediction on the synthetic image-text corpus (``synthetic.py``).

The optimisation step is the text trainer's (``openk3.train.trainer.train_step``: per-head Muon
for the matrices, AdamW for the rest, the same schedule); what differs is the data (fresh
rendered examples every step, never repeated) and the evaluation (answer accuracy per task on
held-out images, against chance). One process; no resume: the demo takes minutes.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from openk3.train.config import RUN_CONFIG_FILE, RunConfig
from openk3.train.metrics import MetricsLog
from openk3.train.optim import LRSchedule, set_lr
from openk3.train.trainer import TrainingDiverged, build_training, setup_env, train_step
from openk3.vision import synthetic

TRAIN_SEED_BASE = 1_000  # step s of a run with seed r renders its examples from seed
EVAL_SEED = 7            # (r + 1) * TRAIN_SEED_BASE * 1000 + s; held-out examples from this one
EVAL_EXAMPLES = 1000


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def accuracy_table(acc: dict[str, float], chance: dict[str, float]) -> str:
    rows = [f"{'task':<8}{'accuracy':>10}{'chance':>9}"]
    rows += [f"{t:<8}{acc[t]:>10.3f}{chance[t]:>9.3f}" for t in (*synthetic.TASKS, "all")]
    return "\n".join(rows)


def train_vl(cfg: RunConfig) -> dict:
    """Train, evaluate on ``EVAL_EXAMPLES`` held-out images, export to RUN_DIR/export."""
    if cfg.resume or cfg.data or cfg.tokenizer:
        raise ValueError("the vision demo generates its own corpus and tokenizer and runs in one go: "
                         "--resume, --data and --tokenizer do not apply")
    env = setup_env(cfg)
    if env.world_size > 1:
        raise ValueError("the vision demo runs in one process (no torchrun)")
    model_cfg = cfg.model_config()
    vision = model_cfg.vision_config
    tok = synthetic.build_tokenizer()
    if (tok.get_vocab_size() > model_cfg.vocab_size
            or vision.media_placeholder_token_id != synthetic.MEDIA_PAD):
        raise ValueError(f"the synthetic corpus needs vocab_size >= {tok.get_vocab_size()} and "
                         f"media_placeholder_token_id={synthetic.MEDIA_PAD} (the debug-vl preset)")
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_CONFIG_FILE).write_text(json.dumps(
        {"run": cfg.to_dict(), "model": model_cfg.to_dict(), "world_size": 1}, indent=1))
    t = build_training(cfg, env, model_cfg)
    schedule = LRSchedule(cfg.max_steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio)
    metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=True)
    held_out = synthetic.examples(EVAL_EXAMPLES, seed=EVAL_SEED)
    chance = synthetic.chance()
    seed0 = (cfg.seed + 1) * TRAIN_SEED_BASE * 1000

    def batches(step: int):
        for k in range(cfg.grad_accum):
            exs = synthetic.examples(cfg.batch_size, seed=seed0 + step * cfg.grad_accum + k)
            yield synthetic.batch(exs, tok, vision)

    losses: list[float] = []
    t0 = t_last = time.perf_counter()
    last_row = 0  # the step of the last logged row
    for step in range(1, cfg.max_steps + 1):
        set_lr(t.optimizers, schedule(step - 1))
        loss, grad_norm, _ = train_step(t, batches(step), cfg)
        if not (math.isfinite(loss) and math.isfinite(float(grad_norm))):  # nothing is exported then
            raise TrainingDiverged(f"non-finite loss {loss} or gradient norm {float(grad_norm)} at step "
                                   f"{step}; stopping (this run keeps no checkpoint: start again, perhaps "
                                   "with a lower --lr)")
        losses.append(loss)
        eval_step = step % cfg.eval_interval == 0 and step != cfg.max_steps  # the last: below
        if step % cfg.log_interval == 0 or step == cfg.max_steps or eval_step:
            now = time.perf_counter()
            row = {"step": step, "loss": loss, "lr": cfg.lr * schedule(step - 1),
                   "grad_norm": float(grad_norm), "s_per_step": (now - t_last) / (step - last_row)}
            last_row = step
            if eval_step:
                row["accuracy"] = synthetic.evaluate(t.model, tok, held_out[:200])["all"]
                t.model.train()
            metrics.write(row)
            t_last = time.perf_counter()  # the evaluation's time is no step's
            _log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    acc = synthetic.evaluate(t.model, tok, held_out)
    minutes = (time.perf_counter() - t0) / 60
    metrics.write({"step": cfg.max_steps, "heldout_accuracy": acc, "chance": chance})
    print(f"held-out accuracy on {EVAL_EXAMPLES} images after {cfg.max_steps} steps "
          f"({minutes:.1f} min):\n{accuracy_table(acc, chance)}", flush=True)
    export(run_dir, t.model, tok)
    return {"start_step": 0, "end_step": cfg.max_steps, "first_loss": losses[0],
            "last_loss": losses[-1], "losses": losses,
            "accuracy": acc, "chance": chance, "minutes": minutes}


def export(run_dir: Path, model, tok) -> None:
    """The model with its tokenizer, loadable by ``openk3 generate --checkpoint RUN_DIR --image``."""
    from openk3.checkpoint import save_pretrained

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|eos|>",
              "bos_token": "<|bos|>", "pad_token": "<|pad|>"}
    save_pretrained(model, run_dir / "export", extra_files={
        "tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()})
