"""The fork server the multi-process tests launch their ranks from (``tests/forkserver.py``):
return values in rank order, torchrun's environment, a failing rank's traceback, a hang cut at
its timeout."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tests import forkserver

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server forks")


def _rank_and_env(rank: int, scale: int) -> tuple:
    return rank * scale, os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"], os.getpid()


def _fails_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one's own error")
    time.sleep(30)  # killed once rank 1 fails, as torchrun's other workers are


def _sleeps(rank: int) -> None:
    time.sleep(60)


def test_ranks_return_in_order_with_torchruns_environment():
    results = forkserver.spawn(_rank_and_env, 3, (10,))
    assert [r[:3] for r in results] == [(0, "0", "3"), (10, "1", "3"), (20, "2", "3")]
    assert len({r[3] for r in results}) == 1 and len({r[4] for r in results}) == 3  # one port, three processes


def test_a_failing_rank_fails_the_job_with_its_traceback_and_the_others_are_killed():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)exit 1.*rank one's own error"):
        forkserver.spawn(_fails_on_rank_one, 2)
    assert time.monotonic() - start < 20


def test_a_module_run_as_torchrun_would_and_a_hang_cut_at_its_timeout():
    code, out = forkserver.torchrun(["-m", "json.tool", "--help"], 2)
    assert code == 0 and out.count("usage:") == 2
    bare = forkserver.ForkServer(preload=())  # a server of its own: the hang kills it
    with pytest.raises(TimeoutError, match="past 1 s"):
        bare.run("call", f"{__name__}:_sleeps", 2, timeout=1)
    code, _, _, returns = bare.run("call", f"{__name__}:_rank_and_env", 1, args=(1,))  # a new server
    assert code == 0 and returns[0][0] == 0


class _Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise _Interrupted


_AT_EXIT = """
import atexit, threading, time
atexit.register(print, "atexit ran")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
"""


def test_a_rank_ends_as_an_interpreter_does_and_an_interrupted_wait_leaves_no_answer_behind():
    bare = forkserver.ForkServer(preload=())
    code, out, _, _ = bare.run("script", _AT_EXIT)
    assert code == 0 and out.splitlines() == ["thread finished", "atexit ran"]
    previous = signal.signal(signal.SIGALRM, _interrupt)  # as pytest-timeout ends a test's wait
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(_Interrupted):
            bare.run("script", "import time; time.sleep(5)", timeout=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    code, _, err, _ = bare.run("script", "raise SystemExit(3)")  # its own answer, not the cut job's
    assert code == 3, err
