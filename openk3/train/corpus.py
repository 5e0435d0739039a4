"""Training corpora for ``openk3 train``: which files, and the documents in them.

**A corpus that is always there.** With no sources given we train on the Python standard
library of the running interpreter (~730 files, ~12 MB without its tests, PSF licence), so
``openk3 train --preset debug`` works on a fresh laptop with no network, and the result is a
small code model, fitting K3's coding focus. User data is text files, directories of text
files, or JSONL with a ``text`` field; a malformed JSONL line is reported as ``file:line``.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Files taken from a source directory. `.jsonl` files are read as JSONL (one document per
# line, its `text` field); the others are one document per file. `.json` is left out on
# purpose: a single JSON value has no agreed place for the text.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")

# Directories of the stdlib that are not part of the library itself.
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def default_corpus_files() -> list[Path]:
    """The embedded default corpus: every ``*.py`` of the running interpreter's stdlib.

    Test directories (``test``, ``tests``, ``idlelib/idle_test``, ``lib2to3/tests``) and
    installed packages (``site-packages``) are left out. Sorted, so the corpus (and the
    tokenizer and data trained from it) is the same on every run.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: site-packages alone can hold ten times the stdlib's files.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files)


def resolve_sources(sources: list[str] | None) -> list[Path]:
    """The concrete files behind ``sources``, in a deterministic order, checked to exist.

    ``sources=None`` is the default corpus (``default_corpus_files``). Otherwise each source
    is a file, or a directory searched recursively for ``TEXT_SUFFIXES`` (hidden files and
    directories skipped, sorted). Raises ValueError naming a missing source or a directory
    with no text files.
    """
    if sources is None:
        return default_corpus_files()
    if not sources:
        raise ValueError("no data sources given (pass None for the default stdlib corpus)")
    files: list[Path] = []
    for src in sources:
        path = Path(src).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and p.suffix in TEXT_SUFFIXES
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise ValueError(f"{path}: directory holds no text files ({', '.join(TEXT_SUFFIXES)})")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{path}: no such file or directory")
    return files


def read_documents(files: list[Path]) -> Iterator[str]:
    """The non-empty documents of ``files``, in order.

    A text file is one document, read as UTF-8 with undecodable bytes replaced; a ``.jsonl``
    file is one document per line, from its string ``text`` field (blank lines skipped).
    Raises ValueError naming the file, and ``file:line`` for a malformed JSONL line.
    """
    for path in files:
        yield from _read_file(path)


def _read_file(path: Path) -> Iterator[str]:
    if path.suffix != ".jsonl":
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise ValueError(f"{path}: cannot read ({e.strerror})") from e
        if text.strip():
            yield text
        return
    try:
        f = path.open("rb")
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from e
    with f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({e})") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'text' field")
            if obj["text"]:
                yield obj["text"]
