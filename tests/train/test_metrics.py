"""MFU accounting and the charts: the cases a review found wrong."""

import json

import pytest
import torch

from openk3 import preset
from openk3.train import metrics
from openk3.train.metrics import flops_per_token, peak_flops


def test_a_tied_head_is_still_a_matmul():
    """Tied to the embedding the head was counted once, as the embedding, and so dropped: 20%
    of `small`'s FLOPs at 4096 tokens, 31% with an MTP layer."""
    for mtp in (0, 1):
        cfg = preset("small").replace(num_nextn_predict_layers=mtp)
        assert flops_per_token(cfg.replace(tie_word_embeddings=True), 4096) == flops_per_token(cfg, 4096)


def test_peak_flops_by_device_and_precision(monkeypatch):
    cuda = torch.device("cuda")
    assert peak_flops(torch.device("cpu"), torch.bfloat16) != peak_flops(torch.device("cpu"), torch.bfloat16)  # NaN
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_flops(cuda, torch.bfloat16) == 989e12
    was = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert peak_flops(cuda, torch.float32) == 67e12  # no TF32: was the TF32 peak, ~7x too high
        torch.backends.cuda.matmul.allow_tf32 = True
        assert peak_flops(cuda, torch.float32) == 989e12 / 2
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    nan = peak_flops(cuda, torch.bfloat16)  # was A100's 312 TFLOP/s: an MFU over 100%
    assert nan != nan
    assert set(metrics.PEAKS) == {"H100", "H200", "A100"}


def test_plot_a_run_whose_last_row_has_no_loss(tmp_path):
    """A debug-vl run ends with a row of held-out accuracy and no loss: `openk3 plot` raised."""
    pytest.importorskip("matplotlib")
    from openk3.train.plot import plot_run

    rows = [{"step": 2, "loss": 3.0, "lr": 1e-3}, {"step": 4, "loss": 2.5, "lr": 1e-3, "accuracy": 0.3},
            {"step": 4, "heldout_accuracy": {"all": 0.4}, "chance": {"all": 0.2}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.name for p in plot_run(tmp_path)] == ["loss.png"]
