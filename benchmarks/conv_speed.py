"""GPU time of training's short convolution (issue P7): openk3's Triton kernels against fla-core's
``causal_conv1d`` on the same inputs, forward and forward + backward, over a few block sizes;
and the training router's expert choice, ``torch.topk`` against the Triton kernel.

    python benchmarks/conv_speed.py [--batch 4 --seq 4096 --channels 1024]
    python benchmarks/conv_speed.py --varlen   # the serving prefill's kernel, by block size

Defaults: one of `small`'s three convolutions (q, k or v: 8 heads x 128) at batch 4 x 4096, bf16
activations, fp32 weights (autocast training). GPU kernel time from the profiler (the host's
launch time left out, as the graphed training step does). Floor at the copy bandwidth
(~4.3 TB/s): forward x read + y written, backward x and dy read + dx written (left out: the
backward's per-block dw sums, fp32 [B * T / 16, 4, C] at 16 positions a block, written and
reduced: a third of the floor's bytes more). "bwd" is forward + backward less forward: besides
the kernel it holds dw's reduction and the adds into x.grad and w.grad (the training step's
profile gives the kernel alone). The router: 16,384 tokens x 64 experts, k = 4; floor: the fp32
logits read once.
"""

from __future__ import annotations

import argparse

import torch

import openk3.ops.conv as conv_ops
from benchmarks.common import environment, gpu_us, rel_err, write_results
from openk3.ops.conv import causal_conv1d
from openk3.ops.router import router_topk

BANDWIDTH = 4.3e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--channels", type=int, default=1024)
    ap.add_argument("--varlen", action="store_true",
                    help="only the serving prefill's kernel: one 32K-token sequence with a state, "
                         "q|k|v of `small` (3,072 channels) as the fused projection's column slice")
    args = ap.parse_args()
    print(environment())
    if args.varlen:
        return varlen_blocks()
    B, T, C = args.batch, args.seq, args.channels
    x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(C, 1, 4, device="cuda", requires_grad=True)
    dy = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
    size = B * T * C * 2

    def step(backend: str, backward: bool):
        def run():
            with torch.autocast("cuda", torch.bfloat16):
                y, _ = causal_conv1d(x, w, backend=backend)
            if backward:
                torch.autograd.backward(y, dy)
        return run

    def grads(backend: str) -> list[torch.Tensor]:
        x.grad = w.grad = None
        step(backend, True)()
        return [x.grad.clone(), w.grad.clone()]  # later steps accumulate into .grad

    want = grads("fla")
    floor = {"fwd_us": 2 * size / BANDWIDTH * 1e6, "bwd_us": 3 * size / BANDWIDTH * 1e6}
    rows = []

    def measure(variant: str, backend: str) -> None:
        fwd, both = gpu_us(step(backend, False))["total"], gpu_us(step(backend, True))["total"]
        got = grads(backend)
        r = {"variant": variant, "fwd_us": fwd, "bwd_us": both - fwd, "fwd_bwd_us": both,
             "dx_rel_err_vs_fla": rel_err(got[0], want[0]), "dw_rel_err_vs_fla": rel_err(got[1], want[1])}
        rows.append(r)
        print(f"{r['variant']:56s} fwd {r['fwd_us']:7.1f} us  bwd {r['bwd_us']:7.1f} us  "
              f"(floors {floor['fwd_us']:.1f} / {floor['bwd_us']:.1f})  "
              f"dx {r['dx_rel_err_vs_fla']:.1e} dw {r['dw_rel_err_vs_fla']:.1e} vs fla", flush=True)

    measure("fla causal_conv1d", "fla")
    default = conv_ops.BWD_BLOCKS
    # the backward's (positions, channels, warps) per program
    for conv_ops.BWD_BLOCKS in [(16, 128, 1), (16, 64, 1), (32, 64, 1), (8, 128, 1), (16, 256, 1)]:
        measure(f"openk3 triton fwd {conv_ops.FWD_BLOCKS} bwd {conv_ops.BWD_BLOCKS}", "triton")
    conv_ops.BWD_BLOCKS = default

    N, E, k = B * T, 64, 4
    logits = torch.randn(N, E, device="cuda", requires_grad=True)
    bias = 0.01 * torch.randn(E, device="cuda")
    for backend in ("torch", "triton"):
        us = gpu_us(lambda: router_topk(logits, bias, k, backend=backend))["total"]
        rows.append({"variant": f"router choice with autograd, {backend}", "fwd_us": us,
                     "floor_us": N * E * 4 / BANDWIDTH * 1e6})
        print(f"router choice with autograd ({backend:6s}) {us:7.1f} us  (floor {N * E * 4 / BANDWIDTH * 1e6:.1f})")
    write_results("conv_speed", rows)


def varlen_blocks() -> None:
    """``conv_varlen_fwd_kernel`` (no autograd, a state, ``cu_seqlens``) over `small`'s fused
    q|k|v columns of a 1,024-token (a warm request's tail) and a 32K-token prefill, the
    projection's row of 4,232 columns, by block size, against fla's varlen kernel; floor: x read
    and y written once."""
    C, W = 3072, 4
    rows = []
    for T in (1024, 32768):
        proj = torch.randn(1, T, C + 1160, device="cuda", dtype=torch.bfloat16)
        x, w = proj[..., :C], torch.randn(C, 1, W, device="cuda")
        state = torch.zeros(1, C, W - 1, device="cuda")
        cu = torch.tensor([0, T], device="cuda")
        floor = 2 * T * C * 2 / BANDWIDTH * 1e6
        with torch.no_grad():
            want, _ = causal_conv1d(x, w, state, cu, backend="fla")
            us = gpu_us(lambda: causal_conv1d(x, w, state, cu, backend="fla"))["total"]
            rows.append({"tokens": T, "variant": "fla varlen", "fwd_us": us, "floor_us": floor})
            print(rows[-1], flush=True)
            default = conv_ops.VARLEN_BLOCKS
            for conv_ops.VARLEN_BLOCKS in [(32, 128, 4), (64, 128, 4), (16, 256, 4), (16, 128, 4), (32, 64, 2),
                                           (64, 64, 4), (8, 512, 4)]:
                fn = lambda: causal_conv1d(x, w, state, cu, backend="triton")  # noqa: E731
                us = gpu_us(fn)["total"]
                rows.append({"tokens": T, "variant": f"openk3 varlen {conv_ops.VARLEN_BLOCKS}", "fwd_us": us,
                             "floor_us": floor, "rel_err_vs_fla": rel_err(fn()[0], want)})
                print(rows[-1], flush=True)
            conv_ops.VARLEN_BLOCKS = default
    write_results("conv_varlen_speed", rows)

if __name__ == "__main__":
    main()
