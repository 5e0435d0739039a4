"""Self-distillation data for an EAGLE-3 draft: the target's own continuations of training windows.

EAGLE-3 and Medusa-2 train drafts on text the target generated, since at serving time the draft
predicts the target's outputs, not the corpus. This script writes that text: ``--num-prompts``
windows of ``--prompt-len`` tokens drawn from a prepared data cache's training split (the corpus
the target trained on; ``openk3/train/data.py``), each continued by the target through the
serving engine for ``--gen-len`` tokens at ``--temperature``, decoded and written as JSONL
(``{"text": prompt + continuation}``), which ``openk3 train-draft --data FILE.jsonl`` reads::

    PYTHONPATH=. python benchmarks/draft_self_distill.py --checkpoint runs/target \
        --data-dir ~/.cache/openk3/data/stdlib-v4096-... --out regen.jsonl --temperature 0
    openk3 train-draft --checkpoint runs/target --data regen.jsonl --init mtp --out runs/draft-regen

Measured on the CPU (thirty-sixth session, ``docs/benchmarks.md``): with a 400-step ``debug``
target, a draft trained on 98K greedy tokens of this data accepted *less* on held-out prompts
than one trained on the corpus for the same steps (3.21 vs 3.73 tokens per verify at K = 3,
greedy): the weak target's greedy continuations are mostly loops.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from openk3.runtime import load_model
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.train.data import PreparedData


def training_windows(data_dir: str, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` windows of ``length`` token ids at random offsets of the cache's training split."""
    data = PreparedData.from_dir(data_dir)
    tokens = np.memmap(data.train_path, dtype=data.dtype, mode="r")
    if len(tokens) <= length:
        raise ValueError(f"{data.train_path}: {len(tokens)} tokens, fewer than --prompt-len {length}")
    starts = np.random.default_rng(seed).integers(0, len(tokens) - length, n)
    return [tokens[s:s + length].astype(np.int64).tolist() for s in starts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="the target: a training run or HF checkpoint directory")
    p.add_argument("--data-dir", required=True, help="a prepared data cache directory (holds meta.json)")
    p.add_argument("--out", required=True, help="the JSONL file written")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=192)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=64, help="the engine's max_num_seqs")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    args = p.parse_args(argv)

    model, tokenizer, _ = load_model(args.checkpoint, device=args.device, dtype=args.dtype)
    prompts = training_windows(args.data_dir, args.num_prompts, args.prompt_len, args.seed)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=args.batch,
                                                      max_model_len=args.prompt_len + args.gen_len + 8,
                                                      enable_prefix_caching=False), eos_token_ids=())
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.gen_len, seed=args.seed + i)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params)
    print(f"{len(prompts)} continuations of {args.gen_len} tokens in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    with open(args.out, "w") as f:
        for prompt, out in zip(prompts, outputs):
            f.write(json.dumps({"text": tokenizer.decode(prompt + list(out.token_ids))}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
