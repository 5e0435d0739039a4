"""Speculative decoding in the engine: acceptance and speed-up of drafts over plain decoding.

For a target (a training run or HF checkpoint directory, or a preset with random weights) and
one or more drafts (EAGLE-3 draft directories from ``openk3 train-draft``, ``mtp`` for the
target's own MTP layer, ``random`` for an untrained EAGLE-3 draft, or a separate draft model's
directory), the engine generates ``--max-tokens`` tokens for each of ``--num-prompts`` prompts
taken from the embedded corpus (``openk3/train/corpus.py``: the stdlib, tokenised with the
target's tokenizer), at every temperature, batch size (``max_num_seqs``: at most that many
requests run at once) and K of the arguments, and without speculation (K = 0) in the same run as
the baseline. Stop tokens are off, so every request generates exactly ``--max-tokens`` tokens.

Columns:
    accepted/verify: accepted draft tokens per verify step of one sequence
        (``spec_accepted_tokens / spec_verifications``);
    tokens/verify: tokens emitted per verify step, ``1 + accepted/verify`` (the accepted drafts
        and the corrected or bonus token; vLLM's "mean acceptance length");
    acceptance: accepted / proposed draft tokens;
    tok/s: generated tokens per second of wall time (all requests, prefill included);
    speed-up: tok/s over the K = 0 row of the same temperature and batch.

Issue #14's targets (on the device, ``small`` trained on the corpus, its draft trained with LK
and KL): tokens/verify >= 3 at K = 7 and a batch-1 speed-up >= 2x.

    python benchmarks/spec_bench.py --checkpoint runs/small --drafts runs/draft-lk runs/draft-kl \
        --json $OUT/spec_bench.json
    python benchmarks/spec_bench.py --preset debug --drafts random --device cpu --num-prompts 4 \
        --max-tokens 16 --batch 1 2 --K 3       # a CPU sanity run
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from openk3.model.draft import DraftConfig, Eagle3Draft
from openk3.runtime import load_draft_model, load_model
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.train.corpus import default_corpus_files, read_documents


def corpus_prompts(tokenizer, n: int, length: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens: the first ``length`` tokens of every k-th document of
    the embedded corpus long enough (deterministic: the files in sorted order)."""
    files = sorted(default_corpus_files())
    prompts = []
    for doc in read_documents(files[::max(1, len(files) // (4 * n))]):
        ids = [i for i in tokenizer.encode(doc[:8 * length]) if i < vocab]
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == n:
            return prompts
    raise ValueError(f"the corpus gave only {len(prompts)} prompts of {length} tokens")


def make_draft(spec: str, target, device, dtype):
    if spec == "random":
        with torch.device(device):
            draft = Eagle3Draft(DraftConfig.for_target(target.cfg, "random"))
        draft.init_weights(0)
        return draft
    return load_draft_model(spec, device, dtype, target=target)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(target, tokenizer, prompts, args, temperature: float, batch: int, K: int, draft) -> dict:
    config = EngineConfig(max_num_seqs=batch, max_model_len=args.prompt_len + args.max_tokens + 8,
                          enable_prefix_caching=False, num_speculative_tokens=K,
                          max_num_batched_tokens=max(args.prompt_len, 1024))
    eng = LLMEngine(target, tokenizer, config, eos_token_ids=(), draft_model=draft)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=args.max_tokens)
              for i in range(len(prompts))]
    eng.generate(prompts[:batch], params[:batch])  # warm-up: kernels, graphs, allocator
    eng.stats = type(eng.stats)()
    device = eng.runner.device
    sync(device)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    sync(device)
    dt = time.perf_counter() - t0
    s = eng.stats
    n = sum(len(o.token_ids) for o in outs)
    accepted = s.spec_mean_accepted_tokens
    return {"temperature": temperature, "batch": batch, "K": K, "tokens": n, "seconds": dt,
            "tok_s": n / dt, "accepted_per_verify": accepted if K else None,
            "tokens_per_verify": accepted + 1 if K else None,
            "acceptance": s.spec_acceptance_rate if K else None, "verify_steps": s.spec_verifications}


def print_table(rows: list[dict]) -> None:
    cols = ["draft", "temperature", "batch", "K", "accepted_per_verify", "tokens_per_verify", "acceptance",
            "tok_s", "speed_up"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join("-" if r.get(c) is None else f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c])
                         for c in cols), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--checkpoint", help="the target: a training run or HF checkpoint directory")
    g.add_argument("--preset", help="the target: a preset with random weights (a sanity run)")
    p.add_argument("--drafts", nargs="+", required=True,
                   help="EAGLE-3 draft directories, 'mtp', 'random', or draft model directories")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--K", type=int, nargs="+", default=[3, 7])
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)

    target, tokenizer, name = load_model(args.checkpoint, args.preset, random_init=args.preset is not None,
                                         device=args.device, dtype=args.dtype)
    device, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    prompts = corpus_prompts(tokenizer, args.num_prompts, args.prompt_len, target.cfg.vocab_size)
    drafts = {spec: make_draft(spec, target, device, dtype) for spec in args.drafts}
    print(f"target {name} on {device} ({dtype}), {len(prompts)} prompts of {args.prompt_len} tokens, "
          f"{args.max_tokens} new tokens each", file=sys.stderr)
    rows = []
    for temperature in args.temperatures:
        for batch in args.batch:
            base = run(target, tokenizer, prompts, args, temperature, batch, 0, None)
            rows.append({"draft": "none", **base, "speed_up": 1.0})
            print_table(rows[-1:])
            for spec, draft in drafts.items():
                for K in args.K:
                    r = run(target, tokenizer, prompts, args, temperature, batch, K, draft)
                    rows.append({"draft": spec, **r, "speed_up": r["tok_s"] / base["tok_s"]})
                    print_table(rows[-1:])
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"target": name, "device": str(device), "dtype": str(dtype), "args": vars(args),
                       "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
