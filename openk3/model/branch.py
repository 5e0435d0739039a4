"""Independent parts of a layer side by side in a captured decode graph (issue P8).

A batch-1 decode step is bound by the latency of its chain of small kernels, not by bytes or
launches (docs/benchmarks.md, twenty-fifth session): each kernel waits for the one before it,
although some only need the layer's input. Queued on a second stream during a CUDA graph
capture, such work becomes a parallel branch of the graph (the stream's event waits are the
graph's edges), and the replay runs it beside the main chain: the MoE's router beside its input
GEMM and its shared experts beside the routed ones (SGLang and TensorRT-LLM run the shared
experts on an auxiliary stream the same way), KDA's decay projection beside the convolution,
MLA's queries beside the latents.

``Fork(x)`` is active only while the current stream captures a graph of at most
``BRANCH_MAX_TOKENS`` rows that autograd does not record; otherwise (eager passes, the CPU,
training, large prefill passes whose kernels fill the GPU alone) ``side()`` runs its block in
place and ``join()`` does nothing, so the kernels and their results are the same either way:
only the order in which the GPU may run them changes. A fork must be joined before the capture
ends or pauses (``PiecewiseGraph``'s eager parts): every user joins within its own function.

Memory: allocations on the side stream during a capture come from the graph's pool (PyTorch's
capture routes every stream of the capture there). A tensor made on one stream and read on the
other is safe if the reading stream's work is ordered before the maker's stream can reuse the
memory: ``side()`` waits for everything the main stream queued so far, so a tensor the main
stream reads after ``join()`` and frees later is not reused by the side stream before that
read; the caller keeps tensors the side stream reads alive until its ``join()``.
"""

from __future__ import annotations

import contextlib

import torch

from openk3.ops.fast import needs_grad

BRANCH_MAX_TOKENS = 128  # decode batches up to this many rows; larger passes keep one stream
ENABLED = True  # benchmarks switch it off to measure the single chain

_SIDE: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream, made on first use (outside a capture: the graphs' warm-up
    passes reach every ``Fork`` before their capture does)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index)
    return _SIDE[index]


class Fork:
    """Work queued beside the current stream while a small graph is captured (module docstring).

    Example (the MoE's shared experts beside the routed ones)::

        fork = Fork(x)
        with fork.side():
            out = shared(x, out)      # on the side stream, after everything queued so far
        u = routed(x)                 # on the main stream, meanwhile
        fork.join()                   # the main stream waits for the side's work
        out += up(u)
    """

    def __init__(self, x: torch.Tensor):
        self.main = self.stream = None
        if not (ENABLED and x.is_cuda) or needs_grad(x) or torch.compiler.is_compiling():
            return
        stream = side_stream(x.device)
        rows = x.numel() // x.shape[-1]
        if torch.cuda.is_current_stream_capturing() and rows <= BRANCH_MAX_TOKENS:
            self.main, self.stream = torch.cuda.current_stream(x.device), stream

    @property
    def active(self) -> bool:
        return self.stream is not None

    def side(self):
        """A context queueing its block's work on the side stream, ordered after all the main
        stream's work queued so far (``nullcontext`` when inactive)."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(self.main)
        return torch.cuda.stream(self.stream)

    def join(self) -> None:
        """The main stream's later work waits for the side's work queued so far."""
        if self.stream is not None:
            self.main.wait_stream(self.stream)
