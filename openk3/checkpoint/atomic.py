"""Directories written all at once or not at all.

A directory is built under a temporary name beside its final place and renamed into place; a
crash at any point leaves the previous version intact. Replacing a directory takes two renames
(the old one aside to ``.NAME.old-*/prev``, the new one in): a failure between them puts the old
one back, and so does the next write of the same directory after a writer killed there, before
it removes the temporaries left behind (``.NAME.tmp-*``, ``.NAME.old-*``). Nothing is fsynced:
a power loss can still lose what the page cache held. Files
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
    """Remove the temporaries of earlier, interrupted writes of ``path``; returns them. A writer
    killed between its two renames left no ``path`` and the previous version in
    ``.NAME.old-*/prev``: that version is put back first."""
    stale = [p for pattern in (f".{path.name}.tmp-*", f".{path.name}.old-*")
             for p in path.parent.glob(pattern)]
    for p in stale:
        _restore(p, path)
        shutil.rmtree(p, ignore_errors=True)
    return stale


def _restore(old: Path, path: Path) -> None:
    """Put ``old/prev`` (the version a swap moved aside) back at ``path`` if ``path`` is gone."""
    if (old / "prev").exists() and not os.path.lexists(path):
        os.replace(old / "prev", path)


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
    old = None
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
        if old is not None:  # failed between the two renames: the previous version goes back
            _restore(old, path)
            shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
