"""``openk3 serve`` as a user runs it: a subprocess serving a saved checkpoint, reached with the
official ``openai`` client, stopped with Ctrl-C; and its flags, one per ``EngineConfig`` field."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import openk3  # noqa: E402
from openk3 import build_model, preset, save_pretrained  # noqa: E402
from openk3.cli import build_parser, main  # noqa: E402
from openk3.serve import server as server_module  # noqa: E402
from openk3.serve.config import EngineConfig  # noqa: E402
from openk3.train.config import RunConfig  # noqa: E402
from tests.helpers import kill_tree  # noqa: E402

# The subprocess imports the openk3 these tests import, whatever is installed.
PYTHONPATH = [str(Path(openk3.__file__).parents[1])] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in PYTHONPATH if p)}


def _subparser(name: str):
    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    return sub.choices[name]


@pytest.mark.parametrize("command,config", [("serve", EngineConfig), ("train", RunConfig)])
def test_every_config_field_is_a_flag_of_the_same_name(command, config):
    options = {o: a for a in _subparser(command)._actions for o in a.option_strings}
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        flag = "--" + f.name.replace("_", "-")
        assert options[flag].dest == f.name, flag
        assert f"{config.__name__}.{f.name} (default " in options[flag].help, flag
        if hints[f.name] is bool:
            assert options["--no-" + flag[2:]] is options[flag], flag


def test_serve_flags_reach_the_engine(monkeypatch):
    served = {}
    monkeypatch.setattr(server_module, "serve", lambda engine, name, **kw: served.update(engine=engine, name=name))
    assert main(["serve", "--random-init", "--max-num-seqs", "3", "--max-num-batched-tokens", "40",
                 "--physical-block-size", "32", "--hash-block-size", "8", "--kda-checkpoint-interval", "16",
                 "--num-kda-checkpoints", "5", "--max-model-len", "200", "--no-enable-prefix-caching",
                 "--no-cuda-graphs", "--cache-memory-gb", "0.5", "--engine", "thread"]) == 0
    engine = served["engine"].engine
    served["engine"].shutdown()
    assert served["name"] == "openk3-debug"
    assert engine.config == EngineConfig(
        max_num_seqs=3, max_num_batched_tokens=40, physical_block_size=32, hash_block_size=8,
        kda_checkpoint_interval=16, num_kda_checkpoints=5, max_model_len=200, enable_prefix_caching=False,
        cuda_graphs=False, cache_memory_gb=0.5)
    assert engine.block_manager.config is engine.config is engine.scheduler.config
    assert engine.block_manager.block_size == 32 and engine.block_manager.num_state_slots == 3
    assert engine.scheduler.max_model_len == engine.max_model_len == 200


def test_serve_flags_left_out_keep_engine_config_defaults():
    args = build_parser().parse_args(["serve", "--random-init"])
    assert all(getattr(args, f.name) is None for f in dataclasses.fields(EngineConfig))


def test_serve_refuses_a_preset_without_weights(capsys):
    assert main(["serve", "--preset", "debug"]) == 2
    assert "random_init" in capsys.readouterr().err


def test_a_checkpoint_without_tokenizer_is_refused(tmp_path, capsys):
    save_pretrained(build_model(preset("debug"), seed=3), tmp_path / "ck")
    assert main(["serve", "--checkpoint", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer (tokenizer.json or tiktoken.model)" in err and err.count("\n") == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str) -> None:
    """Until ``openk3 serve`` at ``url`` answers /health (it failing, or 120 s, fails the test)."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "openk3 serve did not come up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.3)


def sigterm_mid_stream(proc: subprocess.Popen, url: str) -> tuple[list[str], float]:
    """SIGTERM ``proc`` once a long stream has sent three lines: the stream's lines, and the
    seconds from the signal to the stream's end."""
    lines = []
    body = {"prompt": "x", "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 3:  # the stream is running: stop the server
                proc.send_signal(signal.SIGTERM)
                stopped = time.monotonic()
    return lines, time.monotonic() - stopped


def test_openk3_serve_checkpoint_end_to_end(tmp_path):
    ckpt = tmp_path / "debug-ckpt"
    save_pretrained(build_model(preset("debug"), seed=3), ckpt)
    port = _free_port()
    cmd = [sys.executable, "-m", "openk3", "serve", "--checkpoint", str(ckpt), "--port", str(port),
           "--api-key", "sk-cli", "--tokenizer", "bytes", "--max-model-len", "256", "--max-num-seqs", "4",
           "--max-num-batched-tokens", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-cli", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["debug-ckpt"]
        r = client.completions.create(model="debug-ckpt", prompt="def f(x):", max_tokens=8,
                                      temperature=0, logprobs=1)
        assert r.choices[0].finish_reason in ("length", "stop")
        assert r.usage.completion_tokens == len(r.choices[0].logprobs.token_logprobs) >= 1
        streamed = client.completions.create(model="debug-ckpt", prompt="def f(x):", max_tokens=8,
                                             temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="debug-ckpt", prompt="x", max_tokens=1000)
        assert e.value.body["param"] == "max_tokens"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise
    assert proc.returncode == 0, out


def test_config_flags_take_tuples_and_json():
    args = build_parser().parse_args(["train", "--data", "a.txt", "b/", "--model-overrides",
                                      '{"num_hidden_layers": 4}', "--no-resume", "--lr", "0.5"])
    assert (args.data, args.model_overrides, args.resume, args.lr) == (["a.txt", "b/"], {"num_hidden_layers": 4},
                                                                      False, 0.5)


def test_sigterm_ends_streams_in_flight_with_an_error_event_and_done(tmp_path):
    """A stream still running when the grace period ends is closed properly: an error event,
    then [DONE]; the process exits cleanly, within the grace period and a little. A grace of 2 s
    (the default's 5 s cost CI 3 s here): the stream gets 1 s."""
    port = _free_port()
    cmd = [sys.executable, "-m", "openk3", "serve", "--random-init", "--port", str(port),
           "--max-model-len", "4096", "--no-cuda-graphs", "--shutdown-grace", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url)
        lines, waited = sigterm_mid_stream(proc, url)
        assert lines[-1] == "data: [DONE]"
        assert '"server_error"' in lines[-2] and "shutting down" in lines[-2]
        assert 0.8 < waited < 2.8, waited  # 1 s, not the default's 4
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            kill_tree(proc)
