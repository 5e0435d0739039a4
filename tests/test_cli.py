"""The openk3 command line: help texts and one-line errors."""

import pytest

from openk3.cli import build_parser, main


def _subparsers(parser):
    actions = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return actions[0].choices


@pytest.mark.parametrize("command", ["", "params", "generate", "train", "serve", "eval", "plot"])
def test_help_has_no_markup(command):
    parser = build_parser()
    text = (_subparsers(parser)[command] if command else parser).format_help()
    assert "``" not in text and ":func:" not in text and ":class:" not in text


def test_resume_with_a_conflicting_preset_is_one_clear_error(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.json").write_text('{"run": {"preset": "debug", "out": "%s"}}' % run)
    assert main(["train", "--preset", "small", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--preset 'small' (the run has 'debug')" in err and err.count("\n") == 1


def test_generate_errors_and_seeds(tmp_path, capsys):
    """One clear line each: a missing checkpoint directory (it said "no tokenizer"), a corrupt
    tokenizer.json (a traceback), --draft without K (silently ignored). --seed samples; the
    random weights stay seed 0's, so greedy output does not depend on it."""
    assert main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{bad")
    assert main(["generate", "--random-init", "--tokenizer", str(tmp_path / "bad"), "--prompt", "x"]) == 2
    assert "cannot read the tokenizer" in capsys.readouterr().err
    assert main(["generate", "--random-init", "--draft", "mtp", "--prompt", "x"]) == 2
    assert "--num-speculative-tokens" in capsys.readouterr().err
    assert main(["generate", "--random-init", "--prompt", "x", "--temperature", "-1"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "--temperature -1.0 must be in [0, 100]" in out.err  # not glued to the prompt
    outs = []
    for seed in ("0", "2"):
        assert main(["generate", "--random-init", "--prompt", "hi", "--max-new-tokens", "6", "--temperature", "0",
                     "--seed", seed, "--device", "cpu"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and len(outs[0]) > len("hi")
