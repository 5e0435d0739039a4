"""Data pipeline: sources, BPE, the tokenised cache, and the resumable batch stream."""

import json
import os

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from openk3.train.data import (
    PreparedData,
    TokenStream,
    default_corpus_files,
    iter_documents,
    prepare_data,
    train_bpe_tokenizer,
    val_batches,
)

# Every document carries a unique marker, so a decoded split tells which documents it holds.
DOCS = [f"# document {i:03d}\ndef f_{i}(x):\n    return x * {i} + len('héllo wörld')\n" * 3
        for i in range(60)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def corpus(tmp_path):
    """A directory of .py/.txt/.md files and one JSONL; 60 documents in all."""
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    for i, doc in enumerate(DOCS[:40]):
        (d / ("sub" if i % 2 else "") / f"f{i:03d}{['.py', '.txt', '.md'][i % 3]}").write_text(doc)
    (d / "notes.bin").write_bytes(b"\x00\x01 not text")  # wrong suffix: skipped
    (d / ".hidden").mkdir()
    (d / ".hidden" / "x.txt").write_text("hidden, skipped")
    lines = [json.dumps({"text": doc}) for doc in DOCS[40:]]
    (tmp_path / "more.jsonl").write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")
    return [str(d), str(tmp_path / "more.jsonl")]


def split_documents(bin_path, dtype, tok, eos_id):
    ids = np.fromfile(bin_path, dtype=dtype)
    assert len(ids) == 0 or ids[-1] == eos_id
    cuts = np.flatnonzero(ids == eos_id)
    return [tok.decode(ids[a + 1:b].tolist()) for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


def test_default_corpus_is_stdlib_without_tests():
    files = default_corpus_files()
    assert len(files) > 300
    assert files == sorted(files)
    assert not any("/test/" in str(f) or "/tests/" in str(f) or "site-packages" in str(f) for f in files)
    assert any(f.name == "functools.py" for f in files)


def test_iter_documents_sources(corpus, tmp_path):
    docs = list(iter_documents(corpus))
    assert sorted(docs) == sorted(DOCS)
    assert docs == list(iter_documents(corpus))  # deterministic order
    (tmp_path / "one.txt").write_bytes(b"caf\xe9 latin-1 bytes")  # replaced, not an error
    assert list(iter_documents([str(tmp_path / "one.txt")])) == ["caf\ufffd latin-1 bytes"]


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
        list(iter_documents([str(f)]))


def test_source_errors(tmp_path):
    with pytest.raises(ValueError, match="nope.txt: no such file"):
        list(iter_documents([str(tmp_path / "nope.txt")]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: directory holds no text files"):
        list(iter_documents([str(tmp_path / "empty")]))
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        list(iter_documents([str(tmp_path / "blank.txt")]))


def test_bpe_roundtrip_and_special_ids(tmp_path):
    tok = train_bpe_tokenizer(DOCS, 320, tmp_path / "tok" / "tokenizer.json")
    assert [tok.token_to_id(t) for t in ("<|pad|>", "<|bos|>", "<|eos|>")] == [0, 1, 2]
    assert tok.get_vocab_size() <= 320
    text = "def g(y):\n\treturn y ** 2  # naïve 中文 🙂\n"
    assert tok.decode(tok.encode(text).ids) == text
    reloaded = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert reloaded.encode(text).ids == tok.encode(text).ids
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe_tokenizer(DOCS, 100, tmp_path / "t.json")


def test_prepare_splits_by_document_and_is_deterministic(corpus, cache, tmp_path):
    data = prepare_data(corpus, None, 320, val_fraction=0.1, log=lambda s: None)
    assert data.data_dir.parent.parent == cache  # $OPENK3_CACHE is the default root
    assert data.dtype == "uint16" and data.eos_id == 2
    tok = Tokenizer.from_file(str(data.tokenizer_path))
    train = split_documents(data.train_path, data.dtype, tok, data.eos_id)
    val = split_documents(data.val_path, data.dtype, tok, data.eos_id)
    assert (len(train), len(val)) == (data.train_documents, data.val_documents)
    assert 1 <= len(val) <= 12
    assert sorted(train + val) == sorted(DOCS)  # every document whole, in exactly one split
    assert data.train_tokens == len(np.fromfile(data.train_path, dtype=data.dtype))

    again = prepare_data(corpus, tmp_path / "other", 320, val_fraction=0.1, log=lambda s: None)
    for name in ("tokenizer.json", "train.bin", "val.bin"):
        assert (again.data_dir / name).read_bytes() == (data.data_dir / name).read_bytes()


def test_prepare_reuses_cache_and_notices_changes(corpus, cache, tmp_path, monkeypatch):
    first = prepare_data(corpus, None, 320, log=lambda s: None)
    monkeypatch.setattr("openk3.train.data.train_bpe_tokenizer",
                        lambda *a: pytest.fail("cache not reused"))
    logs = []
    second = prepare_data(corpus, None, 320, log=logs.append)
    assert second == first and "reusing" in logs[0]
    assert not [p for p in first.data_dir.parent.iterdir() if p.name.startswith(".")]  # no temp left

    monkeypatch.undo()
    monkeypatch.setenv("OPENK3_CACHE", str(cache))
    f = tmp_path / "corpus" / "f000.py"
    f.write_text(f.read_text() + "x = 1\n")
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    third = prepare_data(corpus, None, 320, log=lambda s: None)
    assert third.data_dir != first.data_dir
    assert PreparedData.from_dir(third.data_dir) == third


def test_prepare_with_user_tokenizer(corpus, cache, tmp_path):
    path = tmp_path / "mine" / "tokenizer.json"
    train_bpe_tokenizer(DOCS, 300, path)
    data = prepare_data(corpus[:1], tokenizer_path=path, log=lambda s: None)
    assert data.vocab_size == Tokenizer.from_file(str(path)).get_vocab_size()
    assert data.tokenizer_path.read_bytes() == path.read_bytes()
    with pytest.raises(ValueError, match="tokenizer file not found"):
        prepare_data(corpus, None, 320, tokenizer_path=tmp_path / "none.json", log=lambda s: None)
    with pytest.raises(ValueError, match="vocab_size is needed"):
        prepare_data(corpus, log=lambda s: None)


def test_single_document_cannot_be_split(tmp_path, cache):
    (tmp_path / "one.txt").write_text(DOCS[0])
    with pytest.raises(ValueError, match="val_fraction=0"):
        prepare_data([str(tmp_path / "one.txt")], None, 300, log=lambda s: None)
    data = prepare_data([str(tmp_path / "one.txt")], None, 300, val_fraction=0.0, log=lambda s: None)
    assert data.val_tokens == 0 and data.train_documents == 1


@pytest.fixture
def bin_file(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    return path


def test_stream_batches_are_windows(bin_file):
    inputs, targets = next(TokenStream(bin_file, "uint16", seq_len=16, batch_size=4))
    assert inputs.shape == targets.shape == (4, 16) and inputs.dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(inputs - inputs[:, :1], torch.arange(16).expand(4, 16))  # contiguous windows
    assert int(targets.max()) <= 999


def test_stream_exact_resume(bin_file):
    stream = TokenStream(bin_file, "uint16", seq_len=16, batch_size=4, seed=7)
    for _ in range(5):
        next(stream)
    state = json.loads(json.dumps(stream.state_dict()))  # checkpoints store it as JSON
    expected = [next(stream) for _ in range(5)]
    resumed = TokenStream(bin_file, "uint16", seq_len=16, batch_size=4, seed=123)
    resumed.load_state_dict(state)
    for (x, y), (x2, y2) in zip(expected, (next(resumed) for _ in range(5))):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert resumed.batches_drawn == 10
    assert not torch.equal(expected[0][0], expected[1][0])
    other_seed = TokenStream(bin_file, "uint16", seq_len=16, batch_size=4, seed=8)
    assert not torch.equal(next(other_seed)[0], next(TokenStream(bin_file, "uint16", 16, 4, seed=7))[0])
    with pytest.raises(ValueError, match="global_batch_size"):
        TokenStream(bin_file, "uint16", seq_len=16, batch_size=2).load_state_dict(state)


def test_stream_ranks_slice_the_global_batch(bin_file):
    whole = TokenStream(bin_file, "uint16", seq_len=8, batch_size=6, seed=3)
    ranks = [TokenStream(bin_file, "uint16", seq_len=8, batch_size=2, seed=3, rank=r, world_size=3)
             for r in range(3)]
    for _ in range(4):
        x, y = next(whole)
        parts = [next(r) for r in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))


def test_too_short_corpus(tmp_path):
    path = tmp_path / "short.bin"
    np.arange(16, dtype=np.uint32).tofile(path)
    with pytest.raises(ValueError, match=r"short\.bin: 16 tokens, .*seq_len=16 needs 17"):
        TokenStream(path, "uint32", seq_len=16, batch_size=1)
    with pytest.raises(ValueError, match="short.bin: 16 tokens"):
        next(val_batches(path, np.uint32, seq_len=16, batch_size=1))
    TokenStream(path, "uint32", seq_len=15, batch_size=1)


def test_val_batches_are_sequential(bin_file):
    batches = list(val_batches(bin_file, "uint16", seq_len=100, batch_size=4))
    assert [b[0].shape[0] for b in batches] == [4, 4, 1]  # (1000 - 1) // 100 = 9 windows
    inputs = torch.cat([b[0] for b in batches])
    assert torch.equal(inputs.flatten(), torch.arange(900))
    assert torch.equal(torch.cat([b[1] for b in batches]).flatten(), torch.arange(1, 901))
    assert len(list(val_batches(bin_file, "uint16", seq_len=100, batch_size=4, max_batches=2))) == 2
