"""CUDA graphs of the serving engine's fixed-shape passes: the decode step of each batch bucket
and, with speculative decoding, the verify step and its rollback (``openk3/serve/verify.py``) and
the drafts' steps (``openk3/serve/draft.py``, ``openk3/serve/eagle.py``); and, as piecewise
graphs (``PiecewiseGraph``: eager parts between the captured pieces), the prefill passes of up to
``EngineConfig.prefill_graph_tokens`` tokens, whose MLA attention has no fixed shape.

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


class PiecewiseGraph:
    """``fn(self, *inputs)`` captured as a sequence of CUDA graphs with eager parts between them: the
    code ``fn`` runs marks each part that cannot be captured (shapes that change from call to
    call) by calling ``eager(part, shape, dtype, device)`` (vLLM's piecewise graphs, by hand).

    During the capture ``eager`` ends the current graph, runs ``part()`` and copies its result
    into a tensor of the graph pool allocated just before, then starts the next graph, which
    reads that tensor (a result with fewer positions, dim 1, than ``shape`` fills its first
    ones: the rest are padding). ``run`` replays the graphs in order and, between them, calls each part
    again and copies its new result into the same tensor: a part must read its inputs from
    tensors the graphs wrote (or state its owner updates before ``run``), never from values
    captured as constants. Warm-up and capture run on a side stream, as in ``CapturedGraph``;
    ``run`` replays on the caller's current stream. Outside a capture (the warm-up runs)
    ``eager`` just calls ``part``; ``EagerPieces`` stands in for the whole object without a GPU."""

    def __init__(self, fn: Callable, inputs: Sequence[torch.Tensor], pool):
        """``fn(pieces, *inputs)``: ``pieces`` is this object, whose ``eager`` the pass calls."""
        self.inputs, self.pool = list(inputs), pool
        self.pieces: list = []  # CUDAGraph, or (part, its static result)
        self._graph: torch.cuda.CUDAGraph | None = None  # the graph being captured
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(self, *self.inputs)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the warm-ups' blocks, cached for this stream only
            self._begin()
            try:
                self.outputs = fn(self, *self.inputs)
            except BaseException:
                try:  # end the broken capture; the caller hears of fn's error, not this one's
                    self._end()
                except Exception:  # noqa: BLE001
                    pass
                raise
            self._end()
        torch.cuda.current_stream().wait_stream(stream)

    def _begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def _end(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.capture_end()
            self.pieces.append(graph)

    def eager(self, part: Callable[[], torch.Tensor], shape, dtype: torch.dtype, device) -> torch.Tensor:
        """``part()`` run eagerly at this point of the pass, its result in a tensor of ``shape``,
        ``dtype`` and ``device`` (see the class docstring)."""
        if self._graph is None:
            return part()
        out = torch.empty(shape, dtype=dtype, device=device)  # in the pool: the next graph reads it
        self._end()
        _fill(out, part())
        self.pieces.append((part, out))
        self._begin()
        return out

    def run(self, *values: torch.Tensor | None, before_eager: Callable[[], None] | None = None):
        """Replay with ``values`` copied into the inputs (None: keep); ``before_eager()`` is called
        once, just before the first eager part: host work that only the eager parts need (the
        GPU is already running the first graph meanwhile)."""
        for static, value in zip(self.inputs, values):
            if value is not None:
                static.copy_(value, non_blocking=True)
        for piece in self.pieces:
            if isinstance(piece, tuple):
                if before_eager is not None:
                    before_eager()
                    before_eager = None
                part, out = piece
                _fill(out, part())
            else:
                piece.replay()
        if before_eager is not None:
            before_eager()
        return self.outputs


def _fill(out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """An eager part's ``result`` into the first positions (dim 1) of ``out``; the rest is padding."""
    out.narrow(1, 0, result.shape[1]).copy_(result)
    return out


class EagerPieces:
    """``PiecewiseGraph``'s ``eager`` for a pass run without graphs (the padded layout on a CPU):
    the part's result in a tensor of the full shape, the padding's rows zeros."""

    @staticmethod
    def eager(part: Callable[[], torch.Tensor], shape, dtype: torch.dtype, device) -> torch.Tensor:
        return _fill(torch.zeros(shape, dtype=dtype, device=device), part())


class Graphs(dict):
    """Graphs by key (a batch bucket), captured on first use into one memory pool; ``enabled``
    False (or a capture that failed, after one warning naming the pass, ``name``, and the key)
    means the caller runs eagerly."""

    def __init__(self, enabled: bool, name: str):
        super().__init__()
        self.enabled, self.name = enabled, name
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
            except Exception as e:  # noqa: BLE001 - an op of the pass cannot be captured (a
                # RuntimeError from CUDA, or an assertion or compile error of a kernel library)
                shown = ", ".join(map(str, key)) if isinstance(key, tuple) else key
                warnings.warn(f"CUDA graph capture of the {self.name} pass ({shown}) failed ({e}) with "
                              f"{_memory()}; running the {self.name} passes eagerly from now on")
                release_generator()
                self.enabled = False
                return None
        return self[key]


def _memory() -> str:
    """The device's memory as a failed capture's warning states it (a capture that needs a new
    segment when the device is full is one way to fail)."""
    try:
        free, total = torch.cuda.mem_get_info()
    except Exception as e:  # noqa: BLE001 - the failure left the context unusable: the warning still goes out
        return f"the free memory unknown ({e})"
    gib = 1 << 30
    return (f"{free / gib:.1f} GiB of {total / gib:.1f} free, {torch.cuda.memory_reserved() / gib:.1f} GiB "
            f"reserved by PyTorch")


def release_generator() -> None:
    """After a capture that failed at its end, the device's default CUDA generator still counts
    itself mid-capture (PyTorch ends its capture only after a capture that succeeded), and the
    next random draw outside a graph raises "Offset increment outside graph capture encountered
    unexpectedly": an engine that falls back to eager passes would then fail every sampled
    request. The generator gets a fresh copy of its state (same seed and offset), which no
    capture holds."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    gen.graphsafe_set_state(gen.clone_state())


def bucket(n: int) -> int:
    """The batch size a graph of ``n`` rows is captured for: the next power of two."""
    return 1 << (n - 1).bit_length()


def prefill_bucket(n: int) -> int:
    """The padded size of a prefill pass of ``n`` tokens: the next power of two up to 4,096 (at
    least 64), above it the next multiple of half the octave (4,096, 6,144, 8,192, 12,288, ...:
    large passes are GPU-bound and their padding is GPU time, but every size's graph holds its
    MLA layers' attention inputs and outputs: `small`'s sizes up to 16,384 hold ~3 GB, eight
    sizes per octave would hold ~9 GB)."""
    if n <= 4096:
        return max(64, bucket(n))
    step = 1 << ((n - 1).bit_length() - 2)
    return -(-n // step) * step
