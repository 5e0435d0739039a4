"""Per-head Muon vs AdamW on the ``debug`` preset, fp32 on CPU, with a tiny learning-rate sweep.

    python benchmarks/muon_vs_adamw.py            # about 5 minutes on 2 idle CPU cores
    python benchmarks/muon_vs_adamw.py --threads 1   # better when the cores are shared

Data is synthetic but learnable, so the loss floor is known exactly. Each sequence is a
16-token phrase from a fixed random Markov chain over 256 token ids (every token has 4
equally likely successors), repeated to fill the sequence. Predicting the first phrase costs
ln 4 per token (after its first token); every later token is a copy of the token 16 back and
costs nothing once the model has learned to copy. Floor of the mean loss over 64 targets:
15 ln 4 / 64 = 0.325 nats.

Both optimisers use the same model init, data order, warmup + cosine schedule and weight decay;
``build_optimizers(..., optimizer="muon" | "adamw")`` is the only difference.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from openk3 import build_model, preset
from openk3.train.optim import build_optimizers, lr_multiplier, set_lr

DATA_VOCAB, SUCCESSORS, PERIOD = 256, 4, 16


class PhraseCopyData:
    """Batches [B, T+1] of repeated Markov-chain phrases (see the module docstring)."""

    def __init__(self, seq_len: int, seed: int):
        g = torch.Generator().manual_seed(1234)  # the chain is fixed across train / val
        self.successors = torch.stack([torch.randperm(DATA_VOCAB, generator=g)[:SUCCESSORS]
                                       for _ in range(DATA_VOCAB)])  # [V, 4]
        self.seq_len = seq_len
        self.g = torch.Generator().manual_seed(seed)

    def batch(self, B: int) -> torch.Tensor:
        phrase = torch.empty(B, PERIOD, dtype=torch.long)
        phrase[:, 0] = torch.randint(0, DATA_VOCAB, (B,), generator=self.g)
        for t in range(1, PERIOD):
            choice = torch.randint(0, SUCCESSORS, (B,), generator=self.g)
            phrase[:, t] = self.successors[phrase[:, t - 1], choice]
        reps = math.ceil((self.seq_len + 1) / PERIOD)
        return phrase.repeat(1, reps)[:, : self.seq_len + 1]

    @property
    def loss_floor(self) -> float:
        return (PERIOD - 1) * math.log(SUCCESSORS) / self.seq_len


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def run(optimizer: str, lr: float, args) -> dict:
    model = build_model(preset("debug"), seed=0)
    opts = build_optimizers(model, lr=lr, weight_decay=args.weight_decay, optimizer=optimizer)
    data = PhraseCopyData(args.seq, seed=0)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        set_lr(opts, lr_multiplier(step, args.steps, args.warmup, args.schedule))
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, data.batch(args.batch))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
    seconds = time.perf_counter() - start
    val = PhraseCopyData(args.seq, seed=1)
    with torch.no_grad():
        ids = torch.cat([val.batch(args.batch) for _ in range(8)])
        logits = model(ids[:, :-1]).logits
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T]
    return {"optimizer": optimizer, "lr": lr, "loss@50": losses[min(49, len(losses) - 1)],
            "loss@100": losses[min(99, len(losses) - 1)],
            "final train (mean of last 10)": sum(losses[-10:]) / len(losses[-10:]),
            "val loss": nll.mean().item(),
            "val phrase (floor 1.386)": nll[:, : PERIOD - 1].mean().item(),
            "val copies (floor 0)": nll[:, PERIOD - 1:].mean().item(), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--schedule", default="cosine", choices=["cosine", "wsd"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--muon-lrs", default="3e-3,1e-2,3e-2")
    parser.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows = []
    for name, lrs in (("muon", args.muon_lrs), ("adamw", args.adamw_lrs)):
        for lr in lrs.split(","):
            rows.append(run(name, float(lr), args))
            print(f"{name} lr={lr}: val loss {rows[-1]['val loss']:.4f} "
                  f"({rows[-1]['seconds']:.0f} s)", flush=True)
    print(f"debug preset, fp32 CPU, {args.steps} steps, batch {args.batch} x seq {args.seq}, "
          f"{args.schedule} with {args.warmup} warmup, loss floor "
          f"{PhraseCopyData(args.seq, 0).loss_floor:.3f}")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k])
                                for k in keys) + " |")


if __name__ == "__main__":
    main()
