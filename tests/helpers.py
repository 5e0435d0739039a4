"""Shared test helpers: loading fla-core's pure-PyTorch references without importing fla
(the package import needs triton, which CPU CI does not have); an HTTP app served by uvicorn on a
free port in a thread."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
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
