"""``Graphs`` without a GPU: a capture that fails warns once, naming the pass, its key and the
device's memory, and turns the graphs off (the GPU side: ``test_graphs_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

import openk3.serve.graphs as graphs


def test_a_failed_capture_warns_with_the_pass_key_and_memory_and_turns_graphs_off(monkeypatch):
    released = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (3 << 30, 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 120 << 30)
    monkeypatch.setattr(graphs, "release_generator", lambda: released.append(True))

    def fail(pool):
        assert pool == "pool"
        raise RuntimeError("operation failed due to a previous error during capture")

    g = graphs.Graphs(enabled=True, name="prefill")
    with pytest.warns(UserWarning) as caught:
        assert g.get_or_capture(256, fail) is None
        assert g.get_or_capture(512, fail) is None  # off now: no capture tried, no second warning
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("CUDA graph capture of the prefill pass (256) failed (operation failed")
    assert "with 3.0 GiB of 140.0 free, 120.0 GiB reserved by PyTorch; running the prefill passes eagerly" in message
    assert released == [True] and not g.enabled and 256 not in g


def test_a_tuple_key_reads_as_its_parts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(graphs, "_memory", lambda: "memory")
    monkeypatch.setattr(graphs, "release_generator", lambda: None)

    def fail(pool):
        raise RuntimeError("no")

    with pytest.warns(UserWarning, match=r"^CUDA graph capture of the EAGLE draft pass \(chain, 8\) failed \(no\) with memory;"):
        graphs.Graphs(enabled=True, name="EAGLE draft").get_or_capture(("chain", 8), fail)


def test_memory_unknown_when_the_device_cannot_say(monkeypatch):
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    assert graphs._memory() == "the free memory unknown (CUDA error: an illegal memory access was encountered)"
