"""Training with an MTP layer: the loss the trainer differentiates, ``openk3 train --mtp-layers 1``
end to end (metrics, export with the K3 names), the MTP loss falling on a repeating pattern,
exact resume (the MTP parameters and their optimiser state are in the training checkpoint) and
the run-config checks."""

from __future__ import annotations

import copy
import json
from contextlib import nullcontext

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from openk3.cli import main
from openk3.parallel.parallelize import parallelize
from openk3.train.balance import Balancer
from openk3.train.config import RunConfig, resolve_run_config, run_preset
from openk3.train.trainer import Env, Training, train, train_step
from tests.model.test_mtp import _batch, _mtp_model, _reference_losses
from tests.train.test_trainer import TINY_MODEL, corpus, crash_after, tiny  # noqa: F401 (fixture)

L = TINY_MODEL["num_hidden_layers"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def test_train_step_adds_the_weighted_mtp_loss():
    """train_step differentiates loss + w * mtp_loss and reports both: its gradients (no
    optimiser: they stay on the parameters) are those of the reference losses by hand."""
    w = 0.25
    model = _mtp_model().train()
    reference = copy.deepcopy(model)
    env = Env(0, 1, torch.device("cpu"), torch.float32)
    cfg = RunConfig(mtp_layers=1, mtp_loss_weight=w, clip_grad=0.0, balance="none")
    t = Training(env, model, parallelize(model, env), [], Balancer("none", 8, 2).attach(model),
                 nullcontext)
    ids, labels = _batch()
    loss, _, mtp = train_step(t, [(ids, labels)], cfg)
    main_ref, mtp_ref = _reference_losses(reference, ids, labels)
    (main_ref + w * mtp_ref).backward()
    assert loss == pytest.approx(main_ref.item(), rel=1e-5)
    assert mtp == pytest.approx(mtp_ref.item(), rel=1e-5)
    got, want = dict(model.named_parameters()), dict(reference.named_parameters())
    for n, p in want.items():
        if p.grad is not None:
            torch.testing.assert_close(got[n].grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_mtp_layer_is_compiled_and_checkpointed_like_a_decoder_layer(monkeypatch):
    """parallelize compiles the MTP block's regions and recomputes the MTP layer in backward:
    the losses and gradients are those of the plain model."""
    real = torch.compile  # parallelize compiles with inductor: dynamo alone checks the wiring
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    plain, model = _mtp_model().train(), _mtp_model().train()
    parallelize(model, Env(0, 1, torch.device("cpu"), torch.float32), compile=True,
                activation_checkpointing=True)
    layer = model.mtp[0]
    assert "forward" in vars(layer) and "forward" in vars(layer.self_attn)
    assert "forward" in vars(layer.mlp.experts) and "forward" in vars(layer.mlp.shared_experts)
    ids, labels = _batch()
    outs = [m(ids, labels=labels) for m in (plain, model)]
    for out in outs:
        (out.loss + 0.3 * out.mtp_loss).backward()
    torch.testing.assert_close(outs[1].mtp_loss, outs[0].mtp_loss, rtol=1e-6, atol=1e-6)
    got = dict(model.named_parameters())
    for n, p in plain.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n].grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)
    torch._dynamo.reset()


def test_cli_train_with_mtp_layers(corpus, tmp_path, capsys):  # noqa: F811 (the fixture)
    out = tmp_path / "run"
    args = ["train", "--preset", "debug", "--mtp-layers", "1", "--max-steps", "3",
            "--data", str(corpus), "--out", str(out), "--vocab-size", "300",
            "--model-overrides", json.dumps(TINY_MODEL), "--seq-len", "32", "--batch-size", "2",
            "--log-interval", "1", "--eval-interval", "1000", "--num-samples", "0"]
    assert main(args) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["mtp_loss"] > 0 for r in rows)
    assert "  mtp " in capsys.readouterr().err  # the printed line
    saved = json.loads((out / "run_config.json").read_text())
    assert saved["run"]["mtp_layers"] == 1 and saved["model"]["num_nextn_predict_layers"] == 1
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["text_config"]["num_nextn_predict_layers"] == 1
    names = set(json.loads((out / "export" / "model.safetensors.index.json").read_text())["weight_map"])
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.o_proj"):
        assert f"language_model.model.layers.{L}.{name}.weight" in names


def test_mtp_loss_falls_on_a_repeating_pattern(tmp_path):
    """Text that repeats one short cycle: the token after next is a function of the current
    position, so the MTP loss must fall quickly."""
    data = tmp_path / "pattern"
    data.mkdir()
    for i in range(12):
        (data / f"doc{i}.txt").write_text("abcdefghijklmnopqrstuvwxyz0123456789 " * 40)
    summary = train(run_preset("debug", data=[str(data)], out=str(tmp_path / "run"), vocab_size=300,
                               model_overrides=TINY_MODEL, mtp_layers=1, seq_len=32, batch_size=4,
                               max_steps=12, warmup_steps=2, log_interval=1, eval_interval=1000,
                               ckpt_interval=1000, num_samples=0))
    mtp = [json.loads(x)["mtp_loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(mtp) == 12 and summary["losses"][-1] < summary["losses"][0]
    assert mtp[-1] < 0.5 * mtp[0], mtp


def test_resume_with_mtp_is_exact(corpus, tmp_path):  # noqa: F811 (the fixture)
    """The MTP layer's weights and optimiser state go through the DCP checkpoint: a run resumed
    at step 2 reproduces the straight run's losses and MTP losses bit for bit."""
    out = tmp_path / "run"
    kw = {"mtp_layers": 1, "max_steps": 4, "warmup_steps": 1, "log_interval": 1,
          "ckpt_interval": 2, "eval_interval": 1000}
    straight = train(tiny(corpus, out, **kw))["losses"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    saved = FileSystemReader(str(out / "checkpoints" / "step_000002")).read_metadata().state_dict_metadata
    assert "model.mtp.0.eh_proj.weight" in saved and "model.mtp.0.mlp.experts.w1" in saved
    assert any(k.startswith("optim.state.mtp.0.eh_proj.weight.") for k in saved)  # Muon momentum
    crash_after(out, 2)
    resumed = train(tiny(corpus, out, resume=True, **kw))
    assert straight[:2] + resumed["losses"] == straight
    again = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["mtp_loss"] for r in again] == [r["mtp_loss"] for r in rows]


def test_resume_refuses_another_number_of_mtp_layers(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    train(tiny(corpus, out, max_steps=3, warmup_steps=1))
    with pytest.raises(ValueError, match=r"--mtp-layers 1 \(the run has 0\)"):
        resolve_run_config({"out": str(out), "resume": True, "mtp_layers": 1})


@pytest.mark.parametrize("fields,msg", [
    ({"mtp_layers": 2}, "RunConfig.mtp_layers=2: must be 0 or 1"),
    ({"mtp_loss_weight": -0.1}, "RunConfig.mtp_loss_weight=-0.1: must be >= 0"),
    ({"mtp_layers": 1, "model_overrides": {"num_nextn_predict_layers": 0}},
     "sets num_nextn_predict_layers=0 but RunConfig.mtp_layers=1"),
])
def test_mtp_run_config_errors_name_the_field(fields, msg):
    with pytest.raises(ValueError, match=msg):
        RunConfig(**fields)


def test_mtp_layers_sets_the_model_config():
    assert RunConfig(mtp_layers=1).model_config().num_nextn_predict_layers == 1
    assert RunConfig().model_config().num_nextn_predict_layers == 0
