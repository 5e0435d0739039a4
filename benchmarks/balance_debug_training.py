"""Load balance inside real training: the ``debug`` preset on the stdlib corpus, CPU, with
Quantile Balancing, the DeepSeek-V3 sign step and no balancing, same data and seed.

``python -m benchmarks.balance_debug_training --steps 150`` prints max/mean expert load (mean
over the MoE layers) at a few steps and writes docs/img/balance_debug_training.png.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from openk3.train.config import run_preset
from openk3.train.metrics import read_metrics
from openk3.train.trainer import train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--methods", nargs="+", default=["qb", "sign", "none"])
    ap.add_argument("--plot", default="docs/img/balance_debug_training.png")
    args = ap.parse_args()
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            out = Path(tmp) / method
            train(run_preset("debug", out=str(out), max_steps=args.steps, balance=method,
                             log_interval=5, eval_interval=10**6, ckpt_interval=10**6, num_samples=0,
                             warmup_steps=min(20, args.steps - 1)))
            rows = read_metrics(out)
            curves[method] = [(r["step"], sum(r["load_max_over_mean"]) / len(r["load_max_over_mean"]),
                               r["loss"]) for r in rows]
    marks = [s for s in (5, 25, 50, 100, 150, 300) if s <= args.steps]
    print("method | " + " | ".join(f"step {s}" for s in marks) + " | mean of last 10 logs | final loss")
    for method, c in curves.items():
        at = {s: v for s, v, _ in c}
        tail = [v for _, v, _ in c[-10:]]
        print(f"{method} | " + " | ".join(f"{at[s]:.2f}" for s in marks)
              + f" | {sum(tail) / len(tail):.2f} | {c[-1][2]:.3f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for method, c in curves.items():
        ax.plot([s for s, _, _ in c], [v for _, v, _ in c], label=method)
    ax.axhline(1.0, color="k", ls=":", lw=0.8)
    ax.set(xlabel="step", ylabel="max/mean expert load (mean over MoE layers)",
           title="debug preset on the stdlib corpus (8 experts, top-2)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
