"""The serving engine's host (Python) work per sequence per decode step, with the model removed.

An ``LLMEngine`` over the ``debug`` preset (vocabulary cut to 512 ids so the little tensor work
left stays small) runs B = 1, 32, 128 sequences of a 128-token prompt; after the prefill and a
few warm-up steps it times N decode steps (default 128: output positions 8 .. 136, about the
``serve_bench`` decode run) and prints microseconds per sequence per step, in total and by phase.

Measured: everything ``LLMEngine.step`` does on the host around the forward pass: the
scheduler's plan (``schedule``), the engine's sampling call and its one ``tolist`` (``sample``:
greedy argmax over [B, 512] pre-made logits, a kernel on the GPU), log-probabilities (``logprobs``:
``log_softmax`` + top-k over the same logits, one host copy, ``Logprob`` objects), appending
tokens and finishing (``postprocess``), incremental detokenisation (``detokenize``), building the
``RequestOutput`` objects with stop-string checks (``output``), and the step's own glue
(``other``: the total minus the named phases).

Not measured: the model runner. Its ``execute`` is replaced by a stub (``execute``) that returns,
for the sequences due to sample, rows of pre-made logits whose argmax spells ASCII text (so
detokenisation and stop-string search see real text); the real runner's host work (building the
decode inputs, block-table uploads, CUDA-graph replay) and the forward pass are left out, as are
the async server's queues. The stub keeps the runner's contract (``StepResult.logits`` row i for
``sampled[i]``), so the engine's code is the one that runs on the GPU.

Variants: ``greedy`` (temperature 0, the serve_bench decode), ``logprobs`` (``logprobs=5``),
``stop`` (two stop strings that never match: the search and hold-back run every step), and
``sampled`` (temperature 0.8, top_p 0.95: the filtering runs on the CPU here, so that row mostly
measures tensor work, not Python).

Times are CPU time of the engine's thread (``time.thread_time_ns``), not wall time: on a shared
machine other processes' load then costs little (a descheduled thread accrues none; cache and
frequency effects remain), and the engine's Python work is single-threaded (torch runs on one
thread here). Phases come from timing wrappers on the engine's methods, whose own cost (measured
on a no-op, subtracted per call) is approximate; ``total`` is timed separately without them.
Each number is the fastest of ``--repeats`` runs. Run on a CPU:
``PYTHONPATH=. python benchmarks/engine_host_bench.py [--batch 1 32 128] [--steps 128]
[--variants greedy logprobs stop] [--profile 128]``. ``--profile B`` prints the cProfile top
functions of the greedy run at batch B.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict

import torch

from openk3 import build_model, preset
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.model_runner import StepResult
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer

PROMPT_LEN, WARMUP_STEPS, VOCAB = 128, 8, 512
TEXT = b"The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
VARIANTS = {
    "greedy": {"temperature": 0.0},
    "logprobs": {"temperature": 0.0, "logprobs": 5},
    "stop": {"temperature": 0.0, "stop": ("</answer>", "\nUser:")},
    "sampled": {"temperature": 0.8, "top_p": 0.95},
}
# (phase, attribute path from the engine); nested phases are timed exclusive of their children
PHASES = [("schedule", "scheduler.step"), ("execute", "runner.execute"), ("sample", "_sample"),
          ("logprobs", "_record_logprobs"), ("postprocess", "scheduler.postprocess"),
          ("output", "_output"), ("detokenize", "_detokenize")]


class StubExecute:
    """``ModelRunner.execute`` without a model: the sequences whose tokens are all computed get
    pre-made logits; step t's row i peaks at byte ``TEXT[(t + i) % len(TEXT)]``."""

    def __init__(self, max_rows: int):
        period = len(TEXT)
        self.bank = torch.randn(period, max_rows, VOCAB).mul_(0.1)
        for t in range(period):
            for i in range(max_rows):
                self.bank[t, i, TEXT[(t + i) % period]] = 10.0
        self.calls = 0

    def __call__(self, out, draft_tokens=None) -> StepResult:
        sampled = [s for s, _ in out.scheduled if s.num_computed_tokens == s.num_tokens]
        logits = self.bank[self.calls % len(self.bank), :len(sampled)]
        self.calls += 1
        return StepResult(logits, sampled=sampled)


clock = time.thread_time_ns


class PhaseTimer:
    """Wraps engine methods; accumulates each phase's own time (children excluded) and calls."""

    def __init__(self):
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._child_ns: list[int] = []

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self._child_ns.append(0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                child = self._child_ns.pop()
                self.ns[name] += dt - child
                self.calls[name] += 1
                if self._child_ns:
                    self._child_ns[-1] += dt
        return timed

    @staticmethod
    def overhead_ns(n: int = 20000) -> float:
        """CPU time one wrapped call adds (the fastest of a few rounds)."""
        timed = PhaseTimer().wrap("noop", lambda: None)
        rounds = []
        for _ in range(5):
            t0 = clock()
            for _ in range(n):
                timed()
            rounds.append((clock() - t0) / n)
        return min(rounds)

    def install(self, eng: LLMEngine) -> None:
        for name, path in PHASES:
            *owner_path, attr = path.split(".")
            owner = eng
            for part in owner_path:
                owner = getattr(owner, part)
            if hasattr(owner, attr):
                setattr(owner, attr, self.wrap(name, getattr(owner, attr)))


def make_engine(model, batch: int, max_tokens: int) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT_LEN,
                       max_model_len=PROMPT_LEN + max_tokens, physical_block_size=256, hash_block_size=64,
                       kda_checkpoint_interval=256, num_kda_checkpoints=16, cuda_graphs=False)
    eng = LLMEngine(model, ByteTokenizer(), cfg, eos_token_ids=())
    eng.runner.execute = StubExecute(batch)
    return eng


def run(model, batch: int, steps: int, variant: str, timer: PhaseTimer | None = None,
        profiler: cProfile.Profile | None = None) -> float:
    """CPU seconds of ``steps`` decode steps of ``batch`` sequences (all decoding, none finishing)."""
    max_tokens = 1 + WARMUP_STEPS + steps + 1
    eng = make_engine(model, batch, max_tokens)
    params = SamplingParams(max_tokens=max_tokens, **VARIANTS[variant])
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        eng.add_request(torch.randint(32, 127, (PROMPT_LEN,), generator=g).tolist(), params)
    for _ in range(1 + WARMUP_STEPS):  # the prefill, then decodes
        eng.step()
    if timer is not None:
        timer.install(eng)
    if profiler is not None:
        profiler.enable()
    t0 = clock()
    for _ in range(steps):
        outs = eng.step()
    elapsed = (clock() - t0) / 1e9
    if profiler is not None:
        profiler.disable()
    if len(outs) != batch or any(o.finished for o in outs):
        raise RuntimeError(f"batch {batch}: expected {batch} running outputs, got {len(outs)}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="the fastest of this many runs (the machine may be shared)")
    ap.add_argument("--variants", nargs="+", default=["greedy", "logprobs", "stop"], choices=list(VARIANTS))
    ap.add_argument("--profile", type=int, metavar="B", help="cProfile the greedy run at batch B")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(preset("debug").replace(vocab_size=VOCAB)).eval()

    if args.profile:
        prof = cProfile.Profile()
        with torch.inference_mode():
            run(model, args.profile, args.steps, "greedy", profiler=prof)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())
        return

    names = [n for n, _ in PHASES] + ["other"]
    overhead = PhaseTimer.overhead_ns()
    print(f"CPU us per sequence per decode step ({args.steps} steps, torch threads 1, "
          f"{overhead:.0f} ns per timed call subtracted)")
    print(f"{'variant':>9} {'B':>4} {'total':>7} | " + " ".join(f"{n:>11}" for n in names))
    for variant in args.variants:
        for batch in args.batch:
            per = batch * args.steps
            total = min(run(model, batch, args.steps, variant) for _ in range(args.repeats))
            phase_ns = {}
            for _ in range(args.repeats):
                timer = PhaseTimer()
                wrapped_ns = run(model, batch, args.steps, variant, timer) * 1e9
                timer.ns["other"] = wrapped_ns - sum(timer.ns.values())
                for n, calls in timer.calls.items():
                    timer.ns[n] -= calls * overhead
                phase_ns = {n: min(phase_ns.get(n, v), v) for n, v in timer.ns.items()}
            cols = [phase_ns.get(n, 0) / 1e3 / per for n in names]
            print(f"{variant:>9} {batch:>4} {total * 1e6 / per:7.2f} | " + " ".join(f"{c:11.2f}" for c in cols),
                  flush=True)


if __name__ == "__main__":
    main()
