"""Speculative verification at one KDA layer: the two ways to roll the recurrent state back to
the last accepted token (``openk3/ops/kda/verify.py``), timed against each other and against
the forward alone.

Per row (B sequences, a segment of T = K + 1 positions, H heads of K = V = 128, bf16 activations):

* ``verify_ms``: ``kda_verify`` without states, the forward a verifier runs anyway (the floor);
* ``snapshot_ms``: ``kda_verify`` keeping the T per-position states, then ``rollback_snapshot_``;
* ``recompute_ms``: ``kda_verify`` without states, then ``rollback_recompute_`` (a second, masked
  pass over the segment from the saved initial state);
* ``chunk_ms``: the peer, the layer's ordinary path ``kda`` over the same T tokens with its final
  state (``chunk_kda`` on the GPU), i.e. what a verifier without rollback would call;
* ``snapshot_MiB`` / ``recompute_MiB``: memory each strategy holds until sampling ends, for this
  layer: ``B*T*H*K*V*4`` bytes of states vs ``B*T*(4*H*K*2 + 4*H)`` bytes of saved q, k, v, f
  (bf16) and beta (fp32);
* ``state_diff``: relative difference between the two strategies' rolled-back states.

Floor: state traffic. Each sequence's state is H*K*V*4 bytes (6 MiB at K3's 96 heads); the
verify forward reads it once, the snapshot strategy writes T of them and copies one, the
recompute strategy reads it again and writes one: (T + 3) vs 3 state-sizes per sequence.

Run from the repository root, on the device: ``python -m benchmarks.kda_rollback_bench``; on a
CPU with tiny shapes: ``python -m benchmarks.kda_rollback_bench --device cpu``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import cuda_time, environment, rel_err, write_results
from openk3.ops.kda import kda, kda_verify, rollback_recompute_, rollback_snapshot_


def cpu_time(fn, warmup: int = 1, iters: int = 5) -> float:
    """Median seconds per call of ``fn`` on the host."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def segment(B, T, H, K, device, seed=0):
    """One layer's verification inputs: bf16 activations, fp32 gate parameters and beta."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=g)

    x = {"q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, H, K),
         "f": randn(B, T, H * K), "beta": torch.rand(B, T, H, device=device, generator=g),
         "A_log": torch.empty(H, device=device).uniform_(0, 2, generator=g),
         "dt_bias": 0.5 * randn(H * K)}
    return {n: t.bfloat16() if n in ("q", "k", "v", "f") else t for n, t in x.items()}


def run(B: int, T: int, H: int, K: int, device: str) -> dict:
    timer = cuda_time if device == "cuda" else cpu_time
    x = segment(B, T, H, K, device, seed=B * T)
    slots = torch.arange(B, device=device)
    pool = torch.randn(B + 1, H, K, K, device=device)
    saved = pool.clone()
    num_kept = torch.randint(1, T + 1, (B,), device=device)

    def verify(output_states):
        return kda_verify(**x, initial_state=pool[slots], output_states=output_states)

    def snapshot():
        _, states = verify(True)
        rollback_snapshot_(pool, slots, states, num_kept)

    def recompute():
        verify(False)
        rollback_recompute_(pool, slots, num_kept, **x)

    def chunk():
        kda(**x, initial_state=pool[slots], output_final_state=True)

    row = {"device": device, "B": B, "T": T, "H": H}
    with torch.inference_mode():
        row["verify_ms"] = 1e3 * timer(lambda: verify(False))
        row["snapshot_ms"] = 1e3 * timer(snapshot)
        row["recompute_ms"] = 1e3 * timer(recompute)
        row["chunk_ms"] = 1e3 * timer(chunk)
        pool.copy_(saved)  # both strategies once more from the same S_0, for the difference
        snapshot()
        by_snapshot = pool.clone()
        pool.copy_(saved)
        recompute()
        row["state_diff"] = rel_err(pool[slots], by_snapshot[slots])
    row["snapshot_MiB"] = B * T * H * K * K * 4 / 2**20
    row["recompute_MiB"] = B * T * (4 * H * K * 2 + 4 * H) / 2**20
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--batch", type=int, nargs="+", help="B (default: 1 16 64 on cuda, 3 on cpu)")
    ap.add_argument("--T", type=int, nargs="+", help="segment length K + 1 (default: 2 4 8 on "
                    "cuda, 4 on cpu)")
    ap.add_argument("--heads", type=int, help="H (default: K3's 96 on cuda, 2 on cpu)")
    ap.add_argument("--head-dim", type=int, help="K = V (default: 128 on cuda, 16 on cpu)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU; use --device cpu")
    tiny = args.device == "cpu"
    batches = args.batch or ([3] if tiny else [1, 16, 64])
    lengths = args.T or ([4] if tiny else [2, 4, 8])
    H = args.heads or (2 if tiny else 96)
    K = args.head_dim or (16 if tiny else 128)
    print(environment())
    rows = []
    for B in batches:  # results are written after every row: a timeout keeps what finished
        for T in lengths:
            rows.append(run(B, T, H, K, args.device))
            write_results("kda_rollback_bench", rows)


if __name__ == "__main__":
    main()
