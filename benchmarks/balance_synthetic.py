"""Load balancing on synthetic skewed routers: Quantile Balancing vs DeepSeek's sign step.

A fixed router ``s = sigmoid(x W + c)`` with a strong per-expert skew ``c`` sees a fresh batch
of tokens ``x ~ N(0, I)`` every step. Each method routes the batch with its current bias, records
the max/mean expert load of that routing (the load the experts really get), then updates the bias
for the next batch. "sign" is DeepSeek-V3's step with its gamma = 1e-3, "sign:1e-2" the same with
10x the step. "uniform" is a peer that ignores the router: k distinct experts drawn at random
per token, the sampling-noise floor that no bias can beat on a fresh batch of this size.

Run from the repository root (2 CPU cores: ~10 min, ~8 more with ``--bins``):
``python -m benchmarks.balance_synthetic [--steps 200] [--tokens 8192] [--bins]``.
Prints a table of max/mean load at a few steps and writes ``docs/img/balance_synthetic.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from openk3.train.balance import (DEFAULT_NUM_BINS, expert_loads, qb_update_exact,
                                  qb_update_histogram, sign_update)

SETTINGS = ((64, 4), (896, 16))  # (num_experts, top_k): a small MoE and K3's router
METHODS = ("qb", "qb_hist", "sign", "sign:1e-2", "none", "uniform")
BIN_STUDY = ("qb", "qb_hist:1024", "qb_hist:256", "qb_hist:64", "qb_hist:1024:uniform")
REPORT_STEPS = (1, 10, 50, 200)


class SyntheticRouter:
    """Sigmoid router ``s = sigmoid(x W + c)``: x [N, dim] ~ N(0, I), W [dim, E] ~ N(0, 1/dim)
    (token-dependent part of the logits, std 1) and a fixed per-expert offset c ~ N(0, skew^2)."""

    def __init__(self, num_experts: int, dim: int = 64, skew: float = 1.0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.W = torch.randn(dim, num_experts, generator=g) / dim ** 0.5
        self.c = skew * torch.randn(num_experts, generator=g)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def batch(self, num_tokens: int) -> torch.Tensor:
        """Scores [N, E] fp32 of a fresh batch."""
        x = torch.randn(num_tokens, self.W.shape[0], generator=self.gen)
        return torch.sigmoid(x @ self.W + self.c)


def max_over_mean(topk_idx: torch.Tensor, num_experts: int) -> float:
    loads = expert_loads(topk_idx, num_experts).float()
    return (loads.max() / loads.mean()).item()


def update(method: str, scores: torch.Tensor, topk_idx: torch.Tensor, bias: torch.Tensor,
           k: int) -> torch.Tensor:
    E = scores.shape[1]
    if method == "qb":
        return qb_update_exact(scores, bias, k)
    if method.startswith("qb_hist"):  # qb_hist[:B][:uniform]
        parts = method.split(":")
        num_bins = int(parts[1]) if len(parts) > 1 else DEFAULT_NUM_BINS
        return qb_update_histogram(scores, bias, k, num_bins, (-1.0, 1.0) if "uniform" in parts else None)
    if method.startswith("sign"):  # sign or sign:GAMMA
        return sign_update(topk_idx, bias, E, gamma=float(method.partition(":")[2] or 1e-3))
    return bias  # none, uniform


def simulate(methods: tuple[str, ...], num_experts: int, top_k: int, steps: int, tokens: int,
             seed: int = 0) -> dict[str, list[float]]:
    """Max/mean load of each method's routing at steps 1..steps. All methods see the same
    batches; each keeps its own bias, learned online."""
    router = SyntheticRouter(num_experts, seed=seed)
    g = torch.Generator().manual_seed(seed + 2)
    bias = {m: torch.zeros(num_experts) for m in methods}
    history: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(steps):
        scores = router.batch(tokens)  # [N, E]
        for m in methods:
            if m == "uniform":
                topk_idx = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=-1).indices
            else:
                topk_idx = (scores + bias[m]).topk(top_k, dim=-1).indices
            history[m].append(max_over_mean(topk_idx, num_experts))
            bias[m] = update(m, scores, topk_idx, bias[m], top_k)
    return history


def print_row(label: str, values: list[float]) -> None:
    print(f"{label:<28}" + "".join(f"{v:>10.3f}" for v in values), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per batch (one step)")
    ap.add_argument("--plot", default="docs/img/balance_synthetic.png", help="'' to skip the plot")
    ap.add_argument("--bins", action="store_true",
                    help="also compare histogram layouts (E=896, k=16, 32768 tokens, 20 steps)")
    args = ap.parse_args()

    report = [s for s in REPORT_STEPS if s <= args.steps]
    tail = max(1, args.steps // 4)  # steady state: mean over the last quarter of the run
    print(f"max/mean expert load, {args.tokens} tokens per step (a fresh batch each step)")
    print(f"{'E, k, method':<28}" + "".join(f"{'step ' + str(s):>10}" for s in report)
          + f"{'last ' + str(tail):>10}")
    results = {}
    for E, k in SETTINGS:
        results[(E, k)] = simulate(METHODS, E, k, args.steps, args.tokens)
        for m, h in results[(E, k)].items():
            print_row(f"E={E} k={k} {m}", [h[s - 1] for s in report] + [sum(h[-tail:]) / tail])

    if args.bins:
        steps, tokens = 20, 32768
        print(f"\nhistogram layouts: E=896 k=16, {tokens} tokens, mean max/mean over steps 6-{steps}")
        for m, h in simulate(BIN_STUDY, 896, 16, steps, tokens).items():
            print_row(m, [sum(h[5:]) / len(h[5:])])

    if args.plot:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(SETTINGS), figsize=(6 * len(SETTINGS), 4.2))
        for ax, (E, k) in zip(axes, SETTINGS):
            for m, h in results[(E, k)].items():
                ax.plot(range(1, len(h) + 1), h, label=m, lw=1.3,
                        ls={"uniform": ":", "qb_hist": "--"}.get(m, "-"))
            ax.set(xlabel="step", ylabel="max / mean expert load", yscale="log",
                   title=f"E={E}, k={k}, {args.tokens} tokens/step")
            ax.set_yticks([1, 1.2, 1.5, 2, 3, 5, 10, 20, 40])
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
