"""Regional compilation and activation checkpointing on one GPU: eager vs compiled, in one run.

1. Forward + backward of single decoder layers of a preset (one of each kind: KDA or MLA
   attention, dense MLP or MoE), bf16 autocast over fp32 master weights as in training, eager
   and then with the layer's regions compiled (``openk3.parallel.compile.compile_layers``).
2. Full training steps (forward, backward, Quantile Balancing, clipping, Muon + AdamW) of the
   whole model, laid out by ``parallelize`` with ``compile`` and ``activation_checkpointing``
   off and on: ms per step, tokens/s, MFU, peak memory, and the first step's time (which
   includes compilation).

CUDA-event medians after warm-up; each row prints as soon as it is measured, and a row that
fails prints its error and the run goes on. Run on the device:
``python benchmarks/compile_bench.py --batch 4 --seq 4096``.
"""

from __future__ import annotations

import argparse
import functools
import time
import traceback

import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

from benchmarks.common import cuda_time, environment, write_results
from openk3 import build_model, preset
from openk3.parallel.compile import compile_layers
from openk3.parallel.parallelize import parallelize
from openk3.train.balance import Balancer
from openk3.train.metrics import flops_per_token, peak_flops
from openk3.train.optim import build_optimizers
from openk3.train.trainer import Env


def layer_kinds(cfg) -> dict[int, str]:
    """The first layer of each kind: {index: "KDA + MoE", ...}."""
    kinds: dict[str, int] = {}
    for i in range(cfg.num_hidden_layers):
        attention = "MLA" if cfg.is_mla_layer(i) else "KDA"
        kinds.setdefault(f"{attention} + {'MoE' if cfg.is_moe_layer(i) else 'dense'}", i)
    return {i: kind for kind, i in kinds.items()}


def layer_rows(args, cfg) -> list[dict]:
    model = build_model(cfg, device="cuda").train()
    d, size = cfg.hidden_size, cfg.attn_res_block_size
    p = torch.randn(args.batch, args.seq, d, device="cuda", requires_grad=True)
    grad = torch.randn_like(p)

    def fwd_bwd(layer, bank):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(p, bank)
        out.backward(grad)

    kinds = layer_kinds(cfg)
    times: dict[int, dict[str, float]] = {i: {} for i in kinds}
    for path in ("eager", "compiled"):
        if path == "compiled":
            compile_layers(model)
        for i in kinds:
            layer = model.model.layers[i]
            # the blocks sealed before layer i: the embedding's and every size-th layer's
            bank = [torch.randn_like(p) for j in range(i) if size and j % size == 0]
            times[i][path] = cuda_time(functools.partial(fwd_bwd, layer, bank), warmup=2,
                                       iters=args.iters)
            print(f"layer {i} ({kinds[i]}) {path}: {1e3 * times[i][path]:.2f} ms", flush=True)
    return [{"layer": i, "kind": kinds[i], "eager_ms": 1e3 * t["eager"],
             "compiled_ms": 1e3 * t["compiled"], "speedup": t["eager"] / t["compiled"]}
            for i, t in times.items()]


def step_row(args, cfg, compiled: bool, checkpointed: bool) -> list[dict]:
    torch._dynamo.reset()
    counters.clear()
    model = build_model(cfg, device="cuda").train()
    parallelize(model, Env(0, 1, torch.device("cuda"), torch.bfloat16), compile=compiled,
                activation_checkpointing=checkpointed)
    opts = build_optimizers(model, lr=1e-3, weight_decay=0.1)
    balancer = Balancer("qb", cfg.num_experts, cfg.num_experts_per_token).attach(model)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        balancer.update()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    step()  # compiles
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t
    sec = cuda_time(step, warmup=1, iters=args.steps)
    tok_s = args.batch * args.seq / sec
    peak = peak_flops(torch.device("cuda"), torch.bfloat16)
    return [{"compile": compiled, "activation_checkpointing": checkpointed, "step_ms": 1e3 * sec,
            "tokens_per_s": tok_s, "mfu": tok_s * flops_per_token(cfg, args.seq) / peak,
            "peak_GiB": torch.cuda.max_memory_allocated() / 2**30, "first_step_s": first_s,
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}]


def guarded(name: str, fn, *args) -> list[dict]:
    """``fn(*args)``: one measurement's rows; a failure prints its traceback and yields an
    error row."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - one failed row must not lose the others
        traceback.print_exc()
        return [{"row": name, "error": f"{type(e).__name__}: {e}"[:200]}]
    finally:
        torch.cuda.empty_cache()


def markdown(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cell = (lambda v: f"{v:.4g}" if isinstance(v, float) else str(v))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5, help="timed calls per decoder layer")
    ap.add_argument("--steps", type=int, default=5, help="timed training steps per layout")
    args = ap.parse_args()
    print(environment(), flush=True)
    cfg = preset(args.preset)
    layers = guarded("layers", layer_rows, args, cfg)
    write_results("compile_bench_layers", layers)
    steps: list[dict] = []
    for compiled, checkpointed in ((False, False), (True, False), (False, True), (True, True)):
        steps += guarded(f"step compile={compiled} activation_checkpointing={checkpointed}",
                         step_row, args, cfg, compiled, checkpointed)
        write_results("compile_bench_steps", steps)  # prints the new row, saves all so far
    print(f"\n{args.preset}, batch {args.batch} x {args.seq} tokens\n{markdown(layers)}\n\n"
          f"{markdown(steps)}", flush=True)


if __name__ == "__main__":
    main()
