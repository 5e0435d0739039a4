"""The debug-vl corpus: sequences, labels, tokenizer, evaluation (the training run is the demo)."""

import pytest
import torch

from openk3.config import preset
from openk3.model import build_model
from openk3.ops.loss import IGNORE_INDEX
from openk3.vision import synthetic


def test_batch_predicts_only_the_answer_and_eos():
    cfg = preset("debug-vl")
    tok = synthetic.build_tokenizer()
    assert tok.get_vocab_size() <= cfg.vocab_size
    assert tok.token_to_id("<|media_pad|>") == cfg.vision_config.media_placeholder_token_id
    exs = synthetic.examples(5, seed=0)
    assert [e.task for e in exs] == list(synthetic.TASKS)
    ids, labels, images = synthetic.batch(exs, tok, cfg.vision_config)
    assert ids.shape == labels.shape and len(images.grid_hws) == 5
    for i, (e, n) in enumerate(zip(exs, images.tokens_per_image(cfg.vision_config))):
        assert int((ids[i] == synthetic.MEDIA_PAD).sum()) == n
        counted = labels[i][labels[i] != IGNORE_INDEX].tolist()
        assert counted == [tok.token_to_id(e.answer), synthetic.EOS]
        # labels[t] is the token after ids[t]
        t = int((labels[i] != IGNORE_INDEX).nonzero()[0])
        assert tok.decode(ids[i, :t + 1].tolist()).endswith(synthetic.QUESTIONS[e.task].split()[-1])


def test_held_out_seeds_differ_and_evaluate_reports_every_task():
    a, b = synthetic.examples(5, seed=1), synthetic.examples(5, seed=2)
    assert any(x.image.tobytes() != y.image.tobytes() for x, y in zip(a, b))
    model = build_model(preset("debug-vl"))
    acc = synthetic.evaluate(model, synthetic.build_tokenizer(), a)
    assert set(acc) == set(synthetic.TASKS) | {"all"} and all(0 <= v <= 1 for v in acc.values())
    assert abs(synthetic.chance()["all"] - torch.tensor([1 / 10, 1 / 3, 1 / 4, 1 / 5, 1 / 8]).mean()) < 1e-6


def test_generate_with_an_image(tmp_path, capsys):
    """`openk3 generate --image` on a debug-vl export (random weights): the image block goes in,
    tokens come out; a text-only model refuses --image."""
    from openk3.cli import main
    from openk3.vision.train import export

    model = build_model(preset("debug-vl"))
    export(tmp_path, model, synthetic.build_tokenizer())
    img = tmp_path / "digit.png"
    synthetic.examples(1, seed=3)[0].image.save(img)
    args = ["generate", "--checkpoint", str(tmp_path / "export"), "--image", str(img),
            "--prompt", "what digit is this ?", "--max-new-tokens", "2", "--temperature", "0"]
    assert main(args) == 0
    assert "what digit is this ?" in capsys.readouterr().out
    assert main(["generate", "--random-init", "--preset", "debug", "--image", str(img),
                 "--prompt", "x", "--max-new-tokens", "1"]) == 2
    assert "--image needs a model with a vision tower" in capsys.readouterr().err


def test_training_stops_on_a_non_finite_loss(tmp_path, monkeypatch):
    """The debug-vl run keeps no checkpoint: a non-finite loss stops it before anything is
    exported (before, it trained on and exported NaN weights)."""
    from openk3.train.config import run_preset
    from openk3.train.trainer import TrainingDiverged, train

    real = torch.nn.functional.cross_entropy
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", lambda *a, **k: real(*a, **k) * float("nan"))
    with pytest.raises(TrainingDiverged, match="at step 1"):
        train(run_preset("debug-vl", out=str(tmp_path / "run"), max_steps=3, batch_size=2, warmup_steps=1,
                         num_samples=0))
    assert not (tmp_path / "run" / "export").exists()


def test_evaluation_does_not_depend_on_the_batch():
    """Prompts were left-padded and the model takes no mask: an example's logits moved by up to
    0.35 with the other prompts of its batch. Batched by length now, the scores are those of
    one example at a time."""
    torch.manual_seed(0)
    model = build_model(preset("debug-vl")).eval()
    tok = synthetic.build_tokenizer()
    exs = synthetic.examples(24, seed=7)
    lengths = {len(synthetic.prompt_ids(tok, e.task, synthetic.pack_images([e.image], model.cfg.vision_config)
                                        .tokens_per_image(model.cfg.vision_config)[0])) for e in exs}
    assert len(lengths) > 1  # prompts of several lengths share a batch
    seen = []
    real = model.forward

    def spy(ids, **kw):
        seen.append(ids)
        return real(ids, **kw)

    model.forward = spy
    batched = synthetic.evaluate(model, tok, exs, batch_size=64)
    assert all(not (ids == synthetic.PAD).any() for ids in seen)
    assert batched == synthetic.evaluate(model, tok, exs, batch_size=1)


def test_training_evaluates_at_every_eval_interval(tmp_path, monkeypatch):
    """The evaluation ran inside the logging branch: only at multiples of both intervals."""
    import json

    from openk3.train.config import run_preset
    from openk3.train.trainer import train
    from openk3.vision import train as vision_train

    monkeypatch.setattr(vision_train, "EVAL_EXAMPLES", 40)  # every task (fixed seed)
    train(run_preset("debug-vl", out=str(tmp_path / "run"), max_steps=4, batch_size=2, warmup_steps=1,
                     log_interval=2, eval_interval=3, num_samples=0))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 3, 4]
    assert [r["step"] for r in rows if "accuracy" in r] == [3]
