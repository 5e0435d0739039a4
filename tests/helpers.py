"""Shared test helpers: loading fla-core's pure-PyTorch references without importing fla
(the package import needs triton, which CPU CI does not have); an HTTP app served by uvicorn on a
free port in a thread; killing a process with every process it started."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest


def load_fla_file(relpath: str):
    """Load ``fla/<relpath>`` as a standalone module, or skip if fla-core is not installed."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed")
    path = Path(spec.submodule_search_locations[0]) / relpath
    mod_spec = importlib.util.spec_from_file_location(f"fla_ref_{path.stem}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def uvicorn_thread(app):
    """Serve ``app`` with uvicorn on a free local port in a daemon thread; yields its base URL
    (``http://127.0.0.1:PORT``) and stops the server on exit."""
    uvicorn = pytest.importorskip("uvicorn")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _descendants(pid: int) -> list[int]:
    """Every running process started by ``pid``, its children's children included (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the field after the name
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process it started, then reap it. A failed test's ``openk3
    serve`` must not leave its engine or server processes (process groups of their own) running
    into the tests after it."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
