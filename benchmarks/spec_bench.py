"""Speculative decoding in the engine: acceptance and speed-up of drafts over plain decoding.

For a target (a training run or HF checkpoint directory, or a preset with random weights) and
one or more drafts (EAGLE-3 draft directories from ``openk3 train-draft``, ``mtp`` for the
target's own MTP layer, ``random`` for an untrained EAGLE-3 draft, ``self`` for the target as its
own separate draft model (every draft accepted: the ``Drafter`` path at full acceptance), or a
separate draft model's directory), the engine generates ``--max-tokens`` tokens for each of
``--num-prompts`` prompts taken from the embedded corpus (``openk3/train/corpus.py``: the stdlib,
tokenised with the target's tokenizer), at every temperature, batch size (``max_num_seqs``: at
most that many requests run at once) and K of the arguments, and without speculation (K = 0) in
the same run as the baseline. Stop tokens are off, so every request generates exactly
``--max-tokens`` tokens.

Columns:
    accepted/verify: accepted draft tokens per verify step of one sequence
        (``spec_accepted_tokens / spec_verifications``);
    tokens/verify: tokens emitted per verify step, ``1 + accepted/verify`` (the accepted drafts
        and the corrected or bonus token; vLLM's "mean acceptance length");
    acceptance: accepted / proposed draft tokens;
    ms/step: mean wall time of an engine step in which every scheduled sequence decodes (K = 0)
        or verifies drafts (K > 0): a plain decode step, or a verify step with its K draft
        proposals, the verification, the rollback and the draft's update;
    plain ms/step: the K = 0 row's, for comparison;
    tok/s: generated tokens per second of wall time (all requests, prefill included);
    speed-up: tok/s over the K = 0 row of the same temperature and batch;
    decode speed-up: the same ratio over the steady steps alone (tokens they generated per
        second of their wall time), i.e. without the prompts' prefill, which on the device
        costs ~100 ms per 256-token prompt and dilutes the end-to-end ratio.

``--profile`` runs the first speculative configuration once more under ``torch.profiler`` over a
window of steady-state verify steps (every sequence decoding) and writes a summary to
``$OUT/spec_profile.txt`` (stdout without $OUT): the top ops by self device time (self CPU time
on a CPU), and per verify step the kernels run, the kernel and graph launch calls, and the host
synchronisations (``cudaStreamSynchronize`` and the like). On a CPU, where nothing synchronises,
it counts instead what would on a GPU: ops dispatched (kernel equivalents), device reads
(``tolist``, ``item``, ``cpu``) and host tensors built straight onto a device
(``torch.tensor(..., device=...)``, a blocking copy on a GPU).

``--profile-other`` puts each timed run's other steps (prefills, admissions: what ``other_s`` and
``slowest_other`` report) under cProfile and logs every Triton kernel compiled during the run with
the openk3 frames that launched it: ``$OUT/other_DRAFT_T*_b*_K*.txt``. A compile inside a serving
step costs ~0.3-0.5 s (the thirty-fifth session found six in the EAGLE draft's packed pass). Those
steps run under the profiler then: the rows' times count its overhead (``profiled`` in the JSON).

Issue #14's targets (on the device, ``small`` trained on the corpus, its draft trained with LK
and KL): tokens/verify >= 3 at K = 7 and a batch-1 speed-up >= 2x.

    PYTHONPATH=. python benchmarks/spec_bench.py --checkpoint runs/small --drafts runs/draft-lk runs/draft-kl \
        --json $OUT/spec_bench.json
    PYTHONPATH=. python benchmarks/spec_bench.py --preset small --drafts random self --batch 1 --K 3 7 \
        --temperatures 0 --num-prompts 4 --max-tokens 64 --profile     # mechanics, ~2 min on an H200
    PYTHONPATH=. python benchmarks/spec_bench.py --preset debug --drafts random --device cpu --num-prompts 4 \
        --max-tokens 16 --batch 1 2 --K 3 --profile                    # a CPU sanity run

``--prompts held-out`` takes the prompts from openk3's own Python files instead of the stdlib
corpus the device runs' targets and drafts trained on.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import TritonCompiles
from openk3.model.draft import DraftConfig, Eagle3Draft
from openk3.runtime import load_draft_model, load_model
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.train.corpus import default_corpus_files, read_documents


PROMPT_SOURCES = ("corpus", "held-out")


def corpus_prompts(tokenizer, n: int, length: int, vocab: int, source: str = "corpus") -> list[list[int]]:
    """``n`` prompts of ``length`` tokens: the first ``length`` tokens of every k-th document
    long enough (deterministic: the files in sorted order) of ``source``: ``corpus``, the
    embedded corpus (the stdlib, what the targets of the device runs trained on), or
    ``held-out``, this package's own Python files (code of the same kind that no target trained
    on here: acceptance there is not helped by a target that memorised its prompts)."""
    if source not in PROMPT_SOURCES:
        raise ValueError(f"--prompts {source!r}: choose one of {', '.join(PROMPT_SOURCES)}")
    package = Path(__file__).resolve().parent.parent / "openk3"
    files = sorted(default_corpus_files()) if source == "corpus" else sorted(package.rglob("*.py"))
    prompts = []
    for doc in read_documents(files[::max(1, len(files) // (4 * n))]):
        ids = [i for i in tokenizer.encode(doc[:8 * length]) if i < vocab]
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == n:
            return prompts
    raise ValueError(f"the corpus gave only {len(prompts)} prompts of {length} tokens")


def make_draft(spec: str, target, device, dtype):
    if spec == "random":
        with torch.device(device):
            draft = Eagle3Draft(DraftConfig.for_target(target.cfg, "random"))
        draft.init_weights(0)
        return draft
    if spec == "self":
        return target
    return load_draft_model(spec, device, dtype, target=target)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_engine(target, tokenizer, args, batch: int, K: int, draft) -> LLMEngine:
    config = EngineConfig(max_num_seqs=batch, max_model_len=args.prompt_len + args.max_tokens + 8,
                          enable_prefix_caching=False, num_speculative_tokens=K,
                          max_num_batched_tokens=max(args.prompt_len, 1024))
    eng = LLMEngine(target, tokenizer, config, eos_token_ids=(), draft_model=draft)
    eng.capture_graphs()  # as openk3 serve: no timed step waits for a capture (the verify and draft
    # graphs of a batch bucket were captured on first use before the thirty-fourth session)
    return eng


def steady(eng: LLMEngine) -> bool:
    """The next step decodes or verifies only: every running request decodes, and none waits or
    none can be admitted (the batch is full; a request finishing frees its place only at the end
    of the step). So at batch 1 every request's decoding steps count, not only the last one's."""
    s = eng.scheduler
    return (bool(s.running) and not any(q.is_prefill for q in s.running)
            and (not s.waiting or len(s.running) >= eng.config.max_num_seqs))


def timed_generate(eng: LLMEngine, prompts, params, profiler: cProfile.Profile | None = None
                   ) -> tuple[float, list[float], int, list[float]]:
    """Run the requests to completion: (seconds, wall times of the steady steps in seconds,
    tokens those steps generated, and the other steps (prefills, admissions) as (seconds, prompt
    tokens computed, sequences running before the step)). ``profiler`` (cProfile) runs over the
    other steps only, their synchronisation included."""
    device = eng.runner.device
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    steps, other, steady_tokens = [], [], 0
    sync(device)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        was_steady, before, prompt = steady(eng), eng.stats.generation_tokens, eng.stats.prompt_tokens
        running = len(eng.scheduler.running)
        profiling = profiler is not None and not was_steady
        if profiling:
            profiler.enable()
        try:
            t = time.perf_counter()
            eng.step()
            sync(device)
            dt = time.perf_counter() - t
        finally:
            if profiling:
                profiler.disable()
        if was_steady:
            steps.append(dt)
            steady_tokens += eng.stats.generation_tokens - before
        else:  # what the step did: its seconds, the prompt tokens it computed, the sequences it ran
            other.append((dt, eng.stats.prompt_tokens - prompt, running))
    sync(device)
    return time.perf_counter() - t0, steps, steady_tokens, other


def run(target, tokenizer, prompts, args, temperature: float, batch: int, K: int, draft,
        label: str = "none") -> dict:
    eng = make_engine(target, tokenizer, args, batch, K, draft)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=args.max_tokens)
              for i in range(len(prompts))]
    eng.generate(prompts[:batch], params[:batch])  # warm-up: kernels, graphs, allocator
    eng.stats = type(eng.stats)()
    profiler = cProfile.Profile() if args.profile_other else None
    with TritonCompiles(args.profile_other) as compiles:
        dt, steps, steady_tokens, other = timed_generate(eng, prompts, params, profiler)
    if profiler is not None:
        write_other_profile(profiler, f"other_{label}_T{temperature:g}_b{batch}_K{K}.txt", other,
                            compiles.seen if compiles.tracked else None)
    s = eng.stats
    n = s.generation_tokens
    accepted = s.spec_mean_accepted_tokens
    return {"temperature": temperature, "batch": batch, "K": K, "tokens": n, "seconds": dt,
            "tok_s": n / dt, "accepted_per_verify": accepted if K else None,
            "tokens_per_verify": accepted + 1 if K else None,
            "acceptance": s.spec_acceptance_rate if K else None, "verify_steps": s.spec_verifications,
            "ms_per_step": 1e3 * sum(steps) / max(1, len(steps)), "steady_steps": len(steps),
            "other_steps": len(other), "other_s": sum(dt for dt, _, _ in other),
            "slowest_other": [(round(1e3 * dt, 2), tokens, running) for dt, tokens, running in sorted(other)[-3:]],
            "decode_tok_s": steady_tokens / max(sum(steps), 1e-9),
            "profiled": bool(args.profile_other)}


def write_other_profile(profiler: cProfile.Profile, name: str, other: list, compiles: list | None,
                        top: int = 40) -> None:
    """``--profile-other``: the Triton kernels compiled during the run (None: not tracked), then
    the host functions of its other steps (cProfile, by cumulative and by own time) to
    ``$OUT/name`` (stdout without $OUT)."""
    text = io.StringIO()
    total = sum(dt for dt, _, _ in other)
    text.write(f"{len(other)} other steps, {total:.3f} s (under cProfile); slowest (ms, prompt tokens, "
               f"running): {[(round(1e3 * dt, 2), n, r) for dt, n, r in sorted(other)[-8:]]}\n")
    if compiles is None:
        text.write("Triton compiles not tracked (no Triton, or one without knobs.runtime.jit_post_compile_hook)\n")
    else:
        text.write(f"{len(compiles)} Triton compiles in the timed run\n")
    for kernel, spec, frames in compiles or ():
        text.write(f"  {kernel}: {spec}\n    " + "\n    ".join(frames) + "\n")
    for key in ("cumulative", "tottime"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
    out = os.environ.get("OUT")
    if out:
        Path(out, name).write_text(text.getvalue())
    else:
        print(text.getvalue())


def serving_code(frame) -> bool:
    """Whether ``frame`` runs openk3 code outside the ops and the model."""
    name = frame.f_code.co_filename.replace(os.sep, "/")
    return "/openk3/" in name and "/openk3/ops/" not in name and "/openk3/model/" not in name


class HostCounts(TorchDispatchMode):
    """On a CPU: ops dispatched (each a kernel on a GPU; views excluded), device reads
    (``reads``: the names of the ``tolist``, ``item``, ``cpu`` calls on tensors that would live on
    the GPU, each a synchronisation there) and tensors built from host data with ``device=``
    (``torch.tensor(data, device=...)``: a blocking copy on a GPU). A tensor built from host data
    without ``device=`` is a host tensor on a GPU too: reading it is not counted. Reads and uploads
    are counted in the serving code only: ``openk3/ops`` and ``openk3/model`` run their plain
    PyTorch references on a CPU, which read the host where the GPU kernels do not."""

    def __init__(self):
        super().__init__()
        self.ops = self.blocking_uploads = 0
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def patched(self):
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "cpu")}
        make = torch.tensor

        def read(name, original):
            def counted(t, *a, **kw):
                if not getattr(t, "_host_data", False) and serving_code(sys._getframe(1)):
                    self.reads.append(name)
                return original(t, *a, **kw)
            return counted

        def tensor(*a, **kw):
            t = make(*a, **kw)
            if kw.get("device") is None:
                t._host_data = True
            else:
                self.blocking_uploads += serving_code(sys._getframe(1))
            return t

        for name, original in originals.items():
            setattr(torch.Tensor, name, read(name, original))
        torch.tensor = tensor
        try:
            with self:
                yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            torch.tensor = make


def profile_steps(target, tokenizer, prompts, args, temperature: float, batch: int, K: int, draft,
                  num_steps: int = 8) -> str:
    """The summary of ``--profile``: ``num_steps`` steady verify steps under the profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    eng = make_engine(target, tokenizer, args, batch, K, draft)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=args.max_tokens)
              for i in range(len(prompts))]
    eng.generate(prompts[:batch], params[:batch])  # warm-up
    for p, sp in zip(prompts[:batch], params[:batch]):
        eng.add_request(p, sp)
    while eng.has_unfinished() and not steady(eng):
        eng.step()
    device = eng.runner.device
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    counts = HostCounts()
    verified, steps = eng.stats.spec_verifications, 0
    sync(device)
    t = time.perf_counter()
    with torch_profile(activities=activities) as prof, (contextlib.nullcontext() if cuda else counts.patched()):
        while steps < num_steps and eng.has_unfinished() and steady(eng):
            eng.step()
            steps += 1
        sync(device)
    wall = time.perf_counter() - t
    verified = eng.stats.spec_verifications - verified
    phases = phase_times(eng, num_steps) if cuda else []
    while eng.has_unfinished():
        eng.step()
    if cuda:
        phases += graph_times(eng)
    per = max(1, steps)
    lines = [(f"profile: batch {batch}, K {K}, temperature {temperature}, {steps} steady steps "
              f"({verified} sequence verifications), {1e3 * wall / per:.2f} ms per step under the profiler")]
    events = prof.events()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        names = {"launches": ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"),
                 "graph launches": ("cudaGraphLaunch",),
                 "host syncs": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                                "cudaMemcpy")}
        lines.append(f"per step: {len(kernels) / per:.1f} kernels run, " + ", ".join(
            f"{sum(e.name in n for e in events) / per:.1f} {what}" for what, n in names.items()))
        lines.append(f"GPU busy per step: {sum(e.time_range.elapsed_us() for e in kernels) / per / 1e3:.2f} ms")
        sort = "self_device_time_total"
    else:
        lines.append(f"per step: {counts.ops / per:.1f} ops dispatched (kernel equivalents), "
                     f"{len(counts.reads) / per:.1f} device reads, {counts.blocking_uploads / per:.1f} blocking uploads")
        sort = "self_cpu_time_total"
    lines += phases
    lines.append(prof.key_averages().table(sort_by=sort, row_limit=30))
    return "\n".join(lines)


# the parts of a speculative step, in their order: (label, owner attribute or None for the
# engine, method)
PHASES = (("propose (drafting)", "drafter", "propose"), ("execute (the verify pass)", "runner", "execute"),
          ("sampling + commit + host read", None, "_verify"), ("observe (the draft's update)", "drafter", "observe"))


def graph_times(eng: LLMEngine, replays: int = 50) -> list[str]:
    """The device time of each CUDA graph of a speculative step, replayed back to back (no host
    gaps: the floor of each phase as captured), after the run (the replays write scratch rows
    and stale positions only). Graphs keyed by batch bucket; the smallest bucket's are timed."""
    graphs = {}
    for key, g in eng.drafter.graphs.items():
        graphs[f"draft {key[0]}"] = g.graph
    for key, g in eng.runner.verifier.graphs.items():
        graphs.setdefault("verify", g.verify.graph)
        graphs.setdefault("commit", g.commit.graph)
    for key, g in eng.runner._graphs.items():
        graphs.setdefault("decode", g.graph)
    line = []
    for name, graph in graphs.items():
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        line.append(f"{name} {start.elapsed_time(end) / replays:.3f}")
    return ["graph replays back to back (ms): " + ", ".join(line)]


def phase_times(eng: LLMEngine, num_steps: int) -> list[str]:
    """Per steady step on a GPU: each phase's span on the device (CUDA events around it: its
    kernels and the idle time between them) and its host time, then the step's wall time."""
    marks: list[tuple[str, float, torch.cuda.Event, torch.cuda.Event]] = []

    def timed(label, fn):
        def wrapper(*a, **kw):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            start.record()
            r = fn(*a, **kw)
            end.record()
            marks.append((label, time.perf_counter() - t, start, end))
            return r
        return wrapper

    owners = {"drafter": eng.drafter, "runner": eng.runner, None: eng}
    for label, owner, name in PHASES:
        setattr(owners[owner], name, timed(label, getattr(owners[owner], name)))
    steps, wall = 0, 0.0
    try:
        while steps < num_steps and eng.has_unfinished() and steady(eng):
            sync(eng.runner.device)
            t = time.perf_counter()
            eng.step()
            sync(eng.runner.device)
            wall += time.perf_counter() - t
            steps += 1
    finally:
        for _, owner, name in PHASES:
            delattr(owners[owner], name)  # the class's method again
    per = max(1, steps)
    lines = [f"phases per step ({steps} steps outside the profiler; device span / host time, ms):"]
    for label, _, _ in PHASES:
        got = [(h, s.elapsed_time(e)) for lab, h, s, e in marks if lab == label]
        lines.append(f"  {label}: {sum(d for _, d in got) / per:.3f} / {1e3 * sum(h for h, _ in got) / per:.3f}")
    lines.append(f"  step wall time: {1e3 * wall / per:.3f}")
    return lines


def print_table(rows: list[dict]) -> None:
    cols = ["draft", "temperature", "batch", "K", "accepted_per_verify", "tokens_per_verify", "acceptance",
            "ms_per_step", "plain_ms_per_step", "tok_s", "speed_up", "decode_speed_up"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join("-" if r.get(c) is None else f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c])
                         for c in cols), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--checkpoint", help="the target: a training run or HF checkpoint directory")
    g.add_argument("--preset", help="the target: a preset with random weights (a sanity run)")
    p.add_argument("--drafts", nargs="+", required=True,
                   help="EAGLE-3 draft directories, 'mtp', 'random', 'self', or draft model directories")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--prompts", default="corpus", choices=PROMPT_SOURCES,
                   help="corpus: the stdlib the targets trained on; held-out: openk3's own Python files")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--K", type=int, nargs="+", default=[3, 7])
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--profile", action="store_true",
                   help="profile the first speculative configuration (summary in $OUT/spec_profile.txt)")
    p.add_argument("--profile-other", action="store_true",
                   help="cProfile each run's steps outside the steady ones (prefills, admissions) and log "
                        "Triton's compiles: $OUT/other_DRAFT_T*_b*_K*.txt; those steps then run under the "
                        "profiler, so the rows' seconds, tok/s and speed-ups count its overhead ('profiled')"),
    args = p.parse_args(argv)

    target, tokenizer, name = load_model(args.checkpoint, args.preset, random_init=args.preset is not None,
                                         device=args.device, dtype=args.dtype)
    device, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    prompts = corpus_prompts(tokenizer, args.num_prompts, args.prompt_len, target.cfg.vocab_size, args.prompts)
    drafts = {spec: make_draft(spec, target, device, dtype) for spec in args.drafts}
    print(f"target {name} on {device} ({dtype}), {len(prompts)} prompts of {args.prompt_len} tokens, "
          f"{args.max_tokens} new tokens each", file=sys.stderr)
    rows = []
    for temperature in args.temperatures:
        for batch in args.batch:
            base = run(target, tokenizer, prompts, args, temperature, batch, 0, None)
            rows.append({"draft": "none", **base, "speed_up": 1.0, "decode_speed_up": 1.0})
            print_table(rows[-1:])
            for spec, draft in drafts.items():
                for K in args.K:
                    r = run(target, tokenizer, prompts, args, temperature, batch, K, draft, Path(spec).name)
                    rows.append({"draft": spec, **r, "plain_ms_per_step": base["ms_per_step"],
                                 "speed_up": r["tok_s"] / base["tok_s"],
                                 "decode_speed_up": r["decode_tok_s"] / base["decode_tok_s"]})
                    print_table(rows[-1:])
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"target": name, "device": str(device), "dtype": str(dtype), "args": vars(args),
                       "rows": rows}, fh, indent=1)
    if args.profile:
        spec = args.drafts[0]
        summary = f"draft {spec}\n" + profile_steps(target, tokenizer, prompts, args, args.temperatures[0],
                                                     args.batch[0], args.K[0], drafts[spec])
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "spec_profile.txt"), "w") as fh:
                fh.write(summary + "\n")
            print(f"profile summary in {os.path.join(out, 'spec_profile.txt')}", file=sys.stderr)
        else:
            print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
