"""Corpus sources: the default stdlib corpus, directories, text files and JSONL."""

import pytest

from openk3.train.corpus import default_corpus_files, read_documents, resolve_sources


def test_default_corpus_is_stdlib_without_tests():
    files = default_corpus_files()
    assert len(files) > 300
    assert files == sorted(files)
    assert not any("/test/" in str(f) or "/tests/" in str(f) or "site-packages" in str(f) for f in files)
    assert any(f.name == "functools.py" for f in files)
    assert resolve_sources(None) == files


def test_read_documents_of_sources(mixed_corpus, corpus_docs, tmp_path):
    read = list(read_documents(resolve_sources(mixed_corpus)))
    assert sorted(read) == sorted(corpus_docs)
    assert read == list(read_documents(resolve_sources(mixed_corpus)))  # deterministic order
    (tmp_path / "one.txt").write_bytes(b"caf\xe9 latin-1 bytes")  # replaced, not an error
    (tmp_path / "blank.txt").write_text("  \n")  # no document
    assert list(read_documents([tmp_path / "blank.txt", tmp_path / "one.txt"])) == ["caf\ufffd latin-1 bytes"]


@pytest.mark.parametrize("line, why", [
    ("{not json", "not a JSON object"),
    ('{"txt": "x"}', "string 'text' field"),
    ('{"text": 3}', "string 'text' field"),
    ('["text"]', "string 'text' field"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, line, why):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{why}"):
        list(read_documents([f]))


def test_source_errors(tmp_path):
    with pytest.raises(ValueError, match="no data sources given"):
        resolve_sources([])
    with pytest.raises(ValueError, match="nope.txt: no such file"):
        resolve_sources([str(tmp_path / "nope.txt")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: directory holds no text files"):
        resolve_sources([str(tmp_path / "empty")])
