"""Timing helpers shared by the benchmark scripts (CUDA events, warm-up, median)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import traceback
from pathlib import Path

import torch


class TritonCompiles:
    """Within ``with``: every Triton kernel compiled (name, its specialisation as Triton prints
    it, and the openk3 frames that launched it), through Triton's post-compile hook; nothing
    when off or without Triton."""

    def __init__(self, on: bool):
        self.on, self.seen, self._knobs, self._before = on, [], None, None

    @property
    def tracked(self) -> bool:
        return self._knobs is not None

    def __enter__(self):
        if not self.on:
            return self
        try:
            from triton import knobs
        except ImportError:  # no Triton, or one without the hook (before 3.4)
            return self
        self._knobs, self._before = knobs, knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                      if "/openk3/" in f.filename.replace(os.sep, "/")]
            spec = " ".join(str(kwargs.get("repr", "")).split())[:400]  # Triton's repr spans lines
            self.seen.append((getattr(fn, "name", repr(fn)), spec, frames[-6:]))
            return self._before(*args, **kwargs) if self._before is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        return self

    def __exit__(self, *exc):
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._before


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


def gpu_us(fn, iters: int = 10) -> dict[str, float]:
    """Microseconds of GPU kernel time per call of ``fn``, by kernel name and in all ("total"),
    from the profiler: the launches' host time is left out (in the graphed training step the
    host does not wait on them)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = {e.key: e.self_device_time_total / iters for e in prof.key_averages() if e.self_device_time_total > 0}
    return kernels | {"total": sum(kernels.values())}


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


def profile(fn, label: str, rows: int = 20) -> dict:
    """Run ``fn`` once under the torch profiler and cProfile; print where the time goes.

    Prints the wall time against the GPU's busy time (the sum of kernel times), the number of
    kernel launches, the top ops by host time and by GPU time, and the top Python functions by
    own time. A wall time far above the busy time means the host (Python, dispatch, launches)
    bounds the step. Returns the three totals.
    """
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()  # anything lazy (compilation, autotuning, allocation) happens outside the profile
    sync()
    t = time.perf_counter()
    fn()
    sync()
    wall = time.perf_counter() - t
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
    with torch_profile(activities=activities) as prof:
        fn()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]  # not the optimizer's range
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    launches = sum(e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                              "cudaLaunchKernelExC") for e in prof.events())
    summary = {"profile": label, "wall_ms": 1e3 * wall, "gpu_busy_ms": 1e3 * busy,
               "kernels": len(kernels), "launch_calls": launches, **_gpu_idle(kernels, prof)}
    print(summary)
    _save_profile(label, kernels, prof)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=rows))
    print(table.table(sort_by="self_device_time_total", row_limit=rows))
    pr = cProfile.Profile()
    pr.enable()
    fn()
    sync()
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(rows)
    pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(rows)
    print(text.getvalue(), flush=True)
    return summary


def _gpu_idle(kernels: list, prof, top: int = 12) -> dict:
    """Where the GPU waits in the profiled call: idle time before its first kernel and after its
    last (from the first and to the last host event), and the longest gaps between kernels,
    each with the kernels on either side and the host ops that began in it (what the host was
    doing while the GPU had nothing queued)."""
    if not kernels:
        return {}
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    host = sorted((e.time_range.start, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CPU)
    gaps, end, prev = [], spans[0][1], spans[0][2]
    for a, b, name in spans[1:]:
        if a > end:
            gaps.append((a - end, end, prev[:60], name[:60]))
        if b > end:
            end, prev = b, name
    gaps.sort(reverse=True)
    detail = []
    for gap, at, before, after in gaps[:top]:
        ops = [n for t, n in host if at <= t < at + gap and not n.startswith("cuda")][:8]
        detail.append({"us": round(gap, 1), "after": before, "before": after, "host": ops})
    return {"idle_before_first_kernel_ms": (spans[0][0] - host[0][0]) / 1e3 if host else None,
            "idle_after_last_kernel_ms": (host[-1][0] - end) / 1e3 if host else None,
            "idle_between_kernels_ms": sum(g[0] for g in gaps) / 1e3, "longest_gaps": detail}


def _save_profile(label: str, kernels: list, prof) -> None:
    """On the device, save under $OUT every kernel name's GPU time and count and every op's own
    GPU time: enough to sort the whole step into categories offline, where the printed tables
    show only the top rows (which module launches what: ``benchmarks/train_census.py``)."""
    out = os.environ.get("OUT")
    if not out:
        return
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        row = by_kernel.setdefault(e.name, [0.0, 0])
        row[0] += e.time_range.elapsed_us()
        row[1] += 1
    ops = [{"op": a.key, "self_gpu_us": a.self_device_time_total, "calls": a.count}
           for a in prof.key_averages() if a.self_device_time_total > 0]
    name = "".join(c if c.isalnum() else "_" for c in label)
    with open(os.path.join(out, f"profile_{name}.json"), "w") as fh:
        json.dump({"kernels": sorted(([k, t, n] for k, (t, n) in by_kernel.items()), key=lambda r: -r[1]),
                   "ops": sorted(ops, key=lambda r: -r["self_gpu_us"])}, fh, indent=0)
