"""Triton compiles inside serving steps: an engine that has captured its graphs and served one
warm-up request then serves prompts of many lengths (some sharing a cached prefix, so that
prefill chunks start at many positions), and every Triton kernel compiled meanwhile is logged
with the openk3 frames that launched it and the step it fell in. A compile inside a step holds
up every request of that step for ~0.3-0.5 s (docs/benchmarks.md, thirty-fifth session: the MoE
routing kernels in the EAGLE draft's packed pass); a server should compile nothing after its
captures.

    PYTHONPATH=. python benchmarks/compile_watch.py                       # `small`, random weights, on the GPU
    PYTHONPATH=. python benchmarks/compile_watch.py --draft random --K 3  # with an EAGLE-3 draft
    PYTHONPATH=. python benchmarks/compile_watch.py --preset debug --device cpu --requests 4 --max-len 300
                                                                          # the mechanics (no Triton: not tracked)

Prints each compile (kernel, the step's wall ms and prompt tokens, the frames) and a summary
line; the rows go to ``$OUT/compile_watch.json``.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.common import TritonCompiles, write_results
from benchmarks.spec_bench import make_draft, sync
from openk3.runtime import load_model
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams


def prompts(n: int, max_len: int, vocab: int, wave: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 17 .. ``max_len`` tokens (random ids), served in waves of ``wave``; every
    third one is an earlier wave's prompt and a new tail (a prefix cache hit: the engine keeps
    the KDA state at a prompt's end, so its chunk starts mid-sequence)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        earlier = out[:i - i % wave]
        if i % 3 == 2 and earlier and min(map(len, earlier)) < max_len - 17:
            base = rng.choice([p for p in earlier if len(p) < max_len - 17])
            tail = rng.randint(17, min(500, max_len - len(base)))
            out.append(base + [rng.randrange(3, vocab) for _ in range(tail)])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(rng.randint(17, max_len))])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default=None)
    p.add_argument("--draft", default=None, help="'random': an untrained EAGLE-3 draft (speculative decoding)")
    p.add_argument("--K", type=int, default=3, help="speculative tokens with --draft")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-len", type=int, default=6000, help="the longest prompt")
    p.add_argument("--max-num-seqs", type=int, default=4)
    args = p.parse_args(argv)

    model, tokenizer, name = load_model(None, args.preset, random_init=True, device=args.device)
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    draft = make_draft(args.draft, model, device, dtype) if args.draft else None
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_len + 64,
                          enable_prefix_caching=True, num_speculative_tokens=args.K if draft else 0)
    eng = LLMEngine(model, tokenizer, config, eos_token_ids=(), draft_model=draft)
    eng.capture_graphs()
    vocab = model.cfg.vocab_size
    eng.generate([prompts(1, 256, vocab, 1, seed=99)[0]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    queue = [(ids, SamplingParams(temperature=0 if i % 2 else 1, seed=i, max_tokens=8))
             for i, ids in enumerate(prompts(args.requests, args.max_len, vocab, args.max_num_seqs))]
    rows, steps = [], 0
    with TritonCompiles(True) as compiles:
        while queue or eng.has_unfinished():
            if not eng.has_unfinished():  # in waves, so that a later wave's prompts hit an earlier one's cache
                for ids, params in queue[:args.max_num_seqs]:
                    eng.add_request(ids, params)
                del queue[:args.max_num_seqs]
            before, prompt_tokens = len(compiles.seen), eng.stats.prompt_tokens
            sync(device)
            t = time.perf_counter()
            eng.step()
            sync(device)
            ms = 1e3 * (time.perf_counter() - t)
            for kernel, spec, frames in compiles.seen[before:]:
                rows.append({"step": steps, "step_ms": round(ms, 2), "prompt_tokens":
                             eng.stats.prompt_tokens - prompt_tokens, "kernel": kernel, "spec": spec,
                             "frames": frames})
                print(f"step {steps} ({ms:.1f} ms, {rows[-1]['prompt_tokens']} prompt tokens): {kernel}\n    "
                      + "\n    ".join(frames), flush=True)
            steps += 1
    tracked = "" if compiles.tracked else " (not tracked: no Triton, or one without the hook)"
    print(f"{name} on {device}{' with a ' + args.draft + ' draft' if draft else ''}: {args.requests} requests, "
          f"{steps} steps, {eng.block_manager.stats.saved_tokens} prompt tokens from the prefix cache, "
          f"{len(rows)} Triton compiles after the captures and the warm-up{tracked}")
    write_results("compile_watch", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
