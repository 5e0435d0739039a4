"""``openk3 serve --api-servers N``: N HTTP server processes in front of one engine process.

One server process admits a burst of requests one at a time on its event loop (HTTP parsing,
FastAPI's route, the checks, the pipe to the engine: ~0.5-0.75 ms a request, on the same loop
that writes the admitted streams' chunks), so the last of 64 requests sent at once reached the
engine ~50 ms after the first (docs/serving.md, "Where the server's time goes"). With N server
processes the burst is admitted N at a time. vLLM's ``--api-server-count`` splits the same way.

The processes::

    supervisor (this)         binds the port, starts the others, forwards SIGINT / SIGTERM,
                              stops everything when one of them dies
    engine process            EngineProcess: LLMEngine with a connection per server
    N server processes        ProcessEngine.connect + openk3's app under uvicorn, all accepting
                              on the supervisor's listening socket (the kernel hands each new
                              connection to one of them)

Each server process runs its own process group, so a terminal's Ctrl-C reaches only the
supervisor (and the engine, which ignores it), which sends each server one SIGTERM: each drains
as ``openk3 serve`` with one server does (``server.serve``). A second Ctrl-C is forwarded as
SIGINT: uvicorn then cuts its connections at once. If the supervisor is killed, the servers get
SIGTERM from the kernel (Linux's parent-death signal) and the engine stops when its control
connection closes.

``/metrics``: the servers' histograms and counters are summed over the processes
(prometheus_client's multiprocess mode, a directory the supervisor makes and removes); the
engine's counters are the engine's, the same from every server.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from openk3.serve.config import GRACE_SECONDS, check_grace
from openk3.serve.engine import LLMEngine
from openk3.serve.engine_process import EngineInfo, EngineProcess


def _die_with_parent(parent: int) -> None:
    """SIGTERM this process when its parent (pid ``parent``) dies (Linux's
    ``prctl(PR_SET_PDEATHSIG)``), or now if it died before the request was made."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # orphaned while it started: nobody would ever stop it
        os.kill(os.getpid(), signal.SIGTERM)


def _server_main(parent: int, connection: Connection, info: EngineInfo, sock: socket.socket, started,
                 metrics_dir: str, model_name: str, api_key: str | None, chat_template, grace: float) -> None:
    """One server process (``parent``: the supervisor's pid): ``openk3 serve``'s app over its
    connection to the engine."""
    os.setpgrp()  # out of the terminal's process group: the supervisor forwards signals
    _die_with_parent(parent)
    # prometheus_client picks its multiprocess mode when first imported: before the app's import
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from openk3.serve.engine_process import ProcessEngine
    from openk3.serve.server import serve

    engine = ProcessEngine.connect(connection, info)
    serve(engine, model_name, api_key=api_key, chat_template=chat_template, sockets=[sock],
          started=started.set, metrics_dir=metrics_dir, grace=grace)


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (a port in use fails here, before a model loads), to
    share among server processes; ``ApiServers`` starts listening once the engine is up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


class ApiServers:
    """The engine process and ``count`` server processes on ``sock`` (``bound_socket``).
    Returns once every server accepts requests (or a signal came meanwhile: ``run`` then
    returns at once); raises as ``EngineProcess`` if the engine fails to start, and
    ``RuntimeError`` if a server process does (anything else that stops the start, such as an
    argument that cannot be sent to a server process, is raised as it is), with whatever had
    started stopped. ``run`` serves until a signal; ``stop`` (or leaving the ``with`` block)
    stops everything."""

    def __init__(self, factory: Callable[[], LLMEngine], count: int, sock: socket.socket, *,
                 api_key: str | None = None, chat_template=None, model_name: str | None = None,
                 grace: float = GRACE_SECONDS):
        if count < 1:
            raise ValueError(f"api_servers: {count} must be >= 1")
        check_grace(grace)
        self.grace = grace
        self.engine = EngineProcess(factory, clients=count)
        self.model_name = model_name or self.engine.info.model_name
        self.servers: list[multiprocessing.process.BaseProcess] = []
        self.stopping, self._stopped, self._previous = False, False, {}
        self.metrics_dir = tempfile.mkdtemp(prefix="openk3-metrics-")
        try:
            self._start(sock, api_key, chat_template)
        except BaseException:  # nothing left behind: servers, engine, directory, signal handlers
            self.stop()
            raise

    def _start(self, sock: socket.socket, api_key: str | None, chat_template) -> None:
        """Listen, then start a server process per engine connection; return once each accepts."""
        sock.listen(2048)
        # from here a signal stops everything, even while the servers start (a script's
        # `kill -INT` right after the first server answered was lost, then waited on forever)
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        ctx = multiprocessing.get_context("spawn")
        events = []
        for i, conn in enumerate(self.engine.connections):
            started = ctx.Event()
            proc = ctx.Process(target=_server_main, name=f"openk3-api-server-{i}",
                               args=(os.getpid(), conn, self.engine.info, sock, started, self.metrics_dir,
                                     self.model_name, api_key, chat_template, self.grace))
            proc.start()
            conn.close()  # the server process has its copy
            self.servers.append(proc)
            events.append(started)
        for i, (proc, started) in enumerate(zip(self.servers, events)):
            while not started.wait(0.1) and not self.stopping:
                if not proc.is_alive():
                    raise RuntimeError(f"API server {i} exited while starting (exit code {proc.exitcode})")
                if not self.engine.is_alive():
                    raise RuntimeError("the engine process exited while the API servers started")

    def __enter__(self) -> ApiServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _signal_servers(self, sig: int) -> None:
        for proc in self.servers:
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def _on_signal(self, sig, frame) -> None:
        # the first signal drains (SIGTERM to every server); a second Ctrl-C cuts (SIGINT)
        second = self.stopping and sig == signal.SIGINT
        self.stopping = True
        self._signal_servers(signal.SIGINT if second else signal.SIGTERM)

    def run(self) -> int:
        """Serve until SIGINT or SIGTERM (each server drains as ``server.serve`` does), or until
        a server or the engine dies (the rest are stopped: 1). 0 after a signal (also one that
        came while the servers started). Signals are handled from the constructor on, in the
        main thread."""
        try:
            failed = None
            # a process has ended once its sentinel is ready: its is_alive() may say True a little
            # longer (until the kernel lets it be reaped), so a death seen as "still alive" and
            # then left out of the next wait was never noticed, and run waited for ever
            servers = {p.sentinel: i for i, p in enumerate(self.servers)}
            engine = self.engine.process.sentinel
            while servers:
                watch_engine = engine is not None and not (self.stopping or failed)
                ready = wait([*servers, *([engine] if watch_engine else [])])
                ended = [servers.pop(s) for s in ready if s in servers]
                if engine in ready:
                    engine = None
                if self.stopping or failed:
                    continue
                if ended:
                    proc = self.servers[ended[0]]
                    proc.join()
                    failed = f"API server {ended[0]} exited (exit code {proc.exitcode})"
                elif engine is None:
                    self.engine.process.join()
                    failed = f"the engine process exited (exit code {self.engine.process.exitcode})"
                if failed:
                    print(f"openk3 serve: {failed}; stopping", file=sys.stderr, flush=True)
                    self.stopping = True
                    self._signal_servers(signal.SIGTERM)
            return 1 if failed else 0
        finally:
            self.stop()

    def stop(self, seconds: float = 10.0) -> None:
        """SIGTERM every server still running, wait up to ``seconds`` for them (then kill), stop
        the engine."""
        if self._stopped:
            return
        self._stopped = self.stopping = True
        self._signal_servers(signal.SIGTERM)
        for proc in self.servers:
            proc.join(timeout=seconds)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.engine.stop()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
