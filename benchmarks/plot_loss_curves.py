"""Plot training-loss curves from ``openk3 train``'s ``metrics.jsonl`` files, side by side.

    python benchmarks/plot_loss_curves.py OUT.png LABEL=RUN/metrics.jsonl [LABEL=...]

Needs matplotlib (not a dependency of openk3). Prints, per run, the loss at the last logged
step and the mean absolute difference from the first run over the steps both logged.
"""

from __future__ import annotations

import json
import sys


def read(path: str) -> dict[int, dict]:
    with open(path) as fh:
        return {r["step"]: r for r in map(json.loads, fh) if "loss" in r}


def main(out: str, *runs: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {}
    for arg in runs:
        label, sep, path = arg.partition("=")
        if not sep:
            raise SystemExit(f"{arg!r}: expected LABEL=PATH")
        curves[label] = read(path)
    first = next(iter(curves.values()))
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in curves.items():
        steps = sorted(rows)
        ax.plot(steps, [rows[s]["loss"] for s in steps], label=label, linewidth=1.2)
        common = [s for s in steps if s in first]
        diff = sum(abs(rows[s]["loss"] - first[s]["loss"]) for s in common) / len(common)
        print(f"{label}: loss {rows[steps[-1]]['loss']:.4f} at step {steps[-1]}, "
              f"val {rows[steps[-1]].get('val_loss', float('nan')):.4f}; "
              f"mean |difference| from the first run {diff:.4f} over {len(common)} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
