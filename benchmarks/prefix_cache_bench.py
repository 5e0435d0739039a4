"""Host cost of the KDA-aware prefix cache's bookkeeping at 1M tokens (CPU only, no model).

Pure policy: a ``Scheduler`` + ``BlockManager`` serve one prompt of ``--tokens`` random ids
(default 1,048,576) with the default ``EngineConfig`` (chunks of 16,384, checkpoints every
8,192), then ``--decode`` decode steps, with prefix caching on and off in the same run. Prints
the whole prefill's host time and the mean and worst decode step (the worst one is a step that
completes a hash block and registers it).

Run: ``python benchmarks/prefix_cache_bench.py [--tokens 1048576] [--decode 1024]``
"""

from __future__ import annotations

import argparse
import random
import time

from openk3.serve.block_manager import BlockManager
from openk3.serve.config import EngineConfig
from openk3.serve.scheduler import Scheduler
from openk3.serve.sequence import Sequence


def serve_one_prompt(tokens: int, decode: int, caching: bool, seed: int = 0) -> dict:
    """Host seconds of scheduling ``tokens`` of prefill then ``decode`` decode steps."""
    config = EngineConfig(max_model_len=tokens + decode + 1, enable_prefix_caching=caching)
    num_blocks = -(-(tokens + decode + 1) // config.physical_block_size)
    sched = Scheduler(config, BlockManager(config, num_blocks, 1), config.max_model_len)
    rng = random.Random(seed)
    sched.add_request(Sequence("r", [rng.randrange(1 << 17) for _ in range(tokens)], decode + 1))
    prefill = 0.0  # every step up to and including the one that samples the first token
    steps: list[float] = []  # the decode steps after it
    while sched.has_unfinished():
        t0 = time.perf_counter()
        out = sched.step()
        sampled = [seq.request_id for seq in out.sampled]
        sched.postprocess(sampled, [[rng.randrange(1 << 17)] for _ in sampled])
        dt = time.perf_counter() - t0
        if out.scheduled[0][1] == 1:
            steps.append(dt)
        else:
            prefill += dt
    return {"prefill_s": prefill, "decode_mean_ms": 1e3 * sum(steps) / len(steps),
            "decode_max_ms": 1e3 * max(steps), "decode_steps": len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--decode", type=int, default=1024)
    args = parser.parse_args()
    print(f"one {args.tokens:,}-token prompt, {args.decode} decode steps (host time, pure policy)")
    print(f"{'prefix caching':>15} {'prefill (s)':>12} {'decode mean (ms)':>17} {'decode max (ms)':>16}")
    for caching in (False, True):
        r = serve_one_prompt(args.tokens, args.decode, caching)
        print(f"{'on' if caching else 'off':>15} {r['prefill_s']:12.4f} {r['decode_mean_ms']:17.4f} "
              f"{r['decode_max_ms']:16.3f}")


if __name__ == "__main__":
    main()
