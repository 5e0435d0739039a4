"""MoonEP vs expert parallelism without replication, MoE experts forward+backward on 2+ GPUs.

K3-like expert shapes scaled to two H200s: experts of width D = 3584 (K3's latent size) and
hidden F = 1024, E = 64 experts (32 per rank), top-4, S tokens per rank. Routing is drawn
per token (k distinct experts) from a skewed distribution:
  uniform — every expert equally likely;
  zipf    — p_e ~ rank^-1.2, experts in random order;
  hot     — rank 0's experts get 4x the probability of the others'.
Both systems run the same ``MoonEPExperts`` code; ``replicate=False`` sends every pair to its
expert's home rank (ragged receive sizes), ``replicate=True`` plans with MoonEP (every rank
processes exactly S*K pairs, with replicas of the hot experts copied in for the step).

Floor: 6 * D * F * S * K flops per rank forward (3 matmuls), x3 with backward; at S=16384, K=4
that is ~8.7 TFLOP per rank per step, ~11 ms at 800 TFLOP/s if perfectly balanced.

``--shape small|medium`` takes the routed experts of those presets instead (issue P14).

Run on the device: ``torchrun --nproc-per-node 2 -m benchmarks.moonep_ep [--shape small]``. Without CUDA it runs
on gloo/CPU (a check of the script at tiny shapes: ``--tokens 64 --experts 8 --dim 32 --hidden 16``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from benchmarks.common import cuda_time, write_results
from openk3 import preset
from openk3.model.moe import RoutedExperts
from openk3.parallel.expert_parallel import MoonEPExperts


def routing(kind: str, S: int, E: int, R: int, k: int, gen: torch.Generator) -> torch.Tensor:
    dev = gen.device
    p = torch.ones(E, device=dev)
    if kind == "zipf":
        p = (torch.arange(1, E + 1, device=dev, dtype=torch.float32) ** -1.2)[
            torch.randperm(E, device=dev, generator=gen)]
    elif kind == "hot":
        p[: E // R] = 4.0
    return torch.multinomial(p.expand(S, E), k, replacement=False, generator=gen)


def _preset_shape(name: str) -> tuple[int, int, int, int]:
    c = preset(name)
    return c.num_experts, c.num_experts_per_token, c.moe_latent_size or c.hidden_size, c.moe_intermediate_size


# --shape: (experts, top-k, input width, hidden size) of the routed experts
SHAPES = {"k3-scaled": lambda: (64, 4, 3584, 1024),
          "small": lambda: _preset_shape("small"), "medium": lambda: _preset_shape("medium")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="k3-scaled",
                    help="experts, top-k, input width (the MoE latent) and hidden size: K3's widths "
                         "with 64 experts (above), or a preset's routed experts")
    ap.add_argument("--experts", type=int, help="overrides the shape's")
    ap.add_argument("--topk", type=int, help="overrides the shape's")
    ap.add_argument("--dim", type=int, help="overrides the shape's")
    ap.add_argument("--hidden", type=int, help="overrides the shape's")
    args = ap.parse_args()
    for name, value in zip(("experts", "topk", "dim", "hidden"), SHAPES[args.shape]()):
        if getattr(args, name) is None:
            setattr(args, name, value)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, R = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = preset("k3").replace(num_experts=args.experts, num_experts_per_token=args.topk,
                               moe_intermediate_size=args.hidden)
    torch.manual_seed(0)
    with dev:
        full = RoutedExperts(cfg, args.dim).to(dtype)
        for w in full.parameters():
            torch.nn.init.normal_(w, std=0.02)
    layers = {rep: MoonEPExperts(full, replicate=rep) for rep in (False, True)}
    del full
    S, k = args.tokens, args.topk
    x = torch.randn(S, args.dim, device=dev, dtype=dtype, requires_grad=True)
    w = torch.rand(S, k, device=dev)
    rows = []
    for kind in ("uniform", "zipf", "hot"):
        gen = torch.Generator(device=dev).manual_seed(1 + rank)
        idx = routing(kind, S, args.experts, R, k, gen)
        for rep, layer in layers.items():
            def step():
                layer(x, idx, w).sum().backward()
            if cuda:
                sec = cuda_time(step, warmup=2, iters=10)
            else:
                step()
                t0 = time.perf_counter()
                step()
                sec = time.perf_counter() - t0
            t = torch.tensor([sec], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
            p = layer.last_plan
            load = p.rank_load().double()
            rows.append({"shape": args.shape, "routing": kind,
                         "system": "MoonEP" if rep else "EP (no replication)", "ranks": R, "tokens_per_rank": S, "ms": 1e3 * t.item(),
                         "Mtok_s_total": R * S / t.item() / 1e6,
                         "max_over_mean_rank_load": (load.max() / load.mean()).item(),
                         "replicas": p.num_replicas()})
            if rank == 0:
                print(rows[-1], flush=True)
    if rank == 0:
        write_results("moonep_ep", rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
