"""Sort a profile's kernels into kinds: ``python benchmarks/kernel_kinds.py profile_*.json``.

Reads what ``benchmarks.common.profile`` saves under $OUT (every kernel name's GPU time and
count) and prints GPU milliseconds and kernel counts per kind, most time first: where a graphed
step's time goes when the profiler cannot say which op launched a kernel.
"""

from __future__ import annotations

import json
import re
import sys

KINDS = (  # first match wins
    ("GEMMs (cuBLAS, CUTLASS)", r"nvjet|gemm|cutlass|sm90_xmma|cublas"),
    ("SDPA", r"sdpa|flash|fmha"),
    ("fla KDA", r"kda|gated_delta|chunk_|wy_|recompute"),
    ("short convolution", r"conv1d"),
    ("AttnRes", r"attnres"),
    ("inductor (compiled regions)", r"^triton_"),
    ("optimiser foreach", r"multi_tensor|foreach"),
    ("Muon's elementwise kernels", r"momentum_kernel|apply_update_kernel"),
    ("copies", r"memcpy|copy|Memcpy"),
    ("memsets", r"memset|Memset"),
    ("sort / top-k / k-th value", r"sort|Sort|topk|Topk|KthVal|radix|Radix|scan|Scan"),
    ("reductions", r"reduce|Reduce|norm"),
    ("index / scatter / gather", r"index|scatter|gather|Index|Scatter|Gather"),
    ("ATen elementwise", r"elementwise|Elementwise"),
    ("loss", r"cross|entropy|loss"),
)


def kind(name: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, name)), "other")


def kinds(kernels: list[list]) -> list[tuple[str, float, int]]:
    """(kind, microseconds, kernels) from ``[[name, microseconds, count], ...]``, most time first."""
    totals: dict[str, list] = {}
    for name, us, count in kernels:
        row = totals.setdefault(kind(name), [0.0, 0])
        row[0] += us
        row[1] += count
    return sorted(((k, us, n) for k, (us, n) in totals.items()), key=lambda r: -r[1])


def main(path: str) -> None:
    with open(path) as fh:
        rows = kinds(json.load(fh)["kernels"])
    print(f"{path}: {sum(r[1] for r in rows) / 1e3:.1f} ms, {sum(r[2] for r in rows)} kernels")
    for k, us, n in rows:
        print(f"{k:32s} {us / 1e3:8.1f} ms {n:7d}")


if __name__ == "__main__":
    main(*sys.argv[1:])
