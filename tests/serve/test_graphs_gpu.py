"""CUDA graphs of the engine (``openk3/serve/graphs.py``) on the GPU: a pass whose capture fails
falls back to eager, and random draws outside graphs still work afterwards (the generator is
released from the failed capture). Run on the device: ``pytest -m gpu tests/serve/test_graphs_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from openk3.serve.graphs import CapturedGraph, Graphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _uncapturable(x: torch.Tensor) -> torch.Tensor:
    y = x + 1
    if torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()  # not permitted while capturing: the capture is invalidated
    return y


def test_a_failed_capture_falls_back_and_leaves_random_draws_working():
    x = torch.zeros(4, device="cuda")
    graphs = Graphs(enabled=True, name="test")
    with pytest.warns(UserWarning, match=r"CUDA graph capture of the test pass \(bad\) failed"):
        assert graphs.get_or_capture("bad", lambda pool: CapturedGraph(_uncapturable, [x], pool)) is None
    assert not graphs.enabled
    torch.manual_seed(0)
    a = torch.rand(3, device="cuda")  # raised "Offset increment outside graph capture" before
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3, device="cuda"), a)
    # a later capture with random draws replays new ones each time
    graph = CapturedGraph(lambda x: x + torch.rand(4, device="cuda"), [x], torch.cuda.graph_pool_handle())
    first = graph.run(x).clone()
    assert not torch.equal(graph.run(x), first)
