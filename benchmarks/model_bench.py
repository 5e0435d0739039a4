"""Whole-model forward+backward of a preset on one GPU: fast paths vs the PyTorch references.

Run on the device: ``python benchmarks/model_bench.py --preset small --batch 1 --seq 4096``.
Both paths run in the same process; ``OPENK3_REFERENCE=1`` switches every op to its reference.
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.common import cuda_time, environment, rel_err, write_results
from openk3 import build_model, preset
from openk3.params import count_parameters


def step(model, ids):
    out = model(ids)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()
    return loss


def measure(model, ids, reference: bool) -> dict:
    os.environ["OPENK3_REFERENCE"] = "1" if reference else "0"
    model.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    # the reference has nothing to warm up (no compilation or autotuning) and is slow: one call
    warmup, iters = (0, 1) if reference else (1, 3)
    with torch.no_grad():
        fwd_s = cuda_time(lambda: model(ids), warmup=warmup, iters=iters)
    fb_s = cuda_time(lambda: step(model, ids), warmup=warmup, iters=iters)
    tokens = ids.numel()
    with torch.no_grad():
        logits = model(ids[:, :1024]).logits
    return {"path": "reference" if reference else "fast", "fwd_ms": 1e3 * fwd_s,
            "fwdbwd_ms": 1e3 * fb_s, "fwdbwd_tok_s": tokens / fb_s,
            "peak_GiB": torch.cuda.max_memory_allocated() / 2**30, "_logits": logits}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    print(environment())
    cfg = preset(args.preset)
    counts = count_parameters(cfg)
    print(f"{args.preset}: total {counts['total'] / 1e9:.3f}B, active {counts['active'] / 1e9:.3f}B")
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():  # non-zero AttnRes queries so the aggregation is exercised
        for n, p in model.named_parameters():
            if n.endswith("_res.proj.weight"):
                p.normal_(0, 0.02)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    fast = measure(model, ids, reference=False)
    print({k: v for k, v in fast.items() if k != "_logits"}, flush=True)  # in case the reference times out
    ref = measure(model, ids, reference=True)
    fast["logits_rel_err_vs_ref"] = rel_err(fast["_logits"], ref["_logits"])
    fast["speedup_fwdbwd"] = ref["fwdbwd_ms"] / fast["fwdbwd_ms"]
    rows = []
    for r in (fast, ref):
        r.pop("_logits")
        rows.append({"preset": args.preset, "B": args.batch, "T": args.seq, **r})
        print(rows[-1], flush=True)
    write_results(f"model_bench_{args.preset}", rows)


if __name__ == "__main__":
    main()
