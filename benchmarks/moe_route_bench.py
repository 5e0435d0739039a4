"""The grouped experts of a prefill pass at `small`'s layer (64 experts, k = 4, 512 -> 256):
the routing, ``group_pairs``' two Triton kernels against the sort-based path they replace
(``sort_pairs``, the inverse permutation, the offsets); the experts, openk3's grouped Triton
kernels (``moe_grouped_triton``, by block sizes) against ``grouped_mm``; and
``RoutedExperts.forward_sorted`` with each combination.

GPU time only: each variant is captured in a CUDA graph of ``REPS`` calls and replayed between
events, so host launch time is not counted (the prefill passes are graphs too). Sizes: 32 tokens
(a batch-8 verify pass at K = 3: 128 pairs), 256, 1,024 (a warm request's tail), 4,096, 16,384
(the most the routing kernels take, 65,536 pairs), 32,768 (a cold 32K pass in one chunk). The
routing kernels run with their histogram tile at its widest (what ``group_pairs`` launches: one
compile for every size) and at the narrowest the blocks fit (``route_kernels_narrow_us``: what
they launched before the thirty-fifth session, one compile per power of two of blocks).

Run on the device: ``python benchmarks/moe_route_bench.py`` (JSON under $OUT: ``moe_route_bench.json``).
"""

from __future__ import annotations

import contextlib

import torch

from openk3 import preset
from openk3.model.moe import RoutedExperts, run_experts
from openk3.ops import moe as moe_ops
from openk3.ops.moe_grouped_triton import grouped_experts_triton
from openk3.ops.moe_kernels import group_pairs_triton, route_block

REPS = 20


def gpu_us(fn) -> float:
    """Median GPU time of one ``fn()`` over 5 replays of a graph of REPS calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(1e3 * a.elapsed_time(b) / REPS)
    return sorted(times)[2]


@contextlib.contextmanager
def limits(route: int, grouped: int):
    """``group_pairs``' and ``run_experts``' thresholds set for the block (0: the torch paths)."""
    saved = moe_ops.ROUTE_MAX_PAIRS, moe_ops.GROUPED_TRITON_MAX_PAIRS
    moe_ops.ROUTE_MAX_PAIRS, moe_ops.GROUPED_TRITON_MAX_PAIRS = route, grouped
    try:
        yield
    finally:
        moe_ops.ROUTE_MAX_PAIRS, moe_ops.GROUPED_TRITON_MAX_PAIRS = saved


def main() -> None:
    from benchmarks.common import environment, write_results

    print(environment())
    cfg = preset("small")
    E, k = cfg.num_experts, cfg.num_experts_per_token
    ex = RoutedExperts(cfg, cfg.moe_latent_size).to("cuda", torch.bfloat16)
    for w in (ex.w1, ex.w3, ex.w2):
        torch.nn.init.normal_(w, std=0.02)
    act = dict(hidden_act=cfg.hidden_act, situ_beta1=cfg.situ_beta1, situ_beta2=cfg.situ_beta2)
    big = 1 << 30
    rows = []
    for N in (32, 256, 1024, 4096, 16384, 32768):
        g = torch.Generator(device="cuda").manual_seed(N)
        topk_idx = torch.rand(N, E, device="cuda", generator=g).topk(k).indices
        topk_weight = torch.rand(N, k, device="cuda", generator=g)
        x = torch.randn(N, cfg.moe_latent_size, device="cuda", dtype=torch.bfloat16, generator=g)
        row = {"tokens": N, "pairs": N * k}
        with torch.no_grad():
            with limits(0, 0):
                row["sort_us"] = gpu_us(lambda: moe_ops.group_pairs(topk_idx, E))
            if N * k <= moe_ops.ROUTE_MAX_PAIRS:
                row["route_kernels_us"] = gpu_us(lambda: moe_ops.group_pairs(topk_idx, E))
                narrow = 1 << (-(-N * k // route_block(E)) - 1).bit_length()
                row["route_kernels_narrow_us"] = gpu_us(lambda: group_pairs_triton(topk_idx, E, narrow))
            for name, route, grouped in (("sort_grouped_mm", 0, 0), ("route_grouped_mm", big, 0),
                                         ("route_triton", big, big)):
                with limits(route, grouped):
                    row[f"experts_{name}_us"] = gpu_us(lambda: ex.forward_sorted(x, topk_idx, topk_weight))
            _, token, counts, ends = moe_ops.group_pairs(topk_idx, E)
            xs = x[token]
            with limits(0, 0):
                row["run_experts_grouped_mm_us"] = gpu_us(
                    lambda: run_experts(cfg, ex.w1, ex.w3, ex.w2, xs, counts, ends=ends))
            for blocks in ((64, 128, 64, 8, 3), (64, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3),
                           (32, 128, 64, 4, 3)):
                key = f"run_experts_triton_{'_'.join(map(str, blocks))}_us"
                try:
                    row[key] = gpu_us(lambda: grouped_experts_triton(xs, ends, ex.w1, ex.w3, ex.w2, **act,
                                                                     blocks=blocks))
                except Exception as e:  # noqa: BLE001 - a block size the GPU cannot hold
                    row[key] = f"failed: {str(e).splitlines()[0][:80]}"
        rows.append(row)
        print(row, flush=True)
    write_results("moe_route_bench", rows)


if __name__ == "__main__":
    main()
