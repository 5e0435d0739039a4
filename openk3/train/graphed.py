"""A training step replayed as CUDA graphs: the host stops bounding the step.

Profiled on one H200 (docs/benchmarks.md), an eager ``small`` step spends ~470 ms of wall time
around ~240 ms of GPU kernels: ~8,500 kernels, each launched through Python (fla's wrappers,
compiled regions' guards, autograd's ~300 custom ``Function`` nodes, the optimisers' loops).
Captured once and replayed, the same kernels run back to back and the host only copies the
next batch in. This is PyTorch's "whole-network capture" (the CUDA graphs notes of its docs),
split so that a non-finite loss still stops the run before any update:

1. ``first``: forward, backward and the balancer's update of the first micro-batch from
   static input buffers; its loss (and MTP loss) is added into a static ``sums`` tensor. It is
   captured with every ``.grad`` None, so autograd makes the gradients during capture, in the
   graphs' memory pool, and each replay *writes* them: no zeroing pass and no accumulation
   pass over ~900M fp32 gradients (680 fills and 680 adds, ~5 ms a step of ``small``).
2. ``rest`` (only with ``grad_accum`` > 1): the same for the other micro-batches, captured
   after ``first``, so autograd accumulates into those gradients in place, as the eager loop.
3. ``update``: clipping and every optimiser's step; the gradients stay for ``first`` to
   overwrite.

Between them the host reads the losses (the one host sync an eager step has too) and writes the
learning rates of this step into device tensors the ``update`` graph reads.

What capture needs, and where it is provided:
- no host synchronisation inside the step: routing counts and the balancers' expert loads
  with ``scatter_add`` (never ``bincount``), Quantile Balancing with ``kthvalue``, fla
  without ``cu_seqlens``, lookup tables already on the device;
- gradients that the ``first`` graph makes and ``rest`` only accumulates into (checked after
  capture: one made by ``rest`` would be overwritten by each replay, not accumulated into).
  They live in the pool, hold the last step's values between steps, and are dropped (set to
  None) whenever the graphs are, so an eager step never adds to them;
- warm state: the first step at a new input shape runs eagerly (Triton autotuning, compilation,
  optimiser state), then the next one is captured and replayed;
- optimisers that take a device learning rate: torch's AdamW with ``capturable=True`` and
  ``Muon`` (``openk3.train.optim``) both read ``group["lr"]`` as a 0-dim tensor. The tensor is
  placed in the param groups only while the ``update`` graph is captured; the groups keep
  their float ``lr`` otherwise (``set_lr``, checkpoints), and each replay copies it in.

Python runs only at capture: anything a step does on the host is done once. Hooks that record
tensors (the balancer's routing, the trainer's activation probe) record the graph's own output
buffers, which every replay refreshes in place.

One process only (no FSDP, expert or context parallelism: their hooks and collectives run
Python per step). ``RunConfig.cuda_graph=None`` uses graphs wherever that holds and falls back
to eager steps, with a message, if a capture fails; ``True`` makes a failed capture an error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch

from openk3.serve.graphs import release_generator
from openk3.train.config import RunConfig
from openk3.train.optim import adamw_fusable
from openk3.train.trainer import Training, _finite, micro_step, train_step, update_step


def unsupported_reason(t: Training, cfg: RunConfig) -> str | None:
    """Why ``t`` cannot run graphed steps, or None."""
    if t.env.device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if t.env.world_size > 1:
        return "one process only (FSDP, expert and context parallelism run Python per step)"
    if t.model.cfg.vision_config is not None:
        return "models with a vision tower train eagerly"
    return None


def set_capturable(optimizers: Iterable[torch.optim.Optimizer], capturable: bool) -> None:
    """Put torch's AdamW in (or out of) its capturable mode: its step counts live on the
    parameters' device and its step reads no host value; and in its fused mode exactly where
    that applies (``optim.adamw_fusable``). Safe after ``load_state_dict``, which restores the
    saved groups' flags (a checkpoint of another device or version) and may leave the counts
    on the host."""
    for opt in optimizers:
        if not isinstance(opt, torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            group["capturable"] = capturable
            group["fused"] = adamw_fusable(group["params"])
            for p in group["params"]:
                step = opt.state.get(p, {}).get("step")
                if not isinstance(step, torch.Tensor):
                    continue
                # capturable or fused: counts on the parameter's device; else on the host,
                # where the eager step reads them without a device sync per parameter
                device = p.device if capturable or group["fused"] else torch.device("cpu")
                if step.device != device:
                    opt.state[p]["step"] = step.to(device, torch.float32)


def _capture(fn: Callable[[], object], pool) -> torch.cuda.CUDAGraph:
    """Capture ``fn`` into a new graph that allocates from ``pool``. The caller's stream is
    current again afterwards, also when the capture fails (``torch.cuda.graph`` then leaves
    its capture stream current)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool):
            fn()
    finally:
        torch.cuda.set_stream(stream)
    return graph


def _root_cause(e: BaseException) -> BaseException:
    """The first exception of a chain: a capture that fails inside ``fn`` raises again when
    the capture ends, and that second error hides the first."""
    while e.__context__ is not None and not e.__suppress_context__:
        e = e.__context__
    return e


class GraphedTrainStep:
    """``train_step`` with CUDA graphs: call it as ``step(batches)`` with the same arguments and
    results (the gradient norm is the ``update`` graph's output buffer: read it before the next
    step). ``strict``: a failed capture raises instead of falling back to eager steps.
    ``log``: where the fallback's message goes."""

    def __init__(self, t: Training, cfg: RunConfig, *, strict: bool = False,
                 log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)):
        reason = unsupported_reason(t, cfg)
        if reason is not None:
            raise ValueError(f"RunConfig.cuda_graph: {reason}")
        self.t, self.cfg, self.strict, self.log = t, cfg, strict, log
        self.eager = False  # set once a capture failed (strict=False)
        self.shape: tuple | None = None  # the micro-batch shape the graphs were captured at
        self.warm: tuple | None = None  # the shape of the last eager step
        self.graphs: tuple | None = None  # first, rest (None without grad_accum > 1), update
        self.static: dict | None = None  # their input and output buffers
        set_capturable(t.optimizers, True)
        self._groups: list[dict] = []  # the param groups the update graph was captured with

    def __call__(self, batches: Iterable[tuple]) -> tuple[float, torch.Tensor, float | None]:
        batches = list(batches)
        if any(len(b) != 2 for b in batches):
            raise ValueError("GraphedTrainStep: images are not supported (train eagerly)")
        if len(batches) != self.cfg.grad_accum:
            raise ValueError(f"GraphedTrainStep: {len(batches)} micro-batches, but "
                             f"RunConfig.grad_accum={self.cfg.grad_accum}")
        shape = tuple(batches[0][0].shape)
        if self.eager or (shape != self.shape and shape != self.warm):
            self._release()
            self.warm = shape  # this shape's first step: autotuning, compilation, lazy state
            return train_step(self.t, batches, self.cfg)
        groups = self._current_groups()
        if shape == self.shape and (len(groups) != len(self._groups)
                                    or any(a is not b for a, b in zip(groups, self._groups))):
            self._release()  # an optimiser's state was loaded: its param groups are new dicts
            set_capturable(self.t.optimizers, True)  # and the saved flags (an eager run's)
        if shape != self.shape:
            grads = {p: p.grad for p in self.t.model.parameters()}
            try:
                self._capture_graphs(shape)
            except Exception as e:  # noqa: BLE001 - any capture failure falls back, or raises
                self._release()
                for p, g in grads.items():  # none made during the capture (pool memory)
                    p.grad = g
                torch.cuda.synchronize()
                release_generator()  # random draws outside graphs would fail (serve/graphs.py)
                cause = _root_cause(e)
                why = f"{type(cause).__name__}: {cause}"
                if self.strict:
                    raise RuntimeError(f"RunConfig.cuda_graph=True: capturing the training step "
                                       f"failed ({why})") from e
                self.eager = True
                self.log(f"cuda_graph: capturing the training step failed ({why}); training "
                         "continues with eager steps")
                return train_step(self.t, batches, self.cfg)
        return self._replay(batches)

    def _current_groups(self) -> list[dict]:
        return [g for opt in self.t.optimizers for g in opt.param_groups]

    def _release(self) -> None:
        if self.graphs is not None:  # the gradients are the graphs' (pool memory, last values)
            for p in self.t.model.parameters():
                p.grad = None
        self.shape = None
        self.graphs = None
        self.static = None

    def _capture_graphs(self, shape: tuple) -> None:
        """Capture the graphs at micro-batch ``shape`` (the caller puts the gradients back if
        capture fails)."""
        t, cfg = self.t, self.cfg
        params = list(t.model.parameters())
        device = t.env.device
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager steps' cached blocks, for the graphs' pool
        groups = self._current_groups()
        inputs = torch.zeros(shape, dtype=torch.long, device=device)
        targets = torch.zeros(shape, dtype=torch.long, device=device)
        sums = torch.zeros(2, device=device)
        lrs = torch.zeros(len(groups), device=device)
        grad_norm = torch.zeros((), device=device)  # outside the pool: kept until the next update
        pool = torch.cuda.graph_pool_handle()
        has_mtp = []
        for p in params:
            p.grad = None  # `first` makes them
        first = _capture(lambda: has_mtp.append(micro_step(t, inputs, targets, sums, cfg)), pool)
        rest = None
        if cfg.grad_accum > 1:
            made = {p: p.grad for p in params}
            rest = _capture(lambda: micro_step(t, inputs, targets, sums, cfg), pool)
            changed = [n for n, p in t.model.named_parameters() if p.grad is not made[p]]
            if changed:
                raise RuntimeError(f"the captured backward of a later micro-batch made new gradient "
                                   f"tensors for {changed[:3]} ({len(changed)} in all): they would "
                                   "not accumulate across replays")
        floats = [g["lr"] for g in groups]
        for g, lr in zip(groups, lrs):
            g["lr"] = lr  # a view: each replay reads the value copied in just before
        try:
            update = _capture(lambda: grad_norm.copy_(update_step(t, cfg, keep_grads=True)), pool)
        finally:
            for g, lr in zip(groups, floats):
                g["lr"] = lr
        self.graphs = (first, rest, update)
        self.static = dict(inputs=inputs, targets=targets, sums=sums, lrs=lrs, grad_norm=grad_norm,
                           has_mtp=has_mtp[0])
        self._groups = groups
        self.shape = shape

    def _replay(self, batches: list[tuple]) -> tuple[float, torch.Tensor, float | None]:
        s = self.static
        first, rest, update = self.graphs
        s["sums"].zero_()
        for i, (inputs, targets) in enumerate(batches):
            s["inputs"].copy_(inputs, non_blocking=True)
            s["targets"].copy_(targets, non_blocking=True)
            (rest if i else first).replay()
        loss_f, mtp_f = (s["sums"] / self.cfg.grad_accum).tolist()  # one host sync
        mtp_f = mtp_f if s["has_mtp"] else None
        if not _finite(loss_f, mtp_f):
            return loss_f, torch.full((), float("nan")), mtp_f  # the caller stops before the update
        s["lrs"].copy_(torch.tensor([g["lr"] for g in self._groups]))
        update.replay()
        return loss_f, s["grad_norm"], mtp_f
