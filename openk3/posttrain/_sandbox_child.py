"""The child side of ``openk3.posttrain.sandbox``: never imported, only run as

    python -I -S -B -X utf8 _sandbox_child.py CONFIG_JSON STATUS_FD

in a new session by ``sandbox.run_python``. Standard library only. Three processes:

    bootstrap   this script's process: enters the namespaces, prepares the sandbox uid and the
                mounts, reports what is active on STATUS_FD, forks init and waits for it
      init      pid 1 of a new PID namespace where available, else a child subreaper: forks the
                program, enforces the wall-clock limit, kills every process left once the
                program ends, reports the exit status on STATUS_FD
        program drops to the sandbox uid, Landlock, resource limits, the audit hook where there
                is no network namespace; then runs main.py as ``__main__``

STATUS_FD carries JSON lines: ``{"protections": [...]}`` (bootstrap and program),
``{"setup_error": "..."}`` (program, when a protection it was asked for failed) and
``{"returncode": n, "timed_out": b, "cpu_s": x}`` (init, last).
"""

import atexit
import builtins
import ctypes
import json
import os
import resource
import signal
import sys
import time
import traceback  # imported before the uid drop: the stdlib may not be readable afterwards
import types

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
MS_NOSUID, MS_NODEV, MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 1, 32, 4096, 16384, 1 << 18
SETUP_FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def _ok(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def report(fd: int, **fields) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


# ---------------------------------------------------------------------------------- bootstrap


def enter_namespaces(root: bool, wanted: bool) -> int:
    """Unshare network + PID namespaces (root: + a mount namespace; others: inside a new user
    namespace, which is what lets an unprivileged user create the others). Tries without the PID
    namespace if that fails; returns the flags that took effect (0: none). Without ``wanted``,
    root still takes the mount namespace, which the sandbox uid may need to reach the stdlib."""
    uid, gid = os.getuid(), os.getgid()
    first = CLONE_NEWNET | CLONE_NEWPID | (CLONE_NEWNS if root else CLONE_NEWUSER)
    tries = (first, first & ~CLONE_NEWPID) if wanted else ()
    for flags in (*tries, *(CLONE_NEWNS,) * root):
        if libc.unshare(flags) == 0:
            if flags & CLONE_NEWUSER:  # map our own uid/gid only: no root inside either
                for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                                   ("gid_map", f"{gid} {gid} 1")):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
            if flags & CLONE_NEWNS:  # nothing mounted here may propagate to the host
                _ok(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
            return flags
    return 0


def _unsearchable_ancestor(path: str) -> str | None:
    """The topmost ancestor directory of ``path`` others may not enter (e.g. /root, mode 0700)."""
    cur = "/"
    for part in path.strip("/").split("/")[:-1]:
        cur = os.path.join(cur, part)
        if not os.stat(cur).st_mode & 0o001:
            return cur
    return None


def expose_paths(read_only: list[str], writable: list[str]) -> list[str]:
    """For the sandbox uid, in our private mount namespace: a directory it cannot enter (a
    Python installed under /root, say) is covered by an empty tmpfs into which just the paths it
    needs are bind-mounted back, read-only except ``writable``. Everything else there is hidden."""
    plan: dict[str, list[tuple[str, bool]]] = {}
    for path, rw in [(p, False) for p in read_only] + [(p, True) for p in writable]:
        if os.path.exists(path) and (top := _unsearchable_ancestor(path)):
            plan.setdefault(top, []).append((path, rw))
    for top, paths in plan.items():
        fds = [(path, rw, os.open(path, os.O_PATH)) for path, rw in paths]  # before the tmpfs hides them
        _ok(libc.mount(b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=755,size=1m"),
            f"mount tmpfs on {top}")
        for path, rw, fd in fds:
            source = f"/proc/self/fd/{fd}"
            if os.path.isdir(source):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "w").close()
            _ok(libc.mount(source.encode(), path.encode(), None, MS_BIND | MS_REC, None), f"bind {path}")
            if not rw:
                _ok(libc.mount(None, path.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None),
                    f"read-only {path}")
            os.close(fd)
    return sorted(plan)


def main() -> None:
    config_path, status_fd = sys.argv[1], int(sys.argv[2])
    with open(config_path) as f:
        cfg = json.load(f)
    os.unlink(config_path)
    os.umask(0o022)
    root = os.geteuid() == 0
    protections = ["subprocess", "session", "tmpdir", "rlimits"]
    flags = enter_namespaces(root, cfg["namespaces"])
    protections += [name for bit, name in ((CLONE_NEWUSER, "userns"), (CLONE_NEWNET, "netns"),
                                           (CLONE_NEWPID, "pidns"), (CLONE_NEWNS, "mountns")) if flags & bit]
    uid = None
    if root:  # rlimits do not bind root (RLIMIT_NPROC is not even checked): run as a fresh uid
        uid = cfg["uid_base"] + os.getpid()
        os.chown(cfg["workdir"], uid, uid)
        protections.append("uid")
        if flags & CLONE_NEWNS:
            hidden = expose_paths([p for p in sys.path if p], [cfg["workdir"]])
            protections += [f"hidden:{p}" for p in hidden]
    report(status_fd, protections=protections)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        init_main(cfg, status_fd, flags, uid)  # never returns
    os.close(status_fd)
    _to_devnull()
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _to_devnull() -> None:
    """Let go of the program's stdin/stdout/stderr so that the caller sees EOF when it ends."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


# ---------------------------------------------------------------------------------------- init


def _children(pid: int) -> list[int]:
    """Pids of ``pid``'s children, from /proc (the field after the command's closing paren)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def kill_everything_else(pidns: bool) -> None:
    """Kill and reap every process the program left. In our PID namespace that is kill(-1)
    (everyone but pid 1); otherwise we are a child subreaper, so every orphan of the program was
    re-parented to us: kill our children until none remain."""
    if pidns:
        assert os.getpid() == 1  # kill(-1) anywhere else would mean everything the user owns
        while True:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
    for _ in range(100_000):
        kids = _children(os.getpid())
        if not kids:
            return
        for kid in kids:
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reaped = False
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                reaped = True
        except ChildProcessError:
            pass
        if not reaped:
            time.sleep(0.001)


def init_main(cfg: dict, status_fd: int, flags: int, uid: int | None) -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # bootstrap killed -> so are we (and the namespace)
    pidns = bool(flags & CLONE_NEWPID)
    if not pidns:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # waited for with sigtimedwait
    deadline = time.monotonic() + cfg["wall_seconds"]
    pid = os.fork()
    if pid == 0:
        program_main(cfg, status_fd, flags, uid)  # never returns
    _to_devnull()
    status = rusage = None
    timed_out = False
    while status is None:
        try:
            while True:  # reap whatever exited: the program, or orphans re-parented to us
                wpid, st, ru = os.wait4(-1, os.WNOHANG)
                if wpid == 0:
                    break
                if wpid == pid:
                    status, rusage = st, ru
        except ChildProcessError:
            pass
        if status is not None:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            _, status, rusage = os.wait4(pid, 0)
            break
        signal.sigtimedwait({signal.SIGCHLD}, remaining)
    kill_everything_else(pidns)
    report(status_fd, returncode=os.waitstatus_to_exitcode(status), timed_out=timed_out,
           cpu_s=round(rusage.ru_utime + rusage.ru_stime, 3))
    os._exit(0)


# ------------------------------------------------------------------------------------- program

# Landlock (Linux >= 5.13), https://docs.kernel.org/userspace-api/landlock.html
LL_CREATE_RULESET, LL_ADD_RULE, LL_RESTRICT_SELF = 444, 445, 446  # the same on every architecture
LL_WRITE_FILE, LL_TRUNCATE, LL_REFER = 1 << 1, 1 << 14, 1 << 13
LL_WRITES = LL_WRITE_FILE | (1 << 4) | (1 << 5) | sum(1 << b for b in range(6, 13))  # remove/make anything
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1, 2
LL_SCOPE_ABSTRACT_UNIX, LL_SCOPE_SIGNAL = 1, 2


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(workdir: str) -> list[str]:
    """Writes only beneath ``workdir`` (and to /dev/null); with ABI >= 4 no TCP bind/connect;
    with ABI >= 6 no signals to, nor abstract unix sockets of, processes outside the sandbox."""
    abi = libc.syscall(LL_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return []
    fs = LL_WRITES | (LL_REFER if abi >= 2 else 0) | (LL_TRUNCATE if abi >= 3 else 0)
    net = LL_NET_BIND_TCP | LL_NET_CONNECT_TCP if abi >= 4 else 0
    scoped = LL_SCOPE_ABSTRACT_UNIX | LL_SCOPE_SIGNAL if abi >= 6 else 0
    attr = _RulesetAttr(fs, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _ok(libc.syscall(LL_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                               ctypes.c_uint32(0)), "landlock_create_ruleset")
    for path, access in ((workdir, fs), (os.devnull, LL_WRITE_FILE | (LL_TRUNCATE if abi >= 3 else 0))):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = _PathBeneath(access, fd)
        _ok(libc.syscall(LL_ADD_RULE, ruleset, 1, ctypes.byref(rule), ctypes.c_uint32(0)),
            f"landlock_add_rule {path}")
        os.close(fd)
    _ok(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _ok(libc.syscall(LL_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)
    return ["landlock-fs"] + ["landlock-net"] * bool(net) + ["landlock-scope"] * bool(scoped)


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/status") as f:
                count += any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in f)
        except (OSError, ValueError):
            pass
    return count


def nproc_limit(max_processes: int, flags: int, uid: int | None) -> int:
    """RLIMIT_NPROC counts every process of the real uid (since Linux 5.14: per user namespace).
    A fresh uid (root) counts only this sandbox: the program itself. In our own user namespace
    on >= 5.14 it also counts bootstrap and init. Otherwise the user's other processes count too,
    so the limit is what they have now plus ``max_processes``."""
    if uid is not None:
        return max_processes
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if flags & CLONE_NEWUSER and release >= (5, 14):
        return max_processes + 2
    return _processes_of(os.getuid()) + max_processes - 1


_AUDIT_BLOCKED = ("socket.", "ctypes.", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                  "subprocess.", "pty.")
_IMPORT_BLOCKED = frozenset({"_socket", "_ctypes", "_posixsubprocess", "_multiprocessing"})


def _audit_hook(event: str, args: tuple) -> None:
    """No network namespace: refuse sockets, and whatever could start a program or reach libc
    without this hook (exec, spawn, ctypes). Only Python-level; documented in posttraining.md."""
    if event.startswith(_AUDIT_BLOCKED) or (event == "import" and args[0] in _IMPORT_BLOCKED):
        what = f"import {args[0]}" if event == "import" else event
        raise PermissionError(f"sandbox: {what} is not allowed (no network namespace)")


def program_main(cfg: dict, status_fd: int, flags: int, uid: int | None) -> None:
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        protections = []
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            if os.getuid() != uid or os.geteuid() != uid:
                raise OSError("could not drop to the sandbox uid")
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if cfg["landlock"]:
            protections += landlock(cfg["workdir"])
        limits = [(resource.RLIMIT_CORE, 0),
                  (resource.RLIMIT_CPU, (cfg["cpu_seconds"], cfg["cpu_seconds"] + 1)),
                  (resource.RLIMIT_AS, cfg["memory_bytes"]),
                  (resource.RLIMIT_FSIZE, cfg["file_bytes"]),
                  (resource.RLIMIT_NOFILE, cfg["open_files"]),
                  (resource.RLIMIT_NPROC, nproc_limit(cfg["max_processes"], flags, uid))]
        for which, value in limits:
            soft, hard = value if isinstance(value, tuple) else (value, value)
            resource.setrlimit(which, (soft, hard))
        if not flags & CLONE_NEWNET:
            sys.addaudithook(_audit_hook)
            protections.append("audit-hook")
        os.chdir(cfg["workdir"])
        report(status_fd, protections=protections)
        os.close(status_fd)
    except BaseException as e:  # noqa: BLE001 - report any failure of the setup, then stop
        try:
            report(status_fd, setup_error=f"{type(e).__name__}: {e}")
        finally:
            os._exit(SETUP_FAILED)
    os._exit(run_main(cfg["main"]))


def run_main(path: str) -> int:
    """Run ``path`` as ``__main__`` the way ``python path`` would; returns the exit code."""
    module = types.ModuleType("__main__")
    module.__file__, module.__builtins__ = path, builtins
    sys.modules["__main__"], sys.argv = module, [path]
    code = 0
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            source = f.read()
        exec(compile(source, path, "exec"), module.__dict__)  # noqa: S102 - running it is the point
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # noqa: BLE001 - the program's own error, printed as Python would
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this file's frame
        code = 1
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()  # wait for non-daemon threads, as interpreter exit does
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001, S110 - a closed pipe at exit changes nothing
        pass
    return code & 0xFF


if __name__ == "__main__":
    main()
