"""Test processes forked from a server that has already imported torch and openk3.

A multi-process test used to start every rank as a fresh interpreter (``torchrun``, or
``torch.multiprocessing`` with ``spawn``), and each paid torch's and openk3's imports (~3-5 s
on CI's two cores, for every rank of every launch) before its first collective. Here a server
process imports them once and forks the ranks of each job; a child starts from the same fresh
state a new interpreter would have after those imports: the server runs no torch op (so no
OpenMP pool is forked) and starts no thread of its own (OpenBLAS's, which its import starts,
handles fork itself). A rank ends as an interpreter does: non-daemon threads joined, atexit
handlers run.

* ``spawn(fn, nprocs, args)``: ``fn(rank, *args)`` on ``nprocs`` children, as
  ``torch.multiprocessing.start_processes(..., join=True)``; returns each rank's return value
  and raises with the failed ranks' output.
* ``torchrun(argv, nproc)``: ``python -m torch.distributed.run --standalone --nproc-per-node
  N ARGV`` without the launcher's own process: each child gets torchrun's environment (``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...) and runs ``-m MODULE``
  or a script with ``argv``; returns the exit code (the first failed rank's, the others then
  killed, as torchrun does; a rank killed by a signal gives minus its number, where torchrun
  says 1) and the ranks' output.
* ``ForkServer.run(...)``: the general form, with its own environment and preloaded modules
  (``tests/ops/checks.py`` runs Triton-interpreter scripts in one).

Children of one server differ from fresh interpreters in two ways: Python's ``random`` and
numpy's global generator start from the server's state, the same in every rank; and their
environment is the server's (the test process's when the server started: a later
``monkeypatch.setenv`` does not reach them) plus what the job passes in ``env``. On a platform
without ``fork`` the same calls start fresh interpreters.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The server: reads jobs (a length line, then a pickled dict) from stdin, forks each job's ranks
# (their stdout and stderr go to the job's two files), answers a length line and a pickled (job
# id, exit code) once all have exited.
_SERVER = r"""
import atexit, importlib, os, pickle, runpy, signal, socket, sys, threading, time, traceback
for name in sys.argv[1:]:
    importlib.import_module(name)

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def child(job, rank, port, out, err):
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    code = 0
    try:
        os.environ.update(job["env"])
        n = job["nproc"]
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(n),
                          LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if "torch" in sys.modules and "OMP_NUM_THREADS" in job["env"]:  # OpenMP read it at torch's import
            sys.modules["torch"].set_num_threads(int(job["env"]["OMP_NUM_THREADS"]))
        kind, target = job["kind"], job["target"]
        if kind == "script":
            exec(compile(target, "<script>", "exec"), {"__name__": "__main__"})
        elif kind == "module":
            sys.argv = [target, *job["argv"]]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "path":
            sys.argv = [target, *job["argv"]]
            runpy.run_path(target, run_name="__main__")
        else:
            module, name = target.split(":")
            fn = getattr(importlib.import_module(module), name)
            result = fn(rank, *job["args"])
            with open(job["returns"][rank], "wb") as f:
                pickle.dump(result, f)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # the end of an interpreter: its non-daemon threads joined, its atexit handlers run
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code & 0xFF)

while header := sys.stdin.buffer.readline():
    job = pickle.loads(sys.stdin.buffer.read(int(header)))
    out = os.open(job["out"], os.O_WRONLY | os.O_APPEND)
    err = os.open(job["err"], os.O_WRONLY | os.O_APPEND)
    port = free_port()
    ranks = {}
    for rank in range(job["nproc"]):
        pid = os.fork()
        if pid == 0:
            child(job, rank, port, out, err)
        ranks[pid] = rank
    os.close(out)
    os.close(err)
    code, left = 0, set(ranks)
    while left:
        pid, status = os.wait()
        left.discard(pid)
        rank_code = os.waitstatus_to_exitcode(status)
        if rank_code and not code:  # the first failure: the other ranks go, as under torchrun
            code = rank_code
            for other in left:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while left and time.monotonic() < deadline:
                pid, status = os.waitpid(-1, os.WNOHANG)
                left.discard(pid) if pid else time.sleep(0.05)
            for other in left:
                os.kill(other, signal.SIGKILL)
    answer = pickle.dumps((job["id"], code))
    sys.stdout.buffer.write(b"%d\n" % len(answer) + answer)
    sys.stdout.buffer.flush()
"""


class ForkServer:
    """A server process (started on first use, ended at exit) that imported ``preload`` under
    ``env``; ``run`` forks a job's ranks in it. Jobs run one at a time."""

    def __init__(self, preload: tuple[str, ...], env: dict | None = None):
        self.preload, self.env = preload, env
        self._proc: subprocess.Popen | None = None
        self._jobs = 0

    def _server(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, *self.preload], env=self.env,
                                          cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          start_new_session=True)  # killed with its ranks on a timeout
            atexit.register(self._kill)
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def run(self, kind: str, target: str, nproc: int = 1, argv: tuple = (), args: tuple = (),
            env: dict | None = None, timeout: float = 240) -> tuple[int, str, str, list]:
        """One job: ``kind`` "script" (``target`` is source code), "module" (``-m target argv``),
        "path" (a script file with ``argv``) or "call" (``target`` "module:function", called as
        ``function(rank, *args)``) on ``nproc`` ranks, ``env`` added to theirs. Returns (exit code,
        stdout, stderr, each rank's return value for "call"). A job past ``timeout`` seconds kills
        the server with its ranks and raises TimeoutError with their output; so does anything else
        that interrupts the wait (pytest-timeout's 300 s, Ctrl-C), so that no later job reads this
        one's answer."""
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            self._jobs += 1
            job = {"id": self._jobs, "kind": kind, "target": target, "nproc": nproc, "argv": list(argv), "args": args,
                   "env": dict(env or {}), "out": str(tmp / "out"), "err": str(tmp / "err"),
                   "returns": [str(tmp / f"rank{r}.pkl") for r in range(nproc)]}
            (tmp / "out").touch()
            (tmp / "err").touch()
            server = self._server()
            data = pickle.dumps(job)
            try:
                server.stdin.write(b"%d\n" % len(data) + data)
                server.stdin.flush()
                header = self._readline(server, timeout, tmp)
                if not header:
                    raise RuntimeError(f"the fork server ended (exit {server.wait()}): {self._output(tmp)}")
                answered, code = pickle.loads(server.stdout.read(int(header)))
            except BaseException:
                self._kill()  # its ranks with it: the next job starts a new server
                raise
            if answered != job["id"]:
                raise RuntimeError(f"the fork server answered job {answered} for job {job['id']}")
            out, err = self._output(tmp)
            returns = [pickle.loads(p.read_bytes()) if code == 0 and p.exists() else None
                       for p in map(Path, job["returns"])]
            return code, out, err, returns

    def _readline(self, server: subprocess.Popen, timeout: float, tmp: Path) -> bytes:
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        if not ready:
            self._kill()
            out, err = self._output(tmp)
            raise TimeoutError(f"a forked job ran past {timeout} s; its output:\n{out[-3000:]}\n{err[-3000:]}")
        return server.stdout.readline()

    @staticmethod
    def _output(tmp: Path) -> tuple[str, str]:
        return ((tmp / "out").read_text(errors="replace"), (tmp / "err").read_text(errors="replace"))


# What the multi-process tests' ranks import: torch.distributed with FSDP and its checkpoints,
# and openk3's trainer and command line (which import the model, the ops and the parallel code).
_DISTRIBUTED = ForkServer(("torch", "torch.distributed", "torch.distributed.fsdp",
                           "torch.distributed.checkpoint", "openk3.cli", "openk3.train.trainer"))


def spawn(fn, nprocs: int, args: tuple = (), timeout: float = 240) -> list:
    """``fn(rank, *args)`` on ``nprocs`` forked ranks (``fn`` a module-level function, ``args``
    picklable); each rank's return value. Raises RuntimeError with the ranks' output if one
    failed (the others are then killed)."""
    target = f"{fn.__module__}:{fn.__qualname__}"
    if sys.platform != "linux":
        return _spawn_fresh(fn, nprocs, args)
    code, out, err, returns = _DISTRIBUTED.run("call", target, nprocs, args=args, timeout=timeout)
    if code != 0:
        raise RuntimeError(f"a rank of {target} failed (exit {code}):\n{out[-3000:]}\n{err[-6000:]}")
    return returns


def torchrun(argv: list[str], nproc: int, env: dict | None = None, timeout: float = 240) -> tuple[int, str]:
    """``torchrun --standalone --nproc-per-node nproc ARGV`` with ARGV ``["-m", MODULE, ...]`` or
    ``[SCRIPT, ...]``: (exit code, the ranks' stdout and stderr)."""
    if sys.platform != "linux":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *argv]
        run = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                             timeout=timeout, check=False)
        return run.returncode, run.stdout + run.stderr
    kind, target, rest = ("module", argv[1], argv[2:]) if argv[0] == "-m" else ("path", argv[0], argv[1:])
    code, out, err, _ = _DISTRIBUTED.run(kind, target, nproc, argv=rest, env=env, timeout=timeout)
    return code, out + err


def _spawn_fresh(fn, nprocs: int, args: tuple) -> list:
    """``spawn`` without fork: ``torch.multiprocessing``'s spawned interpreters."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_call_and_save, args=(fn, args, tmp), nprocs=nprocs, join=True, start_method="spawn")
        return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(nprocs)]


def _call_and_save(rank: int, fn, args: tuple, tmp: str) -> None:
    (Path(tmp) / f"rank{rank}.pkl").write_bytes(pickle.dumps(fn(rank, *args)))
