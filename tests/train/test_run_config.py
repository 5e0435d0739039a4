"""RunConfig from command-line flags: presets, the warm-up clamp, and what may change on resume."""

import json

import pytest

from openk3.train.config import RUN_CONFIG_FILE, RunConfig, resolve_run_config, run_preset


def _saved_run(tmp_path, **fields) -> str:
    cfg = run_preset("debug", out=str(tmp_path / "run"), **fields)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / RUN_CONFIG_FILE).write_text(json.dumps({"run": cfg.to_dict()}))
    return cfg.out


def test_flags_override_the_preset():
    cfg, notices = resolve_run_config({"preset": "small", "lr": 3e-3})
    assert (cfg.preset, cfg.seq_len, cfg.lr, notices) == ("small", 4096, 3e-3, [])


def test_default_warmup_is_clamped_with_a_notice():
    cfg, notices = resolve_run_config({"max_steps": 10})
    assert cfg.warmup_steps == 1 and len(notices) == 1 and "--warmup-steps" in notices[0]
    cfg, _ = resolve_run_config({"max_steps": 5})
    assert cfg.warmup_steps == 0


def test_explicit_warmup_that_does_not_fit_is_an_error():
    with pytest.raises(ValueError, match="warmup_steps"):
        resolve_run_config({"max_steps": 10, "warmup_steps": 10})


def test_resume_keeps_the_saved_run(tmp_path):
    out = _saved_run(tmp_path, lr=5e-3, seq_len=64)
    cfg, _ = resolve_run_config({"out": out, "resume": True, "max_steps": 800, "log_interval": 5})
    assert (cfg.lr, cfg.seq_len, cfg.max_steps, cfg.log_interval, cfg.resume) == (5e-3, 64, 800, 5, True)


@pytest.mark.parametrize("flag,value,shown", [
    ("preset", "small", "--preset 'small' (the run has 'debug')"),
    ("seq_len", 128, "--seq-len 128 (the run has 64)"),
    ("lr", 1e-3, "--lr 0.001"),
    ("data", ("notes/",), "--data"),
])
def test_resume_refuses_flags_that_change_the_run(tmp_path, flag, value, shown):
    out = _saved_run(tmp_path, seq_len=64)
    with pytest.raises(ValueError, match="conflict with the run saved in") as e:
        resolve_run_config({"out": out, "resume": True, flag: value})
    assert shown in str(e.value) and "--max-steps" in str(e.value)


def test_resume_accepts_flags_equal_to_the_saved_ones(tmp_path):
    out = _saved_run(tmp_path, data=("a.txt",))
    cfg, _ = resolve_run_config({"out": out, "resume": True, "preset": "debug", "data": ("a.txt",)})
    assert cfg.data == ("a.txt",)
    # a run started on the preset's vocabulary, resumed naming that same size (refused before)
    size = RunConfig.from_dict(json.loads((tmp_path / "run" / RUN_CONFIG_FILE).read_text())["run"]) \
        .model_config().vocab_size
    cfg, _ = resolve_run_config({"out": out, "resume": True, "vocab_size": size})
    assert cfg.model_config().vocab_size == size
    with pytest.raises(ValueError, match=f"--vocab-size {size + 1} \\(the run has {size}\\)"):
        resolve_run_config({"out": out, "resume": True, "vocab_size": size + 1})


def test_resume_without_a_saved_run_starts_a_new_one(tmp_path):
    cfg, _ = resolve_run_config({"out": str(tmp_path / "none"), "resume": True, "preset": "small"})
    assert cfg.preset == "small" and cfg.resume


def test_unreadable_saved_run_is_named(tmp_path):
    (tmp_path / RUN_CONFIG_FILE).write_text("{")
    with pytest.raises(ValueError, match=RUN_CONFIG_FILE):
        resolve_run_config({"out": str(tmp_path), "resume": True})


def test_resumable_fields_are_run_config_fields():
    from openk3.train.config import RESUMABLE_FIELDS

    assert set(RESUMABLE_FIELDS) <= set(RunConfig.__dataclass_fields__)
