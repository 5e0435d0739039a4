"""Where a warm request's time to first token goes, without a profiler (issue P8).

A profiler inflates exactly what is in question here (each ``cudaGraphLaunch`` took ~0.6 ms
under CUPTI against 8-20 us without it: ``benchmarks/graph_launch.py``). This script instead
marks points of one request's host path with ``time.perf_counter`` and, at the same moment, a
CUDA event on the stream: at each mark the host time (since the request began) and the GPU
time at which the stream reached the mark. Where the GPU time equals the host time, the GPU
had nothing queued and waited for the host; where it is later, the host ran ahead.

Marks: the request's start, ``add_request``, the scheduler's step, the runner's ``execute``,
each graph piece's replay and each eager part (the MLA layers' attention) of a piecewise
prefill graph, sampling, the end (synchronised). Then the same request once more with
``torch.cuda.set_sync_debug_mode("warn")``: every call that synchronises with the GPU, with
the openk3 frames that made it.

The engine and request are serve_bench's warm case: ``small`` (random weights, bf16), a
31,744-token cached prefix, a new 1,024-token tail per request.

Run on the device: ``python benchmarks/warm_timeline.py`` (JSON under $OUT: ``warm_timeline.json``).
``--host-profile``: instead, ten warm requests (the same prefix, new tails) under cProfile, the
functions by their own and their cumulative host time (cProfile's overhead inflates every call
alike: read shares, not milliseconds).
"""

from __future__ import annotations

import gc
import time
import traceback
import warnings

import torch

MARKS: list[tuple[str, float, torch.cuda.Event]] = []
ACTIVE = [False]


def mark(label: str) -> None:
    if ACTIVE[0] and not torch.cuda.is_current_stream_capturing():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        MARKS.append((label, time.perf_counter(), e))


def wrap(obj, name: str, label: str) -> None:
    fn = getattr(obj, name)

    def marked(*a, **k):
        mark(f"{label} begins")
        out = fn(*a, **k)
        mark(f"{label} ends")
        return out

    setattr(obj, name, marked)


def instrument_pieces() -> None:
    from openk3.serve import graphs

    def run(self, *values, before_eager=None):  # PiecewiseGraph.run, marked
        for static, value in zip(self.inputs, values):
            if value is not None:
                static.copy_(value, non_blocking=True)
        n_graph = n_part = 0
        for piece in self.pieces:
            if isinstance(piece, tuple):
                if before_eager is not None:
                    mark("  before_eager")
                    before_eager()
                    before_eager = None
                n_part += 1
                mark(f"  eager part {n_part}")
                part, out = piece
                graphs._fill(out, part())
            else:
                n_graph += 1
                mark(f"  graph piece {n_graph}")
                piece.replay()
        mark("  pieces launched")
        return self.outputs

    graphs.PiecewiseGraph.run = run


def timeline(eng, prompt) -> list[dict]:
    from openk3.serve.sampler import SamplingParams

    MARKS.clear()
    torch.cuda.synchronize()
    ACTIVE[0] = True
    t0 = time.perf_counter()
    mark("start")
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished():
        eng.step()
    mark("end of loop")
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    ACTIVE[0] = False
    start = MARKS[0][2]
    rows = [{"mark": label, "host_ms": 1e3 * (h - t0), "gpu_ms": start.elapsed_time(e)}
            for label, h, e in MARKS]
    rows.append({"mark": "synchronised", "host_ms": 1e3 * total, "gpu_ms": None})
    return rows


def sync_sites(eng, prompt) -> list[str]:
    """Every synchronising call of one request, with its openk3 frames."""
    from openk3.serve.sampler import SamplingParams

    sites: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f"{f.filename.split('openk3/')[-1]}:{f.lineno} {f.name}"
                  for f in traceback.extract_stack()[:-1] if "/openk3/" in f.filename]
        sites.append(f"{str(message).splitlines()[0]} <- {' <- '.join(reversed(frames[-4:]))}")

    saved = warnings.showwarning
    warnings.showwarning = show
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
            while eng.has_unfinished():
                eng.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    warnings.showwarning = saved
    return sites


def host_profile(eng, shared, vocab) -> None:
    import cProfile
    import io
    import pstats

    from benchmarks.serve_bench import random_ids, ttft

    tails = [random_ids(1024, vocab, 800 + s) for s in range(10)]
    prof = cProfile.Profile()
    times = []
    for tail in tails:
        prompt = shared + tail
        prof.enable()
        times.append(1e3 * ttft(eng, prompt))
        prof.disable()
    print("warm ttft ms under cProfile:", [round(t, 2) for t in times], flush=True)
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(45)
        print(out.getvalue(), flush=True)


def main() -> None:
    import sys

    from benchmarks.common import environment, write_results
    from benchmarks.serve_bench import engine, random_ids, ttft
    from openk3 import build_model, preset

    print(environment())
    torch.manual_seed(0)
    model = build_model(preset("small"), device="cuda", dtype=torch.bfloat16)
    vocab = model.cfg.vocab_size
    eng = engine(model, max_num_seqs=4, max_model_len=40000, cuda_graphs=True)
    ttft(eng, random_ids(2048, vocab, 0))
    shared = random_ids(31744, vocab, 5)
    ttft(eng, shared)
    for s in range(3):  # graphs, cuDNN plans, autotuning
        print("warm-up", s, 1e3 * ttft(eng, shared + random_ids(1024, vocab, 100 + s)), "ms", flush=True)
    if "--host-profile" in sys.argv[1:]:
        return host_profile(eng, shared, vocab)
    def counted(prompt) -> tuple[float, dict]:
        """``ttft`` in ms, and what happened meanwhile that a warm request should not meet:
        device allocations (cudaMalloc) and frees by the caching allocator, its retries, garbage
        collections by generation."""
        mem, gcs = torch.cuda.memory_stats(), [g["collections"] for g in gc.get_stats()]
        ms = 1e3 * ttft(eng, prompt)
        after = torch.cuda.memory_stats()
        return ms, {**{k: after[k] - mem[k] for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")},
                    "gc": [g["collections"] - c for g, c in zip(gc.get_stats(), gcs)]}

    plain, plain_counts = zip(*(counted(shared + random_ids(1024, vocab, 200 + s)) for s in range(5)))
    print("warm ttft ms, uninstrumented:", [round(t, 2) for t in plain], plain_counts, flush=True)
    fresh, fresh_counts = [], []  # as serve_bench measures it: each request the first hit of a new prefix
    for s in range(4):
        prefix = random_ids(31744, vocab, 500 + s)
        ttft(eng, prefix)
        ms, counts = counted(prefix + random_ids(1024, vocab, 600 + s))
        fresh.append(ms)
        fresh_counts.append(counts)
    print("warm ttft ms, uninstrumented, a new prefix each time:", [round(t, 2) for t in fresh], fresh_counts,
          flush=True)
    print("prefix cache:", vars(eng.block_manager.stats), "free blocks", eng.block_manager.num_free_blocks,
          flush=True)
    instrument_pieces()
    wrap(eng, "add_request", "add_request")
    wrap(eng.scheduler, "step", "scheduler.step")
    wrap(eng.runner, "execute", "runner.execute")
    for name in ("_before_forward", "_upload", "_prefill_batch"):
        wrap(eng.runner, name, f"  runner.{name}")
    wrap(eng, "_launch_sample", "engine._launch_sample")
    wrap(eng, "_sampled", "engine._sampled")
    runs = [timeline(eng, shared + random_ids(1024, vocab, 300 + s)) for s in range(3)]
    print("instrumented runs, ms:", [round(r[-1]["host_ms"], 2) for r in runs], flush=True)
    best = min(runs, key=lambda r: r[-1]["host_ms"])
    prefix = random_ids(31744, vocab, 700)
    ttft(eng, prefix)
    new_prefix = timeline(eng, prefix + random_ids(1024, vocab, 701))
    for title, rows in (("the same prefix again (best of 3)", best), ("a new prefix's first hit", new_prefix)):
        print(f"{title}:\n{'mark':32s} {'host ms':>8s} {'gpu ms':>8s} {'gpu-host':>8s}")
        for r in rows:
            g, h = r["gpu_ms"], r["host_ms"]
            gpu, lag = ("", "") if g is None else (f"{g:8.3f}", f"{g - h:8.3f}")
            print(f"{r['mark']:32s} {h:8.3f} {gpu:>8s} {lag:>8s}")
    sites = sync_sites(eng, shared + random_ids(1024, vocab, 400))
    print(f"{len(sites)} synchronising calls in one warm request:")
    for s in sites:
        print("  ", s)
    write_results("warm_timeline", [{"uninstrumented_ms": plain, "new_prefix_ms": fresh,
                                     "uninstrumented_counts": plain_counts, "new_prefix_counts": fresh_counts}, *best,
                                    *({"new_prefix": 1, **r} for r in new_prefix),
                                    *({"sync_site": s} for s in sites)])


if __name__ == "__main__":
    main()
