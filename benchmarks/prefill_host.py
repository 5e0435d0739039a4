"""Where a prefill step's host time goes (issue P8): the serving engine's prefill is host-bound.

``serve_bench.py``'s profiles (twentieth session) show a warm request (1,024 new tokens after a
31,744-token cached prefix) at 123 ms wall around 18 ms of GPU work, and every prefill step of the
decode runs at 130-220 ms whatever its size (128 tokens of one prompt: 170 ms). This script runs
prefill steps of ``small`` through ``LLMEngine`` and prints, per case:

* ``wall_ms``: the step, synchronised before and after;
* ``execute_ms``: the host time of ``ModelRunner.execute`` alone (no synchronisation around it:
  where the host is the bound this is the step's cost; a synchronising op inside makes it wait
  for the GPU too);
* ``gpu_ms``: the step's GPU time by CUDA events around ``execute``;
* ``syncs``: the synchronising CUDA calls inside ``execute``
  (``torch.cuda.set_sync_debug_mode``), each with the innermost openk3/fla frame that made it;
* the host time of ``execute`` by module class (self time: a module's children are
  subtracted; forward pre/post hooks, no synchronisation), and the top Python functions by own
  time (cProfile).

Cases: one prompt of 128 and of 1,024 tokens, 64 prompts of 128 tokens packed in one step, and
1,024 tokens after a cached 31,744-token prefix. Each is run ``--repeats`` times after two
warm-up runs (kernels compiled, autotuned); the fastest is reported.

Run on the device: ``python benchmarks/prefill_host.py [--cases 1x128 1x1024 64x128 warm]``;
``--device cpu --preset debug`` checks the script.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import time
import traceback
import warnings

import torch

from benchmarks.common import environment, write_results
from openk3 import build_model, preset
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer

ROWS: list[dict] = []


def ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class ModuleTimer:
    """Host self time per module class during ``active``: pre/post forward hooks."""

    def __init__(self, model: torch.nn.Module):
        self.self_s: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.stack: list[list] = []  # [name, start, children's time]
        self.active = False
        self.handles = []
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(self._enter))
            self.handles.append(m.register_forward_hook(self._leave))

    def _enter(self, module, args):
        if self.active:
            self.stack.append([type(module).__name__, time.perf_counter(), 0.0])

    def _leave(self, module, args, output):
        if self.active and self.stack:
            name, start, children = self.stack.pop()
            total = time.perf_counter() - start
            self.self_s[name] += total - children
            self.calls[name] += 1
            if self.stack:
                self.stack[-1][2] += total

    def reset(self):
        self.self_s.clear()
        self.calls.clear()


def run_case(eng: LLMEngine, timer: ModuleTimer, prompts: list[list[int]], prefix: list[int] | None,
             on_cuda: bool, profile_it: bool) -> dict:
    """One prefill step of ``prompts`` (after running ``prefix`` alone, for the prefix cache)."""
    if prefix is not None:
        eng.add_request(prefix, SamplingParams(temperature=0, max_tokens=1))
        while eng.has_unfinished():
            eng.step()
    runner = eng.runner
    inner = runner.execute
    record: dict = {}
    syncs: list[str] = []

    def execute(out, *a, **kw):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        timer.active = True

        def show(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/openk3/" in f.filename or "/fla/" in f.filename]
            where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
            syncs.append(where)

        if on_cuda:
            torch.cuda.set_sync_debug_mode(1)
        t = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                if profile_it:
                    pr = cProfile.Profile()
                    pr.enable()
                    result = inner(out, *a, **kw)
                    pr.disable()
                    s = io.StringIO()
                    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
                    record["cprofile"] = s.getvalue()
                else:
                    result = inner(out, *a, **kw)
        finally:
            record["execute_ms"] = 1e3 * (time.perf_counter() - t)
            if on_cuda:
                torch.cuda.set_sync_debug_mode(0)
            timer.active = False
        if on_cuda:
            end.record()
            end.synchronize()
            record["gpu_ms"] = start.elapsed_time(end)
        return result

    runner.execute = execute
    try:
        for p in prompts:
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=1))
        if on_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        if on_cuda:
            torch.cuda.synchronize()
        record["wall_ms"] = 1e3 * (time.perf_counter() - t)
        while eng.has_unfinished():  # anything the one step did not finish (a long prompt's chunks)
            eng.step()
    finally:
        runner.execute = inner
    record["syncs"] = collections.Counter(syncs)
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", nargs="+", default=["1x128", "1x1024", "64x128", "warm"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=31744, help="the warm case's cached prefix")
    args = ap.parse_args()
    on_cuda = args.device == "cuda"
    print(environment())
    model = build_model(preset(args.preset), device=args.device,
                        dtype=torch.bfloat16 if on_cuda else torch.float32)
    vocab = model.cfg.vocab_size
    eng = LLMEngine(model, ByteTokenizer(), EngineConfig(max_num_seqs=64, max_model_len=args.prefix + 2048,
                                                         max_num_batched_tokens=16384),
                    eos_token_ids=())
    timer = ModuleTimer(eng.runner.model)
    seed = iter(range(1000, 10**6))
    for case in args.cases:
        if case == "warm":
            shared = ids(args.prefix, vocab, 1)

            def make():
                return [shared + ids(1024, vocab, next(seed))], shared
        else:
            n, t = map(int, case.split("x"))

            def make(n=n, t=t):
                return [ids(t, vocab, next(seed)) for _ in range(n)], None
        runs = []
        for rep in range(2 + args.repeats):  # two warm-ups, then the timed runs (the last profiled)
            timer.reset()
            prompts, prefix = make()
            rec = run_case(eng, timer, prompts, prefix, on_cuda, profile_it=rep == 1 + args.repeats)
            rec["modules"] = sorted(((1e3 * s, timer.calls[k], k) for k, s in timer.self_s.items()), reverse=True)
            runs.append(rec)
        best = min(runs[2:], key=lambda r: r["wall_ms"])
        best["cprofile"] = runs[-1].get("cprofile")
        row = {"case": case, "wall_ms": best["wall_ms"], "execute_ms": best["execute_ms"],
               "gpu_ms": best.get("gpu_ms"), "syncs": sum(best["syncs"].values()),
               "module_host_ms": round(sum(m[0] for m in best["modules"]), 2)}
        ROWS.append(row)
        write_results("prefill_host", ROWS)
        print(f"-- {case}: synchronising calls in execute: {dict(best['syncs'])}")
        print(f"-- {case}: host ms by module class (self time, calls):")
        for ms, calls, name in best["modules"][:16]:
            print(f"   {ms:8.2f} ms {calls:5d}  {name}")
        if best.get("cprofile"):
            print(f"-- {case}: cProfile of execute (one run), top by own time:")
            print("\n".join(best["cprofile"].splitlines()[:60]))


if __name__ == "__main__":
    main()
