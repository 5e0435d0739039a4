"""Fused projections (issue P8): decode of ``small`` through the engine, unfused vs fused.

For each mode: ms per decode step at batch 1 and 32 (128-token prompts, 128 new tokens, greedy,
CUDA graphs on), and the kernels of one eager decode step at batch 1 (torch profiler). The
unfused run comes first: the engine fuses the model in place (``ModelRunner``), so for it the
runner's call is replaced by the identity. Target (issue P8): batch-1 step <= 1.5 ms.

Run on the device: ``python benchmarks/fuse_bench.py``.
"""

from __future__ import annotations

import torch

import openk3.serve.model_runner as model_runner
from benchmarks.common import environment, profile, write_results
from benchmarks.serve_bench import decode_throughput, engine, random_ids
from openk3 import build_model, preset
from openk3.serve.sampler import SamplingParams

ROWS: list[dict] = []


def record(row: dict) -> None:
    ROWS.append(row)
    write_results("fuse_bench", ROWS)


def eager_step_kernels(model, label: str) -> dict:
    """Kernels of one batch-1 decode step without CUDA graphs (after the prompt's prefill)."""
    eng = engine(model, max_num_seqs=1, max_model_len=4096, cuda_graphs=False)
    eng.add_request(random_ids(128, model.cfg.vocab_size, 7), SamplingParams(temperature=0, max_tokens=64))
    eng.step()  # the prefill
    return profile(eng.step, f"eager decode step, batch 1, {label}")


def main() -> None:
    print(environment())
    model = build_model(preset("small"), device="cuda", dtype=torch.bfloat16)
    fuse = model_runner.fuse_projections
    for label in ("unfused", "fused"):
        model_runner.fuse_projections = fuse if label == "fused" else (lambda m: m)
        for B in (1, 32):
            eng = engine(model, max_num_seqs=32, max_num_batched_tokens=8192, max_model_len=4096)
            decode_throughput(eng, B, new=16)  # warm-up: compiles and captures this bucket
            record({"part": "decode", "projections": label, **decode_throughput(eng, B)})
        record({"part": "kernels", "projections": label, **eager_step_kernels(model, label)})
    model_runner.fuse_projections = fuse


if __name__ == "__main__":
    main()
