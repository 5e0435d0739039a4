"""Rollout throughput with vs without partial rollouts under a long-tailed length distribution.

Both modes generate the same workload through ``PartialRollouts`` on the serving engine: groups
of G samples whose target lengths are drawn from a log-normal distribution (median
``max_new_tokens / 8``, sigma 1.2, capped at ``max_new_tokens``: a few samples are 10-20x the
median, as reasoning traces are). A sample ends exactly at its target length (no eos or stop
string), so the two modes do the same useful work. Between rounds the engine re-loads the
policy's weights as after a training step (``RolloutEngine.sync``), in both modes.

* sync (``--no-partial-rollouts``): a round runs until every sample finished, so the engine's
  batch drains to the few longest samples at the end of each round;
* partial: a round stops once ``finish_fraction`` of its samples finished (and a group is
  complete); the rest are queued, resumed first in the next round (re-prefilled: prompt + tokens
  so far) and the freed slots are refilled with new groups.

Throughput = tokens of the completed groups / wall time, until ``--groups`` groups completed.
Target (issue P12): partial >= 1.5x sync.

    python benchmarks/rollout_bench.py --preset debug --device cpu          # CPU, ~1-2 minutes
    python benchmarks/rollout_bench.py --preset small --prompts-per-step 32 --group-size 8 \\
        --max-new-tokens 4096 --groups 128                                  # one H200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch

from benchmarks.common import environment
from openk3 import build_model, preset
from openk3.posttrain.partial import PartialRollouts
from openk3.posttrain.rollout import RolloutEngine
from openk3.runtime import resolve_device, resolve_dtype
from openk3.tokenizer import ByteTokenizer


class _Lengths(dict):
    """Sample k's target length, drawn on first use from its own seed: both modes get the same."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw

    def __missing__(self, key):
        self[key] = self.draw(key)
        return self[key]


class FixedLengths:
    """The engine backend with each sample's length fixed in advance (a long-tailed draw)."""

    def __init__(self, rollouts: RolloutEngine, lengths: _Lengths):
        self.rollouts, self.lengths = rollouts, lengths
        self.prompt_len: dict[int, int] = {}  # from a sample's first submission: its prompt alone

    def submit(self, key, token_ids, max_tokens, stop):
        done = len(token_ids) - self.prompt_len.setdefault(key, len(token_ids))
        self.rollouts.submit(key, token_ids, min(max_tokens, self.lengths[key] - done), stop)

    def step(self):
        pieces = self.rollouts.step()
        for p in pieces:
            if p.finish_reason is not None:
                p.finish_reason = "stop"
        return pieces

    def abort_all(self):
        self.rollouts.abort_all()

    def has_unfinished(self):
        return self.rollouts.has_unfinished()


def run_mode(args, policy, partial: bool, device, dtype) -> dict:
    rng = random.Random(args.seed)
    G, cap = args.group_size, args.prompts_per_step * args.group_size
    median = max(1, args.max_new_tokens // 8)
    lengths = _Lengths(lambda k: min(args.max_new_tokens, max(1, round(
        random.Random(args.seed * 1_000_003 + k).lognormvariate(math.log(median), 1.2)))))
    rollouts = RolloutEngine(policy, ByteTokenizer(), device, dtype, max_num_seqs=cap,
                             max_model_len=args.prompt_tokens + args.max_new_tokens + 1, eos_token_ids=())
    backend = FixedLengths(rollouts, lengths)
    sched = PartialRollouts(backend, G, cap, args.max_new_tokens, args.finish_fraction, partial)

    def new_groups(n):
        return [([rng.randrange(3, 250) for _ in range(args.prompt_tokens)], None, ()) for _ in range(n)]

    done, tokens, stale, rounds, version = 0, 0, [], 0, 0
    t0 = time.perf_counter()
    while done < args.groups:
        ready, _ = sched.round(new_groups, version)
        rounds += 1
        version += 1
        rollouts.sync(policy)
        for g in ready:
            done += 1
            for t in g.members:
                tokens += len(t.tokens)
                stale += [version - 1 - v for v in t.versions]
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"mode": "partial" if partial else "sync", "rounds": rounds, "groups": done, "tokens": tokens,
            "seconds": dt, "tokens_per_s": tokens / dt, "mean_staleness": sum(stale) / max(len(stale), 1),
            "max_staleness": max(stale, default=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--groups", type=int, default=24, help="completed groups to time")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--finish-fraction", type=float, default=0.75)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    policy = build_model(preset(args.preset), device=device, dtype=dtype, seed=0).eval()
    warm = argparse.Namespace(**{**vars(args), "groups": 1, "max_new_tokens": 8})
    for partial in (False, True):  # warm-up: first-call costs (imports, allocator, kernels) are not timed
        run_mode(warm, policy, partial, device, dtype)
    rows = [run_mode(args, policy, partial, device, dtype) for partial in (False, True)]
    rows[1]["speedup"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(f"rollout_bench: preset {args.preset} on {device} ({dtype}), {args.prompts_per_step} x {args.group_size} "
          f"in flight, lengths log-normal (median {max(1, args.max_new_tokens // 8)}, cap {args.max_new_tokens}), "
          f"finish_fraction {args.finish_fraction}")
    keys = list(rows[1])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "rollout_bench.json"), "w") as fh:
            json.dump({"env": environment(), "args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
