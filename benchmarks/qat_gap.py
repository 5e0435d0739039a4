"""MXFP4 quantisation-aware training vs the same run without it: the final-loss gap.

    python benchmarks/qat_gap.py --preset debug --steps 300 --device cpu --eval-batches 16
    python benchmarks/qat_gap.py --preset small --steps 600 --device cuda --runs none   # one H200,
    python benchmarks/qat_gap.py --preset small --steps 600 --device cuda --runs mxfp4  # one run a call
    python benchmarks/qat_gap.py --preset small --steps 600 --runs                      # the table only

Trains ``openk3 train --preset PRESET`` twice, identical (seed, data order, schedule) except for
``--qat none`` and ``--qat mxfp4``, each into OUT/{none,mxfp4} (a run already finished there is
read, not retrained), then prints a table: the final validation loss (``eval_batches`` batches
at the last step), the mean training loss over the last tenth of the logged steps, and the gap
of the QAT run relative to the baseline (target for ``small``: at most 1%). ``--plot PNG``
draws both loss curves (``benchmarks/plot_loss_curves.py``, needs matplotlib).

Run presets fix batch and sequence length (``debug``: 8 x 256 tokens per step; ``small``: 4 x
4096); ``--batch-size`` / ``--seq-len`` / ``--eval-batches`` override them for both runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RUNS = ("none", "mxfp4")


def train_one(args: argparse.Namespace, qat: str) -> float:
    """Train the ``qat`` run into OUT/qat unless it has finished there; returns the seconds spent."""
    from openk3.train.config import run_preset
    from openk3.train.trainer import train

    out = Path(args.out) / qat
    if _rows(out) and _rows(out)[-1]["step"] >= args.steps:
        return 0.0
    overrides = {"out": str(out), "max_steps": args.steps, "qat": qat, "device": args.device,
                 "num_samples": 0, "resume": out.exists(), "seed": args.seed}
    preset_defaults = run_preset(args.preset)
    overrides["warmup_steps"] = min(preset_defaults.warmup_steps, args.steps // 10)
    log = min(preset_defaults.log_interval, max(args.steps // 50, 1))
    # validation on logging steps only: four times per run, and always at the last step
    overrides.update(log_interval=log, eval_interval=log * max(args.steps // 4 // log, 1))
    for name in ("batch_size", "seq_len", "eval_batches"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    t0 = time.perf_counter()
    train(run_preset(args.preset, **overrides))
    return time.perf_counter() - t0


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(run_dir: Path, last_step: int | None = None) -> dict | None:
    """Final validation loss, mean training loss over the last tenth of the logged steps, and
    throughput of the run in ``run_dir``, counting only steps up to ``last_step``."""
    rows = [r for r in _rows(run_dir) if "loss" in r and (last_step is None or r["step"] <= last_step)]
    if not rows:
        return None
    tail = rows[-max(len(rows) // 10, 1):]
    val = [r for r in rows if "val_loss" in r]
    return {"step": rows[-1]["step"], "val_loss": val[-1]["val_loss"] if val else float("nan"),
            "val_step": val[-1]["step"] if val else None,
            "train_tail": sum(r["loss"] for r in tail) / len(tail), "tail_steps": len(tail),
            "tokens_per_s": sum(r["tokens_per_s"] for r in tail) / len(tail)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="debug")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", default=None, help="default runs/qat_gap_PRESET")
    p.add_argument("--runs", nargs="*", default=list(RUNS), choices=RUNS,
                   help="which runs to train now (both by default; none: only print the table)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--eval-batches", type=int, default=None,
                   help="validation batches per evaluation (the preset's 4 is noisy for a gap of 1%%)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--plot", default=None, help="write both loss curves to this PNG")
    args = p.parse_args()
    args.out = args.out or f"runs/qat_gap_{args.preset}"
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)

    seconds = {qat: train_one(args, qat) for qat in args.runs}
    # both runs compared up to the last step both reached (one may still be running elsewhere)
    reached = [_rows(Path(args.out) / qat)[-1]["step"] for qat in RUNS if _rows(Path(args.out) / qat)]
    common = min(reached) if len(reached) == len(RUNS) else None
    stats = {qat: summarise(Path(args.out) / qat, common) for qat in RUNS}
    print(f"\npreset {args.preset}, {args.steps} steps, runs in {args.out}")
    print("| qat | step | val loss (at step) | train loss (last 10% of logs) | tokens/s | wall s (this call) |")
    print("|---|---|---|---|---|---|")
    for qat in RUNS:
        s = stats[qat]
        if s is None:
            print(f"| {qat} | not run | | | | |")
            continue
        print(f"| {qat} | {s['step']} | {s['val_loss']:.4f} ({s['val_step']}) | {s['train_tail']:.4f} "
              f"({s['tail_steps']} logs) | {s['tokens_per_s']:.0f} | {seconds.get(qat, 0):.0f} |")
    base, qat = stats["none"], stats["mxfp4"]
    if base and qat:
        if base["step"] != args.steps or base["val_step"] != qat["val_step"]:
            print(f"note: compared at step {base['step']} (validation at step {base['val_step']} vs "
                  f"{qat['val_step']}), not the requested {args.steps}")
        val_gap = 100 * (qat["val_loss"] - base["val_loss"]) / base["val_loss"]
        tail_gap = 100 * (qat["train_tail"] - base["train_tail"]) / base["train_tail"]
        print(f"\nQAT gap (mxfp4 vs none): final val loss {val_gap:+.2f}%, "
              f"train loss over the last 10% {tail_gap:+.2f}%  (target on small: <= 1%)")
    if args.plot:
        from benchmarks.plot_loss_curves import main as plot

        present = [f"{'no QAT' if q == 'none' else 'MXFP4 QAT'}={Path(args.out) / q / 'metrics.jsonl'}"
                   for q in RUNS if stats[q]]
        plot(args.plot, *present)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
