"""atomic_directory: a failed or killed write never loses the previous version."""

import os

import pytest

from openk3.checkpoint import atomic
from openk3.checkpoint.atomic import atomic_directory


def _write(path, text):
    with atomic_directory(path) as tmp:
        (tmp / "weights").write_text(text)


def test_a_failure_between_the_two_renames_puts_the_previous_version_back(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    _write(ck, "v1")
    real, calls = os.replace, []

    def second_fails(a, b):  # path -> old/prev, then tmp -> path fails (EIO, a full disk, ...)
        calls.append(b)
        if len(calls) == 2:
            raise OSError("simulated")
        return real(a, b)

    monkeypatch.setattr(atomic.os, "replace", second_fails)
    with pytest.raises(OSError, match="simulated"):
        _write(ck, "v2")
    monkeypatch.undo()
    assert (ck / "weights").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_a_writer_killed_between_the_renames_is_undone_by_the_next_write(tmp_path):
    ck = tmp_path / "ck"
    _write(ck, "v1")
    old = tmp_path / ".ck.old-x"  # what a writer killed after its first rename leaves
    old.mkdir()
    os.replace(ck, old / "prev")
    (tmp_path / ".ck.tmp-y").mkdir()
    with pytest.raises(RuntimeError):
        with atomic_directory(ck):
            assert (ck / "weights").read_text() == "v1"  # back before this write begins
            raise RuntimeError
    assert (ck / "weights").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    _write(ck, "v2")
    assert (ck / "weights").read_text() == "v2"
