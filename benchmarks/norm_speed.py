"""GPU time of training's RMSNorm outside the compiled regions (issue P7): openk3's Triton
kernels (``rms_norm(backend="triton")``, what the step runs since the sixteenth session, at
several tile sizes), the reference compiled by inductor (what it ran before) and fla-core's
fused ``rms_norm`` on the same inputs, forward and forward + backward, with each one's error
against the fp32 reference.

    python benchmarks/norm_speed.py [--tokens 16384 --hidden 1024]

Defaults: `small` at batch 4 x 4096, bf16 activations, the fp32 weight of autocast training.
GPU kernel time from the profiler (``benchmarks.common.gpu_us``). Floor at the copy bandwidth
(~4.3 TB/s): forward x read + y written; backward x and dy read + dx written (the weight's
gradient partial sums are small). The numerics differ by one rounding: openk3 rounds the
normalised x to bf16 before the weight multiplies it (the checkpoint convention, K3_SPEC §1.1),
fla rounds once after; the errors against fp32 show what that costs.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import environment, gpu_us, rel_err, write_results
import openk3.ops.norm as norm_ops
from openk3.ops.norm import rms_norm

BANDWIDTH = 4.3e12
EPS = 1e-6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    print(environment())
    from fla.modules.norm.layernorm import rms_norm as fla_rms_norm

    N, D = args.tokens, args.hidden
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(D, device="cuda")).requires_grad_()
    dy = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)

    def tiled(fwd: int, bwd: int, per_sm: int):
        def run():
            norm_ops.FWD_ELEMENTS, norm_ops.BWD_ELEMENTS, norm_ops.BWD_PROGRAMS_PER_SM = fwd, bwd, per_sm
            return rms_norm(x, w, EPS, backend="triton")
        return run

    committed = (norm_ops.FWD_ELEMENTS, norm_ops.BWD_ELEMENTS, norm_ops.BWD_PROGRAMS_PER_SM)
    sweep = [(4096, b, p) for b in (1024, 2048, 4096) for p in (4, 8, 16)]
    norms = {f"openk3 triton {fe}/{be}/{p}": tiled(fe, be, p)
             for fe, be, p in [committed, (2048, 2048, 4)] + [t for t in sweep if t != committed]}
    norms |= {"openk3 reference (inductor)": lambda: rms_norm(x, w, EPS, backend="torch"),
              "fla rms_norm": lambda: fla_rms_norm(x, w, None, eps=EPS)}

    def step(norm, backward: bool):
        def run():
            with torch.autocast("cuda", torch.bfloat16):
                y = norm()
            if backward:
                torch.autograd.backward(y, dy)
        return run

    def outputs(norm) -> list[torch.Tensor]:
        x.grad = w.grad = None
        with torch.autocast("cuda", torch.bfloat16):
            y = norm()
        torch.autograd.backward(y, dy)
        return [y.detach().clone(), x.grad.clone(), w.grad.clone()]

    xf, wf = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * wf
    y_ref.backward(dy.float())
    want = [y_ref.detach(), xf.grad, wf.grad]
    size = N * D * 2
    floor = {"fwd_us": 2 * size / BANDWIDTH * 1e6, "bwd_us": 3 * size / BANDWIDTH * 1e6}
    rows = []
    for name, norm in norms.items():
        fwd, both = gpu_us(step(norm, False))["total"], gpu_us(step(norm, True))["total"]
        got = outputs(norm)
        row = {"variant": name, "fwd_us": fwd, "bwd_us": both - fwd, **{f"floor_{k}": v for k, v in floor.items()}}
        row |= {f"{k}_rel_err_vs_fp32": rel_err(g, r) for k, g, r in zip(("y", "dx", "dw"), got, want)}
        rows.append(row)
        print(f"{name:32s} fwd {fwd:7.1f} us  bwd {both - fwd:7.1f} us  (floors {floor['fwd_us']:.1f} / "
              f"{floor['bwd_us']:.1f})  errors vs fp32: y {row['y_rel_err_vs_fp32']:.1e} "
              f"dx {row['dx_rel_err_vs_fp32']:.1e} dw {row['dw_rel_err_vs_fp32']:.1e}")
    write_results("norm_speed", rows)


if __name__ == "__main__":
    main()
