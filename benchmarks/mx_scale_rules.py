"""MX scale rules compared: quantisation error of openk3's quantiser (the OCP rule, FLOOR) against
torchao's FLOOR, EVEN, RCEIL and CEIL modes, for MXFP4 (E2M1) and MXFP8 (E4M3).

    python benchmarks/mx_scale_rules.py              # CPU, a few seconds; needs torchao

For each distribution (Gaussian, Laplace, Student-t with 3 degrees of freedom: weights and
activations with heavier tails) it prints the relative RMS error ``|q(x) - x| / |x|`` of each
rule, and the mean relative error of each block's largest element, which FLOOR clips for
MXFP4 (|amax| / X lands in [4, 8), and (6, 8) saturates to 6). openk3's row must equal
torchao's FLOOR row exactly.
"""

from __future__ import annotations

import argparse

import torch

from openk3.ops.mx import fake_quant_mxfp4, fake_quant_mxfp8_e4m3


def torchao_qdq(x: torch.Tensor, elem_dtype: torch.dtype, mode) -> torch.Tensor:
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    scale, data = to_mx(x, elem_dtype, 32, mode)
    return to_dtype(data, scale, elem_dtype, 32, torch.float32)


def rel_error(q: torch.Tensor, x: torch.Tensor) -> float:
    return ((q - x).norm() / x.norm()).item()


def amax_error(q: torch.Tensor, x: torch.Tensor) -> float:
    """Mean over blocks of 32 of ``|q(a) - a| / |a|`` for the block's largest element ``a``."""
    xb, qb = x.reshape(-1, 32), q.reshape(-1, 32)
    i = xb.abs().argmax(-1, keepdim=True)
    a, b = xb.gather(-1, i), qb.gather(-1, i)
    return ((a - b).abs() / a.abs()).mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=1024)
    args = p.parse_args()
    from torchao.prototype.mx_formats.config import ScaleCalculationMode as Mode

    g = torch.Generator().manual_seed(0)
    shape = (args.rows, args.cols)
    dists = {
        "Gaussian": torch.randn(shape, generator=g),
        "Laplace": torch.distributions.Laplace(0.0, 1.0).sample(shape),
        "Student-t(3)": torch.distributions.StudentT(3.0).sample(shape),
    }
    modes = [Mode.FLOOR, Mode.EVEN, Mode.RCEIL, Mode.CEIL]
    print("relative RMS error; mean relative error of each block's largest element (MXFP4)")
    print("| data | rule | MXFP4 error | MXFP4 error of the block maxima | MXFP8 E4M3 error |")
    print("|---|---|---|---|---|")
    for name, x in dists.items():
        rows = {"openk3 (FLOOR)": (fake_quant_mxfp4(x), fake_quant_mxfp8_e4m3(x))}
        for mode in modes:
            rows[f"torchao {mode.value.upper()}"] = (torchao_qdq(x, torch.float4_e2m1fn_x2, mode),
                                                     torchao_qdq(x, torch.float8_e4m3fn, mode))
        same = all(torch.equal(a, b) for a, b in zip(rows["openk3 (FLOOR)"], rows["torchao FLOOR"]))
        for rule, (q4, q8) in rows.items():
            print(f"| {name} | {rule} | {rel_error(q4, x):.4f} | {amax_error(q4, x):.4f} "
                  f"| {rel_error(q8, x):.4f} |")
        print(f"| {name} | openk3 == torchao FLOOR bit for bit: {same} | | | |")


if __name__ == "__main__":
    main()
