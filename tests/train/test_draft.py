"""Draft training (``openk3 train-draft``): the loss it differentiates, gradients into the draft
only, acceptance rising for every loss, and the command end to end with its errors."""

from __future__ import annotations

import copy
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from openk3.checkpoint.draft import load_draft
from openk3.cli import main
from openk3.model.draft import draft_unroll
from openk3.runtime import load_model
from openk3.train import draft as draft_mod
from openk3.train.config import run_preset
from openk3.train.draft import DraftRunConfig, build_draft, draft_loss, train_draft, ttt_losses
from openk3.train.draft_loss import acceptance_rate, kl_loss, lk_alpha_loss
from openk3.train.trainer import TrainingDiverged, train
from tests.train.test_trainer import TINY_MODEL

STEPS = 20  # draft-training steps of the acceptance test


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def target_run(tmp_path_factory):
    """A tiny target with an MTP layer, trained a little on text that repeats a short cycle with
    variations (its next-token distributions are peaked but not one-hot)."""
    root = tmp_path_factory.mktemp("draft_target")
    mp = pytest.MonkeyPatch()
    mp.setenv("OPENK3_CACHE", str(root / "cache"))
    data = root / "data"
    data.mkdir()
    g = torch.Generator().manual_seed(0)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    for i in range(8):
        idx = torch.randint(0, len(words), (300,), generator=g).tolist()
        (data / f"doc{i}.txt").write_text(" ".join(words[j] for j in idx))
    train(run_preset("debug", data=[str(data)], out=str(root / "run"), vocab_size=300,
                     model_overrides=TINY_MODEL, mtp_layers=1, seq_len=32, batch_size=4,
                     max_steps=10, warmup_steps=2, log_interval=10, eval_interval=1000,
                     ckpt_interval=1000, num_samples=0))
    mp.undo()
    return root / "run", data


def _cfg(target_run, out, **kw) -> DraftRunConfig:
    run, data = target_run
    base = dict(checkpoint=str(run), out=str(out), data=[str(data)], seq_len=32, batch_size=4,
                steps=5, warmup_steps=1, log_interval=1, device="cpu")
    return DraftRunConfig(**{**base, **kw})


def _target_and_draft(target_run, **kw):
    cfg = _cfg(target_run, "unused", **kw)
    target, _, _ = load_model(cfg.checkpoint, device="cpu")
    target.requires_grad_(False)
    return cfg, target, build_draft(cfg, target, cfg.checkpoint)


def _ids(T: int = 12):
    return torch.randint(3, 300, (2, T), generator=torch.Generator().manual_seed(3))


def test_loss_is_the_decayed_sum_over_unrolled_steps(target_run):
    """loss = sum_i 0.8^i L_i, L_i between the draft's step-i logits at t and the target's at
    t + i + 1 over t <= T - 2 - i, written out here with kl_loss; alpha per step likewise."""
    _, target, draft = _target_and_draft(target_run, loss="kl")
    ids = _ids()
    T = ids.shape[1]
    total, losses, alphas = ttt_losses(target, draft, ids, 3, draft_loss("kl"), 0.8)
    hidden, bank = target.model.hidden_and_blocks(ids)
    p_all = target.lm_head(hidden)
    outs = draft_unroll(draft, draft.fuse(hidden, bank), target.model.embed_tokens, ids, 3)
    want = []
    for i, g in enumerate(outs):
        p, q = p_all[:, i + 1:].flatten(0, 1), target.lm_head(g[:, :T - 1 - i]).flatten(0, 1)
        assert p.shape[0] == 2 * (T - 1 - i)
        want.append(kl_loss(p, q))
        torch.testing.assert_close(alphas[i], acceptance_rate(p, q))
    torch.testing.assert_close(torch.stack(losses), torch.stack(want))
    torch.testing.assert_close(total, want[0] + 0.8 * want[1] + 0.64 * want[2])
    assert draft_loss("lk") is lk_alpha_loss


def test_gradients_reach_the_draft_only_and_the_target_is_unchanged(target_run):
    _, target, draft = _target_and_draft(target_run)
    before = copy.deepcopy(target.state_dict())
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    for _ in range(2):
        total, _, _ = ttt_losses(target, draft, _ids(), 3, draft_loss("lk"), 0.8)
        total.backward()
        assert all(p.grad is None for p in target.parameters())
        names = [n for n, p in draft.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        # the fused blocks (TINY_MODEL: blocks 1, 1 and the last) all get gradient through fc
        assert names == [], names
        opt.step()
        opt.zero_grad()
    for name, t in target.state_dict().items():
        assert torch.equal(t, before[name]), name


@pytest.mark.parametrize("loss", ["lk", "kl", "lk-lambda"])
def test_training_raises_acceptance(target_run, tmp_path, loss):
    summary = train_draft(_cfg(target_run, tmp_path / "draft", loss=loss, steps=STEPS, lr=3e-3,
                               warmup_steps=3, log_interval=10))
    alphas = torch.tensor(summary["alphas"])  # [steps, depth]
    first, last = alphas[0], alphas[-5:].mean(0)
    assert (last > first + 0.2).all(), (first, last)


def test_cli_end_to_end(target_run, tmp_path, capsys):
    run, data = target_run
    out = tmp_path / "draft"
    args = ["train-draft", "--checkpoint", str(run), "--out", str(out), "--steps", "5",
            "--data", str(data), "--seq-len", "32", "--batch-size", "2", "--log-interval", "1",
            "--ttt-steps", "2", "--init", "mtp", "--loss", "lk-lambda", "--device", "cpu"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "step      5  loss" in err and "alpha" in err and "openk3 train-draft: 5 steps" in err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(len(r["alpha"]) == 2 and len(r["loss_per_depth"]) == 2 for r in rows)
    config = json.loads((out / "config.json").read_text())
    assert (config["init"], config["loss"], config["ttt_steps"], config["train_steps"]) == ("mtp", "lk-lambda", 2, 5)
    target, _, _ = load_model(run, device="cpu")
    draft = load_draft(out, target)
    assert draft.cfg.fused_blocks == (1, 1)
    # errors: one line each, exit code 2
    assert main(args) == 2 and "--out" in capsys.readouterr().err  # exists already
    missing = ["train-draft", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "d2")]
    assert main(missing) == 2 and "--checkpoint" in capsys.readouterr().err
    assert main(["train-draft", "--checkpoint", str(run), "--loss", "tv"]) == 2
    assert "--loss 'tv': choose one of" in capsys.readouterr().err
    assert main(["train-draft", "--out", str(tmp_path / "d3")]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    other, _, _ = load_model(preset="debug", random_init=True, device="cpu")
    with pytest.raises(ValueError, match="trained for another target"):
        load_draft(out, other)


def test_ctrl_c_saves_the_draft_of_the_step_and_stops(target_run, tmp_path, monkeypatch, capsys):
    calls = []

    def interrupted_at_step_3(*args, **kwargs):  # Ctrl-C arrives during step 3's forward
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return ttt_losses(*args, **kwargs)

    monkeypatch.setattr(draft_mod, "ttt_losses", interrupted_at_step_3)
    out = tmp_path / "draft"
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN under nohup or in a background job
    summary = train_draft(_cfg(target_run, out, steps=50, save_interval=20))
    assert len(summary["losses"]) == 3 and len(calls) == 3
    assert "openk3 train-draft: interrupted" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["train_steps"] == 3
    assert signal.getsignal(signal.SIGINT) == before  # the handler is restored


def test_non_finite_gradient_stops_before_the_update(target_run, tmp_path, monkeypatch):
    """A finite loss with a NaN gradient stops the run before the optimiser writes it into the
    weights (the draft saved at step 2 stays as it was); the CLI says so in one line, exit 1."""
    real = torch.nn.utils.clip_grad_norm_
    calls = []

    def poisoned(params, *a, **k):
        params = list(params)
        calls.append(1)
        if len(calls) == 3:
            for p in params:
                p.grad.fill_(float("nan"))
        return real(params, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned)
    out = tmp_path / "draft"
    with pytest.raises(TrainingDiverged, match="gradient norm nan at step 3"):
        train_draft(_cfg(target_run, out, steps=5, save_interval=2))
    assert json.loads((out / "config.json").read_text())["train_steps"] == 2
    saved = load_file(str(next(out.glob("*.safetensors"))))
    assert all(t.isfinite().all() for t in saved.values())


def test_init_mtp_needs_an_mtp_layer(target_run, tmp_path):
    _, target, _ = _target_and_draft(target_run)
    target.mtp = torch.nn.ModuleList()
    with pytest.raises(ValueError, match="--init mtp: .*--mtp-layers 1"):
        build_draft(_cfg(target_run, tmp_path / "d", init="mtp"), target, "t")
