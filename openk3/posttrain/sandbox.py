"""Run untrusted Python (model completions) in a sandbox: a separate, isolated interpreter in its
own session, a private temporary directory, resource limits, no network, killed as a whole.

``run_python(code, stdin, limits)`` never runs ``code`` in the caller's process. It starts
``python -I -S -B`` on ``_sandbox_child.py`` (standard library only), which sets the sandbox up
from inside the child before running ``code`` as ``__main__``. Doing it there, rather than in a
``preexec_fn``, keeps the fork from a multithreaded trainer async-signal-safe (subprocess's own
C code forks and execs); the limits still apply before one line of ``code`` runs.

Protections, each tried and reported in ``SandboxResult.protections`` (docs/posttraining.md,
"Sandbox", says which are active where):

- ``subprocess``, ``session``: a separate interpreter (``-I -S``: no environment, no site, no
  user site-packages), a new session whose process group is killed with ``os.killpg`` at the end.
- ``tmpdir``: a private working directory, mode 0700, removed afterwards.
- ``rlimits``: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC (fork bombs),
  RLIMIT_CORE = 0; the wall-clock limit is enforced by the child's init and, as a backstop, here.
- ``netns`` (+ ``userns`` when not root): a new, empty network namespace: no interface but a
  down loopback. ``pidns``: a new PID namespace whose init kills every process the program left.
  ``mountns`` (root): a private mount namespace (see ``hidden:``).
- ``uid`` (root only): the program runs as a fresh unprivileged uid (``0x70000000 + bootstrap pid``), so
  RLIMIT_NPROC applies (root is exempt) and counts this sandbox alone, and file permissions
  protect everything it does not own. ``hidden:DIR``: DIR (e.g. ``/root``, holding the Python
  installation) is replaced, for the sandbox only, by a tmpfs with just the interpreter's
  library paths bind-mounted back read-only.
- ``landlock-fs`` (Linux >= 5.13): writes only beneath the working directory and to /dev/null;
  ``landlock-net`` (ABI >= 4): no TCP connect/bind; ``landlock-scope`` (ABI >= 6): no signals to
  processes outside the sandbox, no abstract unix sockets outside it.
- ``audit-hook``: only where no network namespace could be made: a ``sys.addaudithook`` hook in
  the child refuses socket creation, ctypes, exec/spawn/system and subprocess.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

_CHILD = str(Path(__file__).with_name("_sandbox_child.py"))
_BACKSTOP_S = 3.0  # the child's init enforces wall_seconds; we kill the whole group this much later
_SETUP_FAILED = 125
_UID_BASE = 0x70000000  # root runs the program as _UID_BASE + the bootstrap's pid: a fresh uid per run


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run. ``cpu_seconds`` is rounded up to whole seconds (RLIMIT_CPU's
    unit; the process gets SIGXCPU there and SIGKILL a second later). ``memory_bytes`` is the
    address space (RLIMIT_AS) of each process, ``file_bytes`` the largest file it may write,
    ``output_bytes`` the stdout and the stderr kept (each; the rest is not read: the pipe is
    closed and the program gets EPIPE), ``max_processes`` the processes it may have at once,
    itself included (see ``nproc_limit`` in ``_sandbox_child.py`` for how exactly)."""

    cpu_seconds: float = 2.0
    wall_seconds: float = 5.0
    memory_bytes: int = 256 << 20
    output_bytes: int = 64 << 10
    max_processes: int = 16
    file_bytes: int = 16 << 20
    open_files: int = 64

    def __post_init__(self):
        for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "output_bytes", "max_processes",
                     "file_bytes", "open_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    """``returncode``: the program's exit code, negative for a signal (as ``subprocess``), None if
    it did not finish (timed out). ``killed_reason``: "wall_time", "output_limit", "cpu_time",
    "memory" (a MemoryError or an allocation failure ended it), "setup" (a protection could not
    be set up; ``stderr`` says which) or None. ``protections``: what was active (module doc)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    duration_s: float
    truncated: bool = False
    cpu_s: float | None = None
    protections: tuple[str, ...] = field(default=())


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), *,
               namespaces: bool = True, landlock: bool = True) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a sandbox, feeding it ``stdin``; never raises for anything
    the code does. ``namespaces=False`` / ``landlock=False`` skip those protections (the tests
    use it to exercise the fallbacks)."""
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="openk3-sandbox-")
    proc = None
    try:
        main = os.path.join(workdir, "main.py")
        with open(main, "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        os.chmod(main, 0o644)
        config = os.path.join(workdir, ".sandbox.json")
        with open(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            json.dump({"workdir": workdir, "main": main, "namespaces": namespaces, "landlock": landlock,
                       "uid_base": _UID_BASE,
                       "cpu_seconds": max(1, math.ceil(limits.cpu_seconds)),
                       "wall_seconds": limits.wall_seconds, "memory_bytes": limits.memory_bytes,
                       "file_bytes": limits.file_bytes, "open_files": limits.open_files,
                       "max_processes": limits.max_processes}, f)
        status_r, status_w = os.pipe()  # the child's reports; _communicate closes status_r
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-X", "utf8", _CHILD, config, str(status_w)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir,
                env=_environment(workdir), start_new_session=True, pass_fds=(status_w,))
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        deadline = start + limits.wall_seconds + _BACKSTOP_S
        out, err, status, truncated = _communicate(proc, stdin.encode("utf-8", "replace"), status_r,
                                                   limits.output_bytes, deadline)
        backstop = not _exited(proc, deadline)
    finally:
        if proc is not None:
            _kill_group(proc, workdir)
        shutil.rmtree(workdir, onerror=_force_remove)
    return _result(proc.returncode, out, err, status, truncated, backstop, time.monotonic() - start,
                   max(1, math.ceil(limits.cpu_seconds)))


def _environment(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _communicate(proc: subprocess.Popen, data: bytes, status_fd: int, limit: int,
                 deadline: float) -> tuple[bytes, bytes, bytes, bool]:
    """Feed stdin and read stdout, stderr and the status pipe until all are closed, the
    bootstrap has exited (then what is left in the pipes is read without waiting: a writer still
    alive is a process that escaped init) or the deadline passes. Keeps at most ``limit`` bytes
    of stdout and of stderr: past that, that pipe is closed (the program's next write fails) and
    ``truncated`` is set."""
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    files = {out_fd: proc.stdout, err_fd: proc.stderr}
    bufs = {fd: bytearray() for fd in (*files, status_fd)}
    caps = dict.fromkeys(files, limit) | {status_fd: 1 << 20}
    truncated = False
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    sent = 0
    if data:
        os.set_blocking(in_fd, False)
        sel.register(in_fd, selectors.EVENT_WRITE)
        files[in_fd] = proc.stdin
    else:
        proc.stdin.close()

    try:
        pidfd = os.pidfd_open(proc.pid)  # Linux >= 5.3: readable once the bootstrap has exited
        sel.register(pidfd, selectors.EVENT_READ)
    except (AttributeError, OSError):
        pidfd = None

    def close(fd: int) -> None:
        sel.unregister(fd)
        files[fd].close() if fd in files else os.close(fd)

    def read(fd: int) -> None:
        nonlocal truncated
        chunk = os.read(fd, 65536)
        room = caps[fd] - len(bufs[fd])
        bufs[fd] += chunk[:room]
        truncated |= len(chunk) > room
        if not chunk or len(chunk) > room:
            close(fd)

    try:
        while sel.get_map() and (remaining := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == pidfd:
                    for pipe in [f for f in sel.get_map() if f in bufs]:
                        os.set_blocking(pipe, False)
                        try:
                            while pipe in sel.get_map():
                                read(pipe)
                        except BlockingIOError:
                            pass
                    for left in list(sel.get_map()):
                        close(left)
                    break
                if fd == in_fd:
                    try:
                        sent += os.write(fd, data[sent:sent + 65536])
                    except BlockingIOError:
                        continue
                    except OSError:  # the program exited or closed its stdin
                        sent = len(data)
                    if sent >= len(data):
                        close(fd)
                    continue
                read(fd)
    finally:
        for fd in list(sel.get_map()):
            close(fd)
        sel.close()
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), bytes(bufs[status_fd]), truncated


def _exited(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait until ``proc`` has exited, without reaping it (its pid, which is also the process
    group's id, stays reserved until ``_kill_group`` has used it). False: the deadline passed."""
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def _kill_group(proc: subprocess.Popen, workdir: str) -> None:
    """SIGKILL whatever is left of the sandbox's process group, then reap the bootstrap. If the
    bootstrap did not end cleanly (its init was killed, so init's cleanup may not have run), also
    kill the run's processes that left the group: as root, every process of the run's sandbox
    uid; otherwise those whose command line names the run's directory (forks keep the
    bootstrap's). Done before reaping: until then the pid, hence the uid, cannot be reused."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    status = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if status is None or status.si_code != os.CLD_EXITED or status.si_status != 0:
        uid = _UID_BASE + proc.pid if os.geteuid() == 0 else None
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid() and _belongs(entry, uid, workdir.encode()):
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except OSError:
                    pass
    proc.wait()


def _belongs(pid: str, uid: int | None, marker: bytes) -> bool:
    try:
        if uid is not None:
            with open(f"/proc/{pid}/status") as f:
                return any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in f)
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False


def _force_remove(function, path, _excinfo) -> None:
    """rmtree's error handler: the program may have taken the permissions off a directory."""
    try:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        function(path)
    except OSError:
        pass


def _result(returncode: int | None, out: bytes, err: bytes, status: bytes, truncated: bool,
            backstop: bool, duration: float, cpu_limit: int) -> SandboxResult:
    """Put together what the child reported and what we saw."""
    info: dict = {"protections": []}
    for line in status.decode("utf-8", "replace").splitlines():
        try:
            report = json.loads(line)
        except ValueError:
            continue
        info["protections"] += report.pop("protections", [])
        info.update(report)
    stderr = err.decode("utf-8", "replace")
    timed_out = backstop or bool(info.get("timed_out"))
    code = None if timed_out else info.get("returncode")
    reason = None
    if "setup_error" in info:
        stderr = f"sandbox setup failed: {info['setup_error']}\n{stderr}"
        reason, code = "setup", _SETUP_FAILED
    elif code is None and not timed_out:  # the child died before init reported: report it
        code = returncode
    last = stderr.rstrip().rsplit("\n", 1)[-1]
    if reason:
        pass
    elif timed_out:
        reason = "wall_time"
    elif truncated:
        reason = "output_limit"
    elif code == -signal.SIGXCPU or (code == -signal.SIGKILL and info.get("cpu_s", 0) >= cpu_limit):
        reason = "cpu_time"
    elif last.startswith("MemoryError"):
        reason = "memory"
    return SandboxResult(returncode=code, stdout=out.decode("utf-8", "replace"), stderr=stderr,
                         timed_out=timed_out, killed_reason=reason, duration_s=round(duration, 4),
                         truncated=truncated, cpu_s=info.get("cpu_s"),
                         protections=tuple(info["protections"]))


@cache
def sandbox_protections() -> tuple[str, ...]:
    """What ``run_python`` gets on this machine (one trivial run, cached)."""
    return run_python("pass").protections
