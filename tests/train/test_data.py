"""Tokenised data on disk: the BPE, the document split, and the cache and its key."""

import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

from openk3.train.data import PreparedData, prepare_data, train_bpe_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def quiet(message):
    pass


def meta(data):
    """The human-facing record beside the arrays: counts per split, sources, build time."""
    return json.loads((data.train_path.parent / "meta.json").read_text())


def split_documents(bin_path, dtype, tok, eos_id):
    ids = np.fromfile(bin_path, dtype=dtype)
    assert len(ids) == 0 or ids[-1] == eos_id
    cuts = np.flatnonzero(ids == eos_id)
    return [tok.decode(ids[a + 1:b].tolist()) for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


def test_bpe_roundtrip_and_special_ids(tmp_path, corpus_docs):
    tok = train_bpe_tokenizer(corpus_docs, 320, tmp_path / "tok" / "tokenizer.json")
    assert [tok.token_to_id(t) for t in ("<|pad|>", "<|bos|>", "<|eos|>")] == [0, 1, 2]
    assert tok.get_vocab_size() <= 320
    text = "def g(y):\n\treturn y ** 2  # naïve 中文 🙂\n"
    assert tok.decode(tok.encode(text).ids) == text
    reloaded = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert reloaded.encode(text).ids == tok.encode(text).ids
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe_tokenizer(corpus_docs, 100, tmp_path / "t.json")


def test_prepare_splits_by_document_and_is_deterministic(mixed_corpus, corpus_docs, cache, tmp_path,
                                                         monkeypatch):
    data = prepare_data(mixed_corpus, 320, val_fraction=0.1, log=quiet)
    assert data.train_path.parent.parent.parent == cache  # $OPENK3_CACHE is the root
    assert data.dtype == "uint16" and data.eos_id == 2
    tok = Tokenizer.from_file(str(data.tokenizer_path))
    train = split_documents(data.train_path, data.dtype, tok, data.eos_id)
    val = split_documents(data.val_path, data.dtype, tok, data.eos_id)
    assert (len(train), len(val)) == (meta(data)["train_documents"], meta(data)["val_documents"])
    assert 1 <= len(val) <= 12
    assert sorted(train + val) == sorted(corpus_docs)  # every document whole, in exactly one split
    assert meta(data)["train_tokens"] == len(np.fromfile(data.train_path, dtype=data.dtype))

    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "other"))
    again = prepare_data(mixed_corpus, 320, val_fraction=0.1, log=quiet)
    for a, b in ((again.tokenizer_path, data.tokenizer_path), (again.train_path, data.train_path),
                 (again.val_path, data.val_path)):
        assert a != b and a.read_bytes() == b.read_bytes()


def test_prepare_reuses_cache_and_notices_changes(mixed_corpus, cache, tmp_path, monkeypatch):
    first = prepare_data(mixed_corpus, 320, log=quiet)
    monkeypatch.setattr("openk3.train.data.train_bpe_tokenizer",
                        lambda *a: pytest.fail("cache not reused"))
    logs = []
    second = prepare_data(mixed_corpus, 320, log=logs.append)
    assert second == first and "reusing" in logs[0]
    data_root = first.train_path.parent.parent
    assert not [p for p in data_root.iterdir() if p.name.startswith(".")]  # no temp left

    monkeypatch.undo()
    monkeypatch.setenv("OPENK3_CACHE", str(cache))
    f = tmp_path / "corpus" / "f000.py"
    f.write_text(f.read_text() + "x = 1\n")
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    third = prepare_data(mixed_corpus, 320, log=quiet)
    assert third.train_path.parent != first.train_path.parent
    assert PreparedData.from_dir(third.train_path.parent) == third
    # the vocabulary and the split are in the key too
    assert prepare_data(mixed_corpus, 300, log=quiet).train_path != third.train_path
    assert prepare_data(mixed_corpus, 320, val_fraction=0.0, log=quiet).train_path != third.train_path


def test_prepare_with_user_tokenizer(mixed_corpus, corpus_docs, cache, tmp_path):
    path = tmp_path / "mine" / "tokenizer.json"
    train_bpe_tokenizer(corpus_docs, 300, path)
    data = prepare_data(mixed_corpus[:1], tokenizer_path=path, log=quiet)
    assert data.vocab_size == Tokenizer.from_file(str(path)).get_vocab_size()
    assert data.tokenizer_path.read_bytes() == path.read_bytes()
    # a tokenizer_config.json naming another end-of-document token makes another cache (the
    # old one, with the old id after every document, was reused)
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|pad|>"}))
    other = prepare_data(mixed_corpus[:1], tokenizer_path=path, log=quiet)
    assert other.train_path != data.train_path and (data.eos_id, other.eos_id) == (2, 0)


def test_single_document_cannot_be_split(tmp_path, corpus_docs, cache):
    (tmp_path / "one.txt").write_text(corpus_docs[0])
    with pytest.raises(ValueError, match="val_fraction=0"):
        prepare_data([str(tmp_path / "one.txt")], 300, log=quiet)
    data = prepare_data([str(tmp_path / "one.txt")], 300, val_fraction=0.0, log=quiet)
    assert meta(data)["val_tokens"] == 0 and meta(data)["train_documents"] == 1


def test_prepare_errors(mixed_corpus, tmp_path, cache):
    with pytest.raises(ValueError, match="tokenizer file not found"):
        prepare_data(mixed_corpus, 320, tokenizer_path=tmp_path / "none.json", log=quiet)
    with pytest.raises(ValueError, match="vocab_size is needed"):
        prepare_data(mixed_corpus, log=quiet)
    with pytest.raises(ValueError, match=r"val_fraction=0.6: must be in \[0, 0.5\]"):
        prepare_data(mixed_corpus, 320, val_fraction=0.6, log=quiet)
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        prepare_data([str(tmp_path / "blank.txt")], 300, log=quiet)
