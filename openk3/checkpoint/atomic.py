"""Directories written all at once or not at all.

A directory is built under a temporary name beside its final place and renamed into place; a
crash at any point leaves the previous version intact. Temporaries a killed writer left behind
(``.NAME.tmp-*``, ``.NAME.old-*``) are removed by the next write of the same directory. Files
and directories get ordinary permissions (``0o777`` / ``0o666`` less the umask), as every other
tool writes them, not ``mkdtemp``'s private ``0o700``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_partials(path: Path) -> list[Path]:
    """Remove the temporaries of earlier, interrupted writes of ``path``; returns them."""
    stale = [p for pattern in (f".{path.name}.tmp-*", f".{path.name}.old-*")
             for p in path.parent.glob(pattern)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def _ordinary_permissions(root: Path) -> None:
    """mkdtemp makes ``0o700`` directories and some writers (safetensors) ``0o600`` files."""
    mask = _umask()
    root.chmod(0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~mask)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~mask)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_directory(path) as tmp:`` write into ``tmp``; on a clean exit ``tmp``
    replaces ``path`` (an existing ``path`` is swapped out, then removed); on an exception it
    is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_partials(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        _ordinary_permissions(tmp)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / "prev")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
