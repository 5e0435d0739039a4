"""Context parallelism on the device: prints tables, peers in the same run. Launch with torchrun.

``kda``: one KDA layer's forward + backward over a sequence split over the ranks (bf16, the
``small`` preset's shape: 8 heads x 128), three ways: openk3's KCP with the correction
(``method="correct"``: one fla ``chunk_kda`` of width V + K, then a matmul), openk3's KCP that
reruns its shard from the incoming state (``"rerun"``), and fla-core's own ``cp_context``
(``build_cp_context``: a state-summary kernel, an all-gather, then the forward from the incoming
state). The first row is one GPU running the whole sequence alone. Also the largest output
difference of each against fla's ``cp_context`` (the same inputs on every path).

``model``: training steps of a model preset (default ``small``, bf16, batch 1 per data-parallel
group, activation checkpointing on) at each ``--seq-lens`` with each ``--cp`` (1: FSDP2 data
parallel over the ranks, every rank a whole sequence; 2: each sequence split over 2 ranks):
tokens/s over all ranks and the peak memory of rank 0. A configuration that runs out of memory
stops the script (the other ranks stop at their next collective): run the longest lengths last.

    torchrun --nproc-per-node 2 benchmarks/kcp_bench.py kda --seq-len 262144
    torchrun --nproc-per-node 2 benchmarks/kcp_bench.py model --seq-lens 131072 262144 --cp 1 2
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import time

import torch
import torch.distributed as dist

from openk3.ops.kda import kda
from openk3.parallel.context_parallel import ContextParallel
from openk3.parallel.kcp import kcp_kda


def _timed(fn, warmup: int, iters: int) -> float:
    """Seconds per call of ``fn`` (all ranks in step)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    return (time.perf_counter() - t0) / iters


def bench_kda(args) -> None:
    from fla.ops.cp import build_cp_context
    from fla.ops.kda import chunk_kda

    cp = ContextParallel()
    rank, P, dev = cp.rank, cp.size, torch.device("cuda", torch.cuda.current_device())
    T, H, K = args.seq_len, args.heads, args.head_dim
    if T % P:
        raise SystemExit(f"--seq-len {T} must be divisible by the {P} ranks (fla's cp_context)")
    g = torch.Generator(device=dev).manual_seed(0)
    full = [torch.randn(1, T, H, K, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(4)]
    beta = torch.rand(1, T, H, device=dev, generator=g).to(torch.bfloat16)
    A_log = torch.rand(H, device=dev, generator=g)
    dt_bias = torch.randn(H * K, device=dev, generator=g) * 0.1
    cot = torch.randn(1, T, H, K, device=dev, generator=g, dtype=torch.bfloat16)
    (q, k, v, f, b), cot_local = cp.split(*full, beta), cp.split(cot)[0]
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, f, b)]
    params = [A_log.requires_grad_(True), dt_bias.requires_grad_(True)]
    sh = cp.shard
    context = build_cp_context(torch.tensor([0, T], device=dev), group=cp.group)

    def own(method):
        return lambda: kcp_kda(*leaves, *params, cp=cp, lower_bound=-5.0,
                               continues=sh.continues, method=method)[0]

    def fla_cp():
        return chunk_kda(*leaves, A_log=params[0], dt_bias=params[1], use_gate_in_kernel=True,
                         use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                         cp_context=context)

    full_leaves = [t.detach().requires_grad_(True) for t in (*full, beta)]

    def single():
        return kda(*full_leaves, *params, lower_bound=-5.0)[0]

    def with_backward(forward, cotangent):
        return lambda: (forward() * cotangent).sum().backward()

    with torch.no_grad():
        want = fla_cp().float()
    paths = [("one GPU, whole sequence", single, cot, False),
             *((f"openk3 KCP {m}", own(m), cot_local, True) for m in ("correct", "rerun")),
             ("fla cp_context", fla_cp, cot_local, True)]
    results = []
    for name, forward, cotangent, compare in paths:
        torch.cuda.reset_peak_memory_stats()
        s = _timed(with_backward(forward, cotangent), args.warmup, args.iters)
        diff = float("nan")
        if compare:
            with torch.no_grad():
                diff = (forward().float() - want).abs().max().item()
        results.append((name, s, torch.cuda.max_memory_allocated() / 2**30, diff))
    if rank == 0:
        print(f"\nKDA forward+backward, T={T} over {P} ranks, H={H}, K=V={K}, bf16")
        print(f"{'path':<26}{'ms':>10}{'Mtok/s':>10}{'peak GiB':>10}{'max|o - fla cp|':>18}")
        for name, s, mem, diff in results:
            print(f"{name:<26}{1e3 * s:>10.2f}{T / s / 1e6:>10.2f}{mem:>10.2f}{diff:>18.3g}")


def bench_model(args) -> None:
    from openk3.train.config import RunConfig
    from openk3.train.trainer import build_training, setup_env, train_step

    if dist.get_rank() == 0:  # rows print as they are measured: a later OOM or time limit keeps them
        print(f"\n{args.preset} training, bf16, batch 1 per data-parallel group, "
              f"activation checkpointing {args.activation_checkpointing}, compile {args.compile}, "
              f"{dist.get_world_size()} GPUs")
        print(f"{'cp':>4}{'seq_len':>10}{'tok/s (all GPUs)':>20}{'s/step':>10}{'peak GiB rank 0':>18}",
              flush=True)
    for cp_size in args.cp:
        for T in args.seq_lens:
            cfg = RunConfig(preset=args.preset, seq_len=T, batch_size=1, cp=cp_size,
                            activation_checkpointing=args.activation_checkpointing,
                            compile=args.compile, max_steps=args.steps + 2, warmup_steps=1, balance="sign")
            env = setup_env(cfg)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            t = build_training(cfg, env, cfg.model_config())
            g = torch.Generator().manual_seed(t.parallel.dp_rank)
            batches = [torch.randint(0, t.model.cfg.vocab_size, (1, T + 1), generator=g)
                       for _ in range(args.steps + 1)]
            batches = [[(ids[:, :-1], ids[:, 1:])] for ids in batches]
            t0 = time.perf_counter()
            train_step(t, batches[0], cfg)  # warm-up (compilation, autotuning)
            torch.cuda.synchronize()
            if dist.get_rank() == 0:
                print(f"  (cp {cp_size}, {T} tokens: warm-up step {time.perf_counter() - t0:.1f} s, "
                      f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)", flush=True)
            t0 = time.perf_counter()
            for b in batches[1:]:
                train_step(t, b, cfg)
            torch.cuda.synchronize()
            s = (time.perf_counter() - t0) / args.steps
            tok_s = T * t.parallel.dp_size / s
            if dist.get_rank() == 0:
                print(f"{cp_size:>4}{T:>10}{tok_s:>20,.0f}{s:>10.2f}"
                      f"{torch.cuda.max_memory_allocated() / 2**30:>18.1f}", flush=True)
            del t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    k = sub.add_parser("kda")
    k.add_argument("--seq-len", type=int, default=262144)
    k.add_argument("--heads", type=int, default=8)
    k.add_argument("--head-dim", type=int, default=128)
    k.add_argument("--warmup", type=int, default=2)
    k.add_argument("--iters", type=int, default=5)
    m = sub.add_parser("model")
    m.add_argument("--preset", default="small")
    m.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144])
    m.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    m.add_argument("--steps", type=int, default=3)
    m.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    m.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compiled decoder-layer regions (default: the trainer's, on for CUDA); "
                        "--no-compile skips inductor's first-step minute")
    p.add_argument("--dump-after", type=float, default=0,
                   help="print every thread's stack after this many seconds (a hung collective "
                        "or a long autotuning shows where it is), then go on")
    args = p.parse_args()
    if args.dump_after:
        faulthandler.dump_traceback_later(args.dump_after)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    try:
        bench_kda(args) if args.part == "kda" else bench_model(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
