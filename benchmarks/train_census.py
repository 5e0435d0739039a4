"""Which module's forward, which module's backward and which optimiser launch which kernels in
one training step (issue P7).

The graphed training step of ``small`` is bound by its GPU work (~235 ms, ~10,400 kernels on an
H200), and a profile of the graph names kernels, not their sources. This attributes every kernel
of one *eager* step (the same kernels, launched one by one where the profiler sees who launched
them) to:

* ``Parent/Module``: the innermost module whose forward range (``decode_census.label_modules``)
  holds the op that launched it;
* ``Parent/Module bwd``: the same for a backward node's kernels. Autograd gives every node the
  sequence number of the forward op that made it (``evaluate_function`` ranges carry it), so a
  node's kernels go to the module that ran that forward op;
* ``optimizer Muon.step`` and the like: inside a ``torch.optim`` step;
* ``(grad accumulation)``: AccumulateGrad, autograd adding into existing ``.grad`` tensors;
* ``(step)``: anything else (the loss's host reads, clipping outside an optimiser);
* ``(unattributed)``: kernels the profiler links to no ATen op (Triton kernels launched from
  Python, inductor's), so that the totals match the profile.

On the CPU (a check of the attribution) the "kernels" are the leaf ATen ops that are not views.
Run on the device through ``python benchmarks/train_throughput.py --census`` (JSON under $OUT:
``train_census.json``).
"""

from __future__ import annotations

import torch

from benchmarks.decode_census import PREFIX, is_leaf_op

BACKWARD = "autograd::engine::evaluate_function: "
OPTIMIZER = "Optimizer.step#"


def _label(e) -> str | None:
    """The innermost module range or optimiser step around CPU event ``e``, if any."""
    while e is not None:
        if e.name.startswith(PREFIX):
            return e.name[len(PREFIX):]
        if e.name.startswith(OPTIMIZER):
            return "optimizer " + e.name[len(OPTIMIZER):]
        e = e.cpu_parent
    return None


def _node(e):
    """The autograd node evaluation around CPU event ``e``, if any."""
    while e is not None and not e.name.startswith(BACKWARD):
        e = e.cpu_parent
    return e


def attribute_step(events, on_cuda: bool) -> list[tuple[str, str, float]]:
    """(label, kernel name, microseconds) of every kernel among the profiler's ``events`` of one
    training step; the labels are the module docstring's."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    # sequence number -> the forward op that made the node: every grad-mode op records the
    # counter's current value, also ops that make no node (index maths, tables from buffers),
    # so the *last* op with a number is the one that made its node (or runs inside it)
    forward_op: dict[int, object] = {}
    for e in sorted(cpu, key=lambda e: e.time_range.start):
        if e.sequence_nr >= 0 and _node(e) is None and not e.name.startswith(BACKWARD):
            forward_op[e.sequence_nr] = e
    if on_cuda:  # the profiler lists each kernel under the ATen op whose launch it links to;
        # ranges' GPU shadows are not kernels
        items = [(k.name, k.duration, e) for e in cpu for k in e.kernels
                 if not getattr(e, "is_user_annotation", False) and k.name != e.name]
    else:
        items = [(e.name, e.time_range.elapsed_us(), e) for e in cpu if is_leaf_op(e)]
    out = []
    for name, us, launcher in items:
        node = _node(launcher)
        if node is None:
            label = _label(launcher) or "(step)"
        elif node.name.endswith("AccumulateGrad"):
            label = "(grad accumulation)"
        else:
            fwd = forward_op.get(node.sequence_nr)
            label = f"{_label(fwd) or '(step)'} bwd"
        out.append((label, name, us))
    if on_cuda:
        out += _unattributed(events, items)
    return out


def _unattributed(events, attributed: list[tuple[str, float, object]]) -> list[tuple[str, str, float]]:
    """The kernels the profiler links to no ATen op (a Triton kernel launched from Python, as
    Muon's are; inductor's), labelled ``(unattributed)`` so that the census adds up to the
    profile: per name, the GPU's kernels less the attributed ones ((name, us, launcher)), at
    their mean duration."""
    seen: dict[str, list] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            row = seen.setdefault(e.name, [0, 0.0])
            row[0] += 1
            row[1] += e.time_range.elapsed_us()
    for name, us, _ in attributed:
        if name in seen:
            seen[name][0] -= 1
            seen[name][1] -= us
    return [("(unattributed)", name, us / n) for name, (n, us) in seen.items() if n > 0 for _ in range(n)]
