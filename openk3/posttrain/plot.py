"""PNG charts of a post-training run's metrics.jsonl: reward and accuracy, completion lengths,
staleness of the trained tokens (partial rollouts). ``openk3 plot RUN`` draws them for an RL run."""

from __future__ import annotations

from pathlib import Path

from openk3.train.metrics import read_metrics
from openk3.train.plot import _save


def plot_posttrain(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(run_dir) if "reward" in r]
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no post-training rows yet")
    out = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    charts = (("reward.png", "reward and accuracy", "", [("reward", "reward"), ("accuracy", "accuracy")]),
              ("length.png", "completion length", "tokens",
               [("length_mean", "mean"), ("length_max", "max"), ("length_min", "min")]),
              ("staleness.png", "staleness of trained tokens", "policy versions",
               [("staleness_mean", "mean"), ("staleness_max", "max")]))
    written = []
    for name, title, ylabel, series in charts:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, label in series:
            ax.plot(steps, [r.get(key, float("nan")) for r in rows], ".-", label=label)
        if "mopd_reward" in rows[0] and name == "reward.png":
            ax.plot(steps, [r["mopd_reward"] for r in rows], ".-", label="MOPD reward per token")
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.legend()
        written.append(_save(fig, out / name))
    return written
