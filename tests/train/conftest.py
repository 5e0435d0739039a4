"""A small mixed corpus shared by the corpus and data tests."""

import json

import pytest


@pytest.fixture
def corpus_docs():
    """60 documents, each with a unique marker, so a decoded split tells which it holds."""
    return [f"# document {i:03d}\ndef f_{i}(x):\n    return x * {i} + len('héllo wörld')\n" * 3
            for i in range(60)]


@pytest.fixture
def mixed_corpus(tmp_path, corpus_docs):
    """Sources: a directory of .py/.txt/.md files (40 documents) and a JSONL file (20)."""
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    for i, doc in enumerate(corpus_docs[:40]):
        (d / ("sub" if i % 2 else "") / f"f{i:03d}{['.py', '.txt', '.md'][i % 3]}").write_text(doc)
    (d / "notes.bin").write_bytes(b"\x00\x01 not text")  # wrong suffix: skipped
    (d / ".hidden").mkdir()
    (d / ".hidden" / "x.txt").write_text("hidden, skipped")
    lines = [json.dumps({"text": doc}) for doc in corpus_docs[40:]]
    (tmp_path / "more.jsonl").write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")
    return [str(d), str(tmp_path / "more.jsonl")]
