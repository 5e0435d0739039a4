"""KDA at K3 layer shape (96 heads x 128, bf16): fla-core fast path vs the PyTorch chunk reference.

Floor: chunk_kda is matmul-bound at ~ (4*C*K + 4*K*V) flops per token per head for the
intra-chunk and state products (C = 64): 96 heads x (4*64*128 + 4*128*128) x 2 ~ 0.03 GFLOP per
token forward, i.e. ~27M tokens/s at 800 TFLOP/s; the real kernel also does WY solves and
gate work, so a few M tokens/s is the practical range.

Run on the device: ``python benchmarks/kda_bench.py [--T 1024 4096 8192]``.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time, environment, rel_err, write_results
from openk3.ops.kda import kda


def inputs(B, T, H, K, dtype, lower_bound, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, K, device="cuda", generator=g).to(dtype) for _ in range(3))
    f = torch.randn(B, T, H, K, device="cuda", generator=g).to(dtype)
    beta = torch.rand(B, T, H, device="cuda", generator=g).to(dtype)
    A_log = torch.empty(H, device="cuda").uniform_(0, 2.7, generator=g)
    dt_bias = torch.randn(H * K, device="cuda", generator=g) * 0.5
    return [q, k, v, f, beta, A_log, dt_bias]


def run(T: int, H: int, K: int, lower_bound: float | None) -> dict:
    x = inputs(1, T, H, K, torch.bfloat16, lower_bound)
    for t in x:
        t.requires_grad_(True)
    kw = dict(lower_bound=lower_bound, output_final_state=True)

    def fwd(backend):
        with torch.no_grad():
            return kda(*x, backend=backend, **kw)

    def fwd_bwd(backend):
        o, S = kda(*x, backend=backend, **kw)
        (o.float().square().mean() + S.square().mean()).backward()

    row = {"T": T, "H": H, "gate": "bounded -5" if lower_bound else "softplus"}
    row["fla_fwd_ms"] = 1e3 * cuda_time(lambda: fwd("fla"))
    print(row, flush=True)  # partial rows: a timeout keeps what was measured
    row["fla_fwdbwd_ms"] = 1e3 * cuda_time(lambda: fwd_bwd("fla"))
    print(row, flush=True)
    row["fla_fwd_Mtok_s"] = T / row["fla_fwd_ms"] / 1e3
    row["fla_fwdbwd_Mtok_s"] = T / row["fla_fwdbwd_ms"] / 1e3
    row["ref_fwd_ms"] = 1e3 * cuda_time(lambda: fwd("torch"), warmup=1, iters=2)
    row["ref_fwdbwd_ms"] = 1e3 * cuda_time(lambda: fwd_bwd("torch"), warmup=1, iters=2)
    row["speedup_fwdbwd"] = row["ref_fwdbwd_ms"] / row["fla_fwdbwd_ms"]

    # accuracy: fla on bf16 inputs vs the fp32 reference on the same (bf16-rounded) values
    xf = [t.detach().float().requires_grad_(True) for t in x]
    o_ref, S_ref = kda(*xf, backend="torch", **kw)
    go = torch.randn_like(o_ref)
    grads_ref = torch.autograd.grad((o_ref * go).sum(), xf[:5])
    xb = [t.detach().requires_grad_(True) for t in x]
    o, S = kda(*xb, backend="fla", **kw)
    grads = torch.autograd.grad((o.float() * go).sum(), xb[:5])
    row["err_o"] = rel_err(o, o_ref)
    row["err_state"] = rel_err(S, S_ref)
    for name, a, b in zip("q k v f beta".split(), grads, grads_ref):
        row[f"err_d{name}"] = rel_err(a, b)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 4096, 1024])
    ap.add_argument("--softplus-T", type=int, nargs="*", default=[8192],
                    help="lengths at which the Kimi Linear softplus gate is also measured")
    ap.add_argument("--heads", type=int, default=96)
    args = ap.parse_args()
    print(environment())
    cases = [(T, -5.0) for T in args.T] + [(T, None) for T in args.softplus_T]
    rows = []
    for T, lb in cases:  # results are written after every row: a timeout keeps what finished
        rows.append(run(T, args.heads, 128, lb))
        write_results("kda_bench", rows)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
