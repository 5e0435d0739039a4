"""How long a CUDA graph's launch holds the host, and how long the GPU waits for it (issue P8).

A graph replaces a kernel's host round (Python, dispatch, launch) by its share of one
``cudaGraphLaunch``; but that launch is not free, and while the host is in it the GPU may sit
idle: a batch-1 decode step is one graph of ~500 kernels that starts after the last step's
sampled ids reach the host, and a prefill pass is seven graphs with eager attention between
them. For each graph this prints:

* ``host_us``: the time ``replay()`` takes to return (the GPU idle, the stream empty);
* ``alone_us``: replay to the end of its work, from an idle GPU (what a step that starts after
  a synchronisation pays);
* ``queued_us``: the graph's own GPU time, its launch hidden behind a GPU sleep that was
  queued first (events around the graph);
* ``exposed_us`` = alone - queued: the launch's cost the GPU waits for.

Graphs: synthetic chains of N one-element additions (N = 32 .. 2048), then the engine's own
graphs for ``small`` (random weights, bf16): the batch-1 decode step and the pieces of a
1,024-token prefill pass, and the decode step replayed as the engine runs it (``step_us``).

Run on the device: ``python benchmarks/graph_launch.py`` (JSON under $OUT: ``graph_launch.json``).
"""

from __future__ import annotations

import statistics
import time

import torch

REPS = 30


def measure(replay, label: str, **extra) -> dict:
    """Median host, alone and queued times of ``replay()`` (which launches one graph)."""
    sync = torch.cuda.synchronize
    host, alone, queued = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPS):
        sync()
        t = time.perf_counter()
        replay()
        host.append(time.perf_counter() - t)
        sync()
        alone.append(time.perf_counter() - t)
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time: the launch below is queued behind it
        start.record()
        replay()
        end.record()
        sync()
        queued.append(start.elapsed_time(end) / 1e3)
    row = {"graph": label, **extra, "host_us": 1e6 * statistics.median(host),
           "alone_us": 1e6 * statistics.median(alone), "queued_us": 1e6 * statistics.median(queued)}
    row["exposed_us"] = row["alone_us"] - row["queued_us"]
    print(row, flush=True)
    return row


def synthetic(n: int) -> dict:
    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            x.add_(1)
    return measure(g.replay, f"chain of {n} additions", nodes=n)


def engine_graphs() -> list[dict]:
    from benchmarks.serve_bench import engine, random_ids
    from openk3 import build_model, preset
    from openk3.serve.engine import SamplingParams
    from openk3.serve.graphs import CapturedGraph, PiecewiseGraph

    torch.manual_seed(0)
    model = build_model(preset("small"), device="cuda", dtype=torch.bfloat16)
    eng = engine(model, max_num_seqs=4, max_model_len=8192, cuda_graphs=True)
    vocab = model.cfg.vocab_size
    eng.generate([random_ids(1024, vocab, 1)], SamplingParams(temperature=0, max_tokens=8))
    rows = []
    # the decode step as the engine runs it: steps of one sequence, each from a synchronised host
    rid = eng.add_request(random_ids(128, vocab, 2), SamplingParams(temperature=0, max_tokens=64))
    eng.step()  # the prefill
    steps = []
    while rid in eng.requests:
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    rows.append({"graph": "engine decode step, batch 1", "step_us": 1e6 * statistics.median(steps[4:])})
    print(rows[-1], flush=True)
    runner = eng.runner
    for key, g in runner._graphs.items():
        if isinstance(g, CapturedGraph):
            rows.append(measure(g.graph.replay, f"decode graph, batch bucket {key}"))
    for key, g in sorted(runner._prefill_graphs.items())[-1:]:  # the 1,024-token pass
        if isinstance(g, PiecewiseGraph):
            pieces = [p for p in g.pieces if isinstance(p, torch.cuda.CUDAGraph)]
            for i, p in enumerate(pieces):
                rows.append(measure(p.replay, f"prefill pass of {key} tokens, piece {i + 1} of {len(pieces)}"))
    return rows


def main() -> None:
    from benchmarks.common import environment, write_results

    print(environment())
    rows = [synthetic(n) for n in (32, 128, 512, 2048)]
    rows += engine_graphs()
    write_results("graph_launch", rows)


if __name__ == "__main__":
    main()
