"""``openk3.model.branch``: where a ``Fork`` is active, and that its inactive form is invisible
(the same ops in the same order, traceable by dynamo without a graph break). Its active form,
two branches of a captured CUDA graph, is tested on the GPU against the single-stream graphs
(``tests/serve/test_engine_gpu.py::test_graph_branches_give_the_single_streams_bits``)."""

from __future__ import annotations

import torch

from openk3.model import branch
from openk3.model.branch import Fork


def test_inactive_off_a_captured_cuda_graph():
    """On the CPU, with autograd recording, or with more rows than BRANCH_MAX_TOKENS (or not
    capturing, on CUDA), ``side()`` runs its block in place and ``join()`` does nothing."""
    for x in (torch.randn(1, 1, 8), torch.randn(3, 8, requires_grad=True),
              torch.randn(1, branch.BRANCH_MAX_TOKENS + 1, 8)):
        fork = Fork(x)
        assert not fork.active
        with fork.side():
            y = x * 2
        fork.join()
        assert torch.equal(y, x * 2)


def test_dynamo_traces_an_inactive_fork_without_a_break():
    """Training compiles MLAttention (``openk3.parallel.compile``), whose forward makes a Fork:
    inactive there, it must not split the region's graph."""
    def f(x):
        fork = Fork(x)
        with fork.side():
            q = x.sin()
        k = x.cos()
        fork.join()
        return q + k

    x = torch.randn(4, 8, requires_grad=True)
    got = torch.compile(f, fullgraph=True, backend="eager")(x)
    assert torch.equal(got, x.sin() + x.cos())
