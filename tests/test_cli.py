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
