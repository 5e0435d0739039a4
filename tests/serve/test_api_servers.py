"""``openk3 serve --api-servers N``: N server processes on one port in front of one engine
process answer as one server does (outputs, summed /metrics, a drained shutdown), and a server
process that dies stops the rest."""

from __future__ import annotations

import glob
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from openk3 import build_model, preset  # noqa: E402
from openk3.serve.api_servers import ApiServers, bound_socket  # noqa: E402
from openk3.serve.engine import LLMEngine  # noqa: E402
from openk3.serve.sampler import SamplingParams  # noqa: E402
from openk3.tokenizer import VisibleTokenizer  # noqa: E402
from tests.helpers import kill_tree  # noqa: E402
from tests.serve.test_cli_serve import ENV, _free_port, sigterm_mid_stream, wait_until_healthy  # noqa: E402
from tests.serve.test_engine_process import debug_engine  # noqa: E402


def _metric(text: str, name: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ") or x.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def test_two_api_servers_answer_as_one_and_drain_on_sigterm():
    port = _free_port()
    cmd = [sys.executable, "-m", "openk3", "serve", "--random-init", "--port", str(port), "--api-servers", "2",
           "--max-model-len", "4096", "--no-cuda-graphs", "--shutdown-grace", "2.5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)  # as a terminal runs it: a process group of its own
    url = f"http://127.0.0.1:{port}"
    # what `openk3 serve --random-init` serves: the debug preset, seed 0, every id visible
    model = build_model(preset("debug"), seed=0).eval()
    expected = LLMEngine(model, VisibleTokenizer(), eos_token_ids=()).generate(
        ["Hello"], SamplingParams(temperature=0, max_tokens=6))[0].text
    try:
        wait_until_healthy(proc, url)
        # the first server answers /health while the second may still be starting (it did on a
        # slow CI host, and the SIGTERM below then stopped it before its startup line): wait for
        # the supervisor's line, printed once every server process listens
        head = []
        for line in proc.stdout:
            head.append(line)
            if "API server processes on" in line:
                break
        texts = [None] * 6

        def ask(i):  # a connection each: the kernel hands them to either server process
            with httpx.Client(timeout=60) as client:
                r = client.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0})
                texts[i] = r.json()["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert texts == [expected] * len(texts)
        metrics = httpx.get(url + "/metrics", timeout=10).text  # one process answers for all
        assert _metric(metrics, "openk3_requests_finished_total") == len(texts)
        assert _metric(metrics, "openk3_time_to_first_token_seconds_count") == len(texts)
        assert _metric(metrics, "openk3_generation_tokens_total") == 6 * len(texts)

        lines, waited = sigterm_mid_stream(proc, url)  # to the supervisor
        assert lines[-1] == "data: [DONE]"
        assert '"server_error"' in lines[-2] and "shutting down" in lines[-2]
        assert 1.2 < waited < 3.3, waited  # the responses' 1.5 s of a 2.5 s grace, not the default's 4
        out = "".join(head) + proc.communicate(timeout=30)[0]
        assert proc.returncode == 0, out
        assert out.count("Application startup complete") == 2
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def test_a_server_process_that_dies_stops_the_others_and_the_engine():
    with bound_socket("127.0.0.1", 0) as sock:
        servers = ApiServers(debug_engine, 2, sock)
        try:
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == "dbg"
            # an ended process's is_alive() may say True until the kernel lets it be reaped (a run
            # that asked it missed the death, then waited for ever): here, until it is joined
            dying = servers.servers[1]
            dying.is_alive = lambda: dying._popen.returncode is None
            os.kill(dying.pid, signal.SIGKILL)
            hung = []

            def unblock():  # a run that missed the death: end it (and this test) in a minute
                hung.append(True)
                for proc in (*servers.servers, servers.engine.process):
                    proc.kill()
                dying.join()

            watchdog = threading.Timer(60, unblock)
            watchdog.start()
            try:
                assert servers.run() == 1
            finally:
                watchdog.cancel()
            assert not hung, "run() did not notice the dead server"
        finally:
            servers.stop()
    assert not any(p.is_alive() for p in servers.servers) and not servers.engine.is_alive()
    assert servers.servers[0].exitcode == 0 and not os.path.exists(servers.metrics_dir)


def test_a_failed_start_leaves_nothing_behind():
    """A server process that cannot be started (its chat template does not pickle): the error is
    raised, the engine process stopped, the metrics directory removed, the signal handlers
    restored."""
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "openk3-metrics-*")))
    with bound_socket("127.0.0.1", 0) as sock, pytest.raises(Exception, match="pickle"):
        ApiServers(debug_engine, 2, sock, chat_template=lambda: None)
    assert not [p.name for p in multiprocessing.active_children() if p.name.startswith("openk3-")]
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "openk3-metrics-*"))) == dirs
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def test_several_api_servers_need_the_engine_process(capsys):
    from openk3.cli import main

    assert main(["serve", "--random-init", "--engine", "thread", "--api-servers", "2"]) == 2
    assert "--api-servers above 1 needs --engine process" in capsys.readouterr().err
    assert main(["serve", "--random-init", "--api-servers", "0"]) == 2
    assert "--api-servers 0 must be >= 1" in capsys.readouterr().err
    for grace in ("0.5", "inf", "nan"):
        assert main(["serve", "--random-init", "--shutdown-grace", grace]) == 2
        assert f"--shutdown-grace {float(grace)} must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="shutdown grace: 0.5 s must be >= 1"):
        ApiServers(debug_engine, 1, None, grace=0.5)  # before anything starts
