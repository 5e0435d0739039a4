"""``openk3.runtime``: device and dtype defaults, ``load_model`` (checkpoints, training runs,
random presets, and one clear error for every wrong combination), and the package's import rule."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import openk3
from openk3 import build_model, preset, save_pretrained
from openk3.runtime import checkpoint_dir, default_dtype, load_model, resolve_device, resolve_dtype


def test_device_and_dtype_defaults():
    assert resolve_device(None) == resolve_device("auto") == torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert default_dtype(torch.device("cpu")) == torch.float32
    assert default_dtype(torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    assert resolve_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='int8'"):
        resolve_dtype("int8", torch.device("cpu"))
    with pytest.raises(ValueError, match="device='gpu'"):
        resolve_device("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_devices_other_than_cpu_and_cuda_are_refused():
    with pytest.raises(ValueError, match="runs on 'cpu' or 'cuda'"):
        resolve_device("mps")


def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A training run's directory as the trainer leaves it: run_config.json and export/."""
    run = tmp_path_factory.mktemp("runs") / "d1"
    save_pretrained(build_model(preset("debug"), seed=5), run / "export")
    (run / "run_config.json").write_text(json.dumps({"run": {"preset": "debug"}}))
    return run


def test_a_training_run_means_its_export(run_dir):
    assert checkpoint_dir(run_dir) == run_dir / "export"
    assert checkpoint_dir(run_dir / "export") == run_dir / "export"
    with pytest.raises(ValueError, match=r"export: no tokenizer \(tokenizer.json or tiktoken.model\)"):
        load_model(run_dir, device="cpu")
    model, tokenizer, name = load_model(run_dir, device="cpu", tokenizer="bytes")
    assert name == "d1" and not model.training
    assert load_model(run_dir / "export", device="cpu", tokenizer="bytes")[2] == "d1"  # not "export"
    want = build_model(preset("debug"), seed=5)
    assert torch.equal(model.lm_head.weight, want.lm_head.weight)
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.encode("hi")


def test_a_training_run_without_export_is_a_clear_error(tmp_path):
    (tmp_path / "run_config.json").write_text("{}")
    with pytest.raises(ValueError, match="training run without export/"):
        load_model(tmp_path)


def test_random_preset():
    model, tok, name = load_model(preset="debug", random_init=True, dtype="bfloat16", seed=3)
    assert name == "openk3-debug" and next(model.parameters()).dtype == torch.bfloat16
    assert tok.decode([4000]) == "<4000>"  # every id of a random model is visible text


@pytest.mark.parametrize("kwargs,message", [
    ({}, "give checkpoint"),
    ({"checkpoint": "x", "preset": "debug"}, "not both"),
    ({"checkpoint": "x", "random_init": True}, "random_init=True applies to a preset"),
    ({"preset": "debug"}, "pass random_init=True"),
])
def test_wrong_arguments_give_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_model(**kwargs)


def test_nothing_in_the_package_imports_through_openk3_init():
    """``openk3/__init__.py`` imports the whole package; importing through it from inside hides
    dependency loops. Modules import from the module that defines a name."""
    root = Path(openk3.__file__).parent
    offenders = [f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
                 for path in sorted(root.rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if re.match(r"\s*(from openk3 import |import openk3\b(?!\.))", line)]
    assert not offenders, "\n".join(offenders)
