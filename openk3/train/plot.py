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
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]  # a debug-vl run's last row has none
    if train:
        ax.plot(*zip(*train), ".-", label="train loss")  # a one-row run shows its point
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="val loss")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="loss")
    ax.legend()
    written.append(_save(fig, out / "loss.png"))

    loads = [r.get("load_max_over_mean") or [] for r in rows]
    if any(loads):
        ax = _per_layer_chart(plt, steps, loads, "MoE layer {}", 1)
        ax.axhline(1.0, color="k", ls=":", lw=0.8)
        ax.set(xlabel="step", ylabel="max / mean expert load", title="load balance")
        written.append(_save(ax.figure, out / "load_balance.png"))

    acts = [r.get("max_abs_activation") or [] for r in rows]
    if any(acts):
        ax = _per_layer_chart(plt, steps, acts, "layer {}", 0)
        ax.set(xlabel="step", ylabel="max |activation|", title="residual-stream activations",
               yscale="log")
        written.append(_save(ax.figure, out / "activations.png"))
    return written


def _per_layer_chart(plt, steps: list[int], values: list[list[float]], label: str, first: int):
    """One line per layer from rows of per-layer values (rows may be shorter: NaN-padded)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for layer in range(max(len(v) for v in values)):
        ax.plot(steps, [v[layer] if layer < len(v) else float("nan") for v in values], ".-",
                label=label.format(layer + first), lw=1)
    ax.legend(fontsize=7, ncol=2)
    return ax


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
