"""One AttnRes read's forward and backward in `small`'s training step (16,384 tokens, d = 1,024,
bf16), L sources of which all but the last are sealed bank entries read by later layers too:

* ``fla + adds``: fla-core's fused_attnres (its backward writes every source's gradient and an
  [N, D] fp32 ``dqw``), then the add of each sealed entry's gradient into the sum autograd keeps
  for it (what the step ran before sealing);
* ``sealed (rows R, warps W, tile T)``: openk3's accumulating read (``openk3/ops/attnres.py``):
  fla's forward, then one kernel that adds into the entries' accumulators, with R rows per
  program and W warps; tile 8192 holds all of a row's sources (each read once), tile 1024 one
  source (each row's sources read twice, the second time mostly from L1/L2).

Floor (backward): read the sources and the output's gradient, write each source's gradient,
read each accumulator: (3L - 1) x 32 MiB at ~4.3 TB/s. Times are the kernels' own (profiler): the
calls are host-bound alone (~1 ms each), as the graphed training step is not.
Results: docs/benchmarks.md.

Usage: python benchmarks/attnres_bench.py   (CUDA)"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import gpu_us  # noqa: E402


def main() -> None:
    import openk3.ops.attnres as ar
    from fla.ops.attnres import fused_attnres

    N, D = 16384, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    for L in (2, 4, 6):
        srcs = [torch.randn(N, D, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(L)]
        q = (torch.randn(D, device="cuda", generator=gen) * 0.1).requires_grad_()
        w = torch.ones(D, device="cuda", requires_grad=True)
        g = torch.randn(N, D, device="cuda", generator=gen).bfloat16()
        sums = [torch.zeros(N, D, device="cuda", dtype=torch.bfloat16) for _ in range(L - 1)]

        def fla_adds():
            out = fused_attnres(q, srcs, w, rms_eps=1e-6)
            grads = torch.autograd.grad(out, [q, w, *srcs], g)
            for s, gr in zip(sums, grads[2:]):
                s.add_(gr)

        accs = tuple([*(ar._BankGrad() for _ in range(L - 1)), None])
        for a, s in zip(accs, sums):
            a.grad = s

        def sealed():
            out = ar._AccumulatingRead.apply(q, w, 1e-6, True, accs, *srcs)
            torch.autograd.grad(out, [q, w, srcs[-1]], g)

        floor_us = (3 * L - 1) * N * D * 2 / 4.3e12 * 1e6
        print(f"L={L}: backward floor {floor_us:.0f} us; kernel time of forward + backward: fla + adds "
              f"{gpu_us(fla_adds)['total']:.0f} us", flush=True)
        default = ar.BWD_ROWS, ar.BWD_WARPS, ar.BWD_TILE
        for ar.BWD_ROWS, ar.BWD_WARPS, ar.BWD_TILE in ((8, 4, 8192), (4, 4, 8192), (16, 4, 8192), (8, 2, 8192),
                                                       (8, 4, 1024)):
            us = gpu_us(sealed)
            print(f"L={L}: sealed (rows {ar.BWD_ROWS}, warps {ar.BWD_WARPS}, tile {ar.BWD_TILE}) "
                  f"{us['total']:.0f} us; "
                  + ", ".join(f"{k[:40]} {v:.0f}" for k, v in us.items() if v > 5 and k != "total"), flush=True)
        ar.BWD_ROWS, ar.BWD_WARPS, ar.BWD_TILE = default
        plain = [s.detach() for s in srcs]
        fwd = gpu_us(lambda: fused_attnres(q.detach(), plain, w.detach(), rms_eps=1e-6))
        print(f"L={L}: forward alone {fwd['total']:.0f} us", flush=True)

if __name__ == "__main__":
    main()
