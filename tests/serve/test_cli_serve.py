"""``openk3 serve`` as a user runs it: a subprocess serving a saved checkpoint, reached with the
official ``openai`` client, stopped with Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from openk3 import build_model, preset, save_pretrained  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openk3_serve_checkpoint_end_to_end(tmp_path):
    ckpt = tmp_path / "debug-ckpt"
    save_pretrained(build_model(preset("debug"), seed=3), ckpt)
    port = _free_port()
    cmd = [sys.executable, "-m", "openk3", "serve", "--checkpoint", str(ckpt), "--port", str(port),
           "--api-key", "sk-cli", "--max-model-len", "256", "--max-num-seqs", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "openk3 serve did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
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
            proc.kill()
            raise
    assert proc.returncode == 0, out
