"""CUDA graphs of the serving engine's fixed-shape passes: the decode step of each batch bucket
and, with speculative decoding, the verify step and its rollback (``openk3/serve/verify.py``) and
the drafts' steps (``openk3/serve/draft.py``, ``openk3/serve/eagle.py``).

A pass is captured once per shape and replayed with new inputs: its launches cost one
``cudaGraphLaunch`` instead of one host round of Python, dispatch and launch per kernel, which is
what bounds a small model's decode step. The inputs live in static tensors that the caller
copies into before each replay; the pass reads everything else (weights, caches, block tables)
in place, so it sees their current contents.

Graphs of one ``Graphs`` share a memory pool: a graph's intermediates may occupy memory another
graph of the pool uses, so the graphs of one pool must replay in turn, each one's outputs used
(or copied) before another graph of the pool replays, unless it was captured after them (a
capture never reuses the memory of outputs that are still held).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch


class CapturedGraph:
    """``fn(*inputs)`` captured as one CUDA graph over the static ``inputs``.

    ``inputs`` hold values for which ``fn`` writes only scratch memory (padding rows): the
    capture runs ``fn`` twice eagerly first (compilation, autotuning, the allocator's warm-up).
    ``run(*values)`` copies each value that is not None into its static input (a number fills
    it) and replays; it returns ``fn``'s outputs, static tensors that the next replay overwrites."""

    def __init__(self, fn: Callable, inputs: Sequence[torch.Tensor], pool):
        self.inputs = list(inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs)

    def run(self, *values: torch.Tensor | int | None):
        for static, value in zip(self.inputs, values):
            if isinstance(value, torch.Tensor):
                static.copy_(value, non_blocking=True)
            elif value is not None:
                static.fill_(value)
        self.graph.replay()
        return self.outputs


class Graphs(dict):
    """Graphs by key (a batch bucket), captured on first use into one memory pool; ``enabled``
    False (or a capture that failed, after one warning) means the caller runs eagerly."""

    def __init__(self, enabled: bool):
        super().__init__()
        self.enabled = enabled
        self.pool = None

    def get_or_capture(self, key, make: Callable):
        """The graph of ``key``, captured by ``make(pool)`` the first time; None while disabled."""
        if not self.enabled:
            return None
        if key not in self:
            try:
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                self[key] = make(self.pool)
            except RuntimeError as e:  # an op of the pass cannot be captured
                warnings.warn(f"CUDA graph capture failed ({e}); running this pass eagerly from now on")
                self.enabled = False
                return None
        return self[key]


def bucket(n: int) -> int:
    """The batch size a graph of ``n`` rows is captured for: the next power of two."""
    return 1 << (n - 1).bit_length()
