"""``openk3 plot RUN_DIR``: PNG charts of a run's metrics.jsonl (loss, load balance, activations)."""

from __future__ import annotations

from pathlib import Path

from openk3.train.metrics import read_metrics


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no rows yet")
    out = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], label="train loss")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="val loss")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="loss")
    ax.legend()
    written.append(_save(fig, out / "loss.png"))

    loads = [r.get("load_max_over_mean") or [] for r in rows]
    if any(loads):
        fig, ax = plt.subplots(figsize=(7, 4))
        for layer in range(max(len(x) for x in loads)):
            ax.plot(steps, [x[layer] if layer < len(x) else float("nan") for x in loads],
                    label=f"MoE layer {layer + 1}", lw=1)
        ax.axhline(1.0, color="k", ls=":", lw=0.8)
        ax.set(xlabel="step", ylabel="max / mean expert load", title="load balance")
        ax.legend(fontsize=7, ncol=2)
        written.append(_save(fig, out / "load_balance.png"))

    acts = [r.get("max_abs_activation") or [] for r in rows]
    if any(acts):
        fig, ax = plt.subplots(figsize=(7, 4))
        for layer in range(max(len(x) for x in acts)):
            ax.plot(steps, [x[layer] if layer < len(x) else float("nan") for x in acts],
                    label=f"layer {layer}", lw=1)
        ax.set(xlabel="step", ylabel="max |activation|", title="residual-stream activations",
               yscale="log")
        ax.legend(fontsize=7, ncol=2)
        written.append(_save(fig, out / "activations.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
