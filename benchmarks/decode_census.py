"""Which module launches which kernels in one decode step of the serving engine (issue P8).

The batch-1 decode step of ``small`` runs ~1,900 kernels inside one CUDA graph and is bound by
their count, not by bytes (docs/benchmarks.md). To know which to fuse, this script runs one
steady decode step *eagerly* (CUDA graphs off: the profiler then sees every launch) under the
torch profiler with a ``record_function`` range around every module's forward, named
``mod::Parent/Module`` (the module's class and its parent's), and gives each kernel to the
innermost range that contains it on the GPU's timeline (memcpy and memset included; a kernel
outside every module is the runner's own: ``(runner)``). Printed per range: kernels, their GPU
time, and the most frequent kernel names; and the totals. The graph replays the same kernels,
so the counts are the graph's (its GPU time is lower: no launch gaps).

``--speculative K`` profiles a speculative step instead (issue P9): the model gets one MTP
layer (random weights) as its draft (``draft="mtp"``), and the step drafts K tokens per row,
verifies them in one pass of the target and commits the kept positions; the draft layer's
modules are labelled too, by their classes (the EAGLE-3 draft built from the MTP layer runs
the target's embedding and LM head, which keep the target's labels).

On the CPU (``--device cpu``, a check of the script) the "kernels" are the leaf ATen ops that
are not views, attributed the same way on the host's timeline.

Run on the device: ``python benchmarks/decode_census.py [--preset small] [--batch 1]
[--speculative 3]`` (JSON under $OUT: ``decode_census.json``).
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable

import torch
from torch import nn

VIEWS = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::split",
    "aten::split_with_sizes", "aten::slice", "aten::select", "aten::as_strided", "aten::t",
    "aten::transpose", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::detach",
    "aten::alias", "aten::permute", "aten::unbind", "aten::narrow", "aten::lift_fresh",
    "aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided",
    "aten::resolve_conj", "aten::resolve_neg", "aten::chunk", "aten::unflatten", "aten::view_as",
    "aten::expand_as", "aten::flatten", "aten::contiguous", "aten::to", "aten::_to_copy",
    "aten::item", "aten::_local_scalar_dense", "aten::result_type", "aten::is_nonzero",
    "aten::numpy_T",
})  # ops that launch nothing when they have no ATen op below them (a copying ``to`` has one)
PREFIX = "mod::"


def label_modules(model: nn.Module, leaves: tuple[type, ...] = ()) -> Callable[[], None]:
    """Wrap every module's forward of ``model`` in a profiler range ``mod::Parent/Module``;
    returns the function that removes the hooks. Modules of the ``leaves`` types are labelled
    but nothing inside them is (a compiled region: hooks inside it would recompile it)."""
    parents = {id(child): type(m).__name__ for m in model.modules() for child in m.children()}
    inside = {id(sub) for m in model.modules() if isinstance(m, leaves) for sub in m.modules() if sub is not m}
    handles, open_ranges = [], []

    def enter(module, args):
        name = f"{PREFIX}{parents.get(id(module), '')}/{type(module).__name__}"
        rf = torch.profiler.record_function(name)
        rf.__enter__()
        open_ranges.append(rf)

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    for m in model.modules():
        if id(m) in inside:
            continue
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    return lambda: [h.remove() for h in handles]


def is_leaf_op(e) -> bool:
    """An ATen op that launches work itself: not a view, and no such op below it (the CPU's
    stand-in for a kernel)."""
    def launches(op) -> bool:
        return op.name.startswith("aten::") and op.name not in VIEWS
    return launches(e) and not any(launches(c) for c in e.cpu_children)


def attribute(events, on_cuda: bool) -> list[tuple[str, str, float]]:
    """(range label, kernel name, microseconds) of every kernel among the profiler's ``events``,
    the label that of the innermost ``mod::`` range containing the kernel ('(runner)' where none
    does). On the CPU the kernels are the ATen ops with no ATen op below them, views left out."""
    device = torch.autograd.DeviceType.CUDA if on_cuda else torch.autograd.DeviceType.CPU
    ranges, items = [], []
    for e in events:
        if e.device_type != device:
            continue
        if e.name.startswith(PREFIX):
            ranges.append((e.time_range.start, e.time_range.end, e.name[len(PREFIX):]))
        elif on_cuda and not getattr(e, "is_user_annotation", False):
            items.append(e)
        elif not on_cuda and is_leaf_op(e):
            items.append(e)
    out = []
    for e in items:
        start, end = e.time_range.start, e.time_range.end
        inside = [r for r in ranges if r[0] <= start and end <= r[1]]
        label = min(inside, key=lambda r: r[1] - r[0])[2] if inside else "(runner)"
        out.append((label, e.name, e.time_range.elapsed_us()))
    return out


def summarise(rows: list[tuple[str, str, float]], top: int = 4) -> list[dict]:
    """Per label: kernels, GPU microseconds, the ``top`` most frequent kernel names; most
    kernels first."""
    by = collections.defaultdict(list)
    for label, name, us in rows:
        by[label].append((name, us))
    table = [{"module": label, "kernels": len(ks), "us": sum(us for _, us in ks),
              "top": ", ".join(f"{n[:48]} x{c}" for n, c in collections.Counter(n for n, _ in ks).most_common(top))}
             for label, ks in by.items()]
    return sorted(table, key=lambda r: -r["kernels"])


def main() -> None:
    from benchmarks.common import environment, write_results
    from openk3 import build_model, preset
    from openk3.serve.engine import EngineConfig, LLMEngine
    from openk3.serve.sampler import SamplingParams
    from openk3.tokenizer import ByteTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="profile a speculative step with K drafts from an MTP layer (0: a decode step)")
    args = ap.parse_args()
    on_cuda = args.device == "cuda"
    print(environment())
    cfg = preset(args.preset)
    spec = dict(num_speculative_tokens=args.speculative, draft="mtp") if args.speculative else {}
    if args.speculative:
        cfg = cfg.replace(num_nextn_predict_layers=1)
    model = build_model(cfg, device=args.device, dtype=torch.bfloat16 if on_cuda else torch.float32)
    eng = LLMEngine(model, ByteTokenizer(), EngineConfig(max_num_seqs=max(args.batch, 1), max_model_len=1024,
                                                         cuda_graphs=False, enable_prefix_caching=False,
                                                         **spec),
                    eos_token_ids=())
    for i in range(args.batch):
        eng.add_request([(7 * i + j) % cfg.vocab_size for j in range(3, 131)],
                        SamplingParams(temperature=0, max_tokens=64))
    for _ in range(6):  # prefill, then decode steps: compilation and autotuning happen here
        eng.step()
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    sync()
    drafter = eng.drafter
    draft = getattr(drafter, "draft", None) or getattr(getattr(drafter, "runner", None), "model", None)
    removers = [label_modules(m) for m in (model, draft) if isinstance(m, nn.Module)]
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * on_cuda
    with torch.profiler.profile(activities=activities) as prof:
        eng.step()
        sync()
    for remove in removers:
        remove()
    rows = attribute(prof.events(), on_cuda)
    table = summarise(rows)
    total_us = sum(r["us"] for r in table)
    step = f"speculative step (K = {args.speculative})" if args.speculative else "decode step"
    print(f"{args.preset}, batch {args.batch}, one eager {step}: {len(rows)} kernels, "
          f"{total_us / 1e3:.2f} ms of kernel time ({cfg.num_hidden_layers} layers)")
    print(f"{'module':40s} {'kernels':>8s} {'us':>9s}  most frequent")
    for r in table:
        print(f"{r['module'][:40]:40s} {r['kernels']:8d} {r['us']:9.1f}  {r['top']}")
    write_results("decode_census", [{"preset": args.preset, "batch": args.batch,
                                     "speculative": args.speculative, "module": r["module"],
                                     "kernels": r["kernels"], "us": r["us"], "top": r["top"]} for r in table])


if __name__ == "__main__":
    main()
