"""Timing helpers shared by the benchmark scripts (CUDA events, warm-up, median)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch


def cuda_time(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds per call of ``fn`` on the current CUDA device."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
           "torch": torch.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    for mod in ("triton", "fla", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing optional package is just not reported
            pass
    return env


def write_results(name: str, rows: list[dict]) -> None:
    """Print a table and, on the device, save JSON under $OUT."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows[-1:] if len(rows) > 1 else rows:
        print(" | ".join(f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                         for k in keys), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"{name}.json"), "w") as fh:
            json.dump({"env": environment(), "rows": rows}, fh, indent=1)
