"""The resumable training stream and the sequential validation batches."""

import json

import numpy as np
import pytest
import torch

from openk3.train.stream import TokenStream, val_batches


@pytest.fixture
def bin_file(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    return path


def test_stream_batches_are_windows(bin_file):
    inputs, targets = TokenStream(bin_file, "uint16", seq_len=16, batch_size=4).next_batch()
    assert inputs.shape == targets.shape == (4, 16) and inputs.dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(inputs - inputs[:, :1], torch.arange(16).expand(4, 16))  # contiguous windows
    assert int(targets.max()) <= 999


def test_stream_exact_resume(bin_file):
    stream = TokenStream(bin_file, "uint16", seq_len=16, batch_size=4, seed=7)
    for _ in range(5):
        stream.next_batch()
    state = json.loads(json.dumps(stream.state_dict()))  # checkpoints store it as JSON
    expected = [stream.next_batch() for _ in range(5)]
    resumed = TokenStream(bin_file, "uint16", seq_len=16, batch_size=4, seed=123)
    resumed.load_state_dict(state)
    for (x, y), (x2, y2) in zip(expected, (resumed.next_batch() for _ in range(5))):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert resumed.batches_drawn == 10
    assert not torch.equal(expected[0][0], expected[1][0])
    other_seed = TokenStream(bin_file, "uint16", seq_len=16, batch_size=4, seed=8)
    assert not torch.equal(other_seed.next_batch()[0],
                           TokenStream(bin_file, "uint16", 16, 4, seed=7).next_batch()[0])
    with pytest.raises(ValueError, match="global_batch_size"):
        TokenStream(bin_file, "uint16", seq_len=16, batch_size=2).load_state_dict(state)


def test_stream_ranks_slice_the_global_batch(bin_file):
    whole = TokenStream(bin_file, "uint16", seq_len=8, batch_size=6, seed=3)
    ranks = [TokenStream(bin_file, "uint16", seq_len=8, batch_size=2, seed=3, rank=r, world_size=3)
             for r in range(3)]
    for _ in range(4):
        x, y = whole.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))


def test_stream_argument_errors(bin_file):
    with pytest.raises(ValueError, match="both must be >= 1"):
        TokenStream(bin_file, "uint16", seq_len=0, batch_size=1)
    with pytest.raises(ValueError, match="seed=-1"):
        TokenStream(bin_file, "uint16", seq_len=8, batch_size=1, seed=-1)
    with pytest.raises(ValueError, match="rank=2"):
        TokenStream(bin_file, "uint16", seq_len=8, batch_size=1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="missing.bin: token file not found"):
        TokenStream(bin_file.parent / "missing.bin", "uint16", seq_len=8, batch_size=1)


def test_too_short_corpus(tmp_path):
    path = tmp_path / "short.bin"
    np.arange(16, dtype=np.uint32).tofile(path)
    with pytest.raises(ValueError, match=r"short\.bin: 16 tokens, .*seq_len=16 needs 17"):
        TokenStream(path, "uint32", seq_len=16, batch_size=1)
    with pytest.raises(ValueError, match="short.bin: 16 tokens"):
        next(val_batches(path, np.uint32, seq_len=16, batch_size=1, max_batches=1))
    TokenStream(path, "uint32", seq_len=15, batch_size=1)


def test_val_batches_are_sequential(bin_file):
    batches = list(val_batches(bin_file, "uint16", seq_len=100, batch_size=4, max_batches=10))
    assert [b[0].shape[0] for b in batches] == [4, 4, 1]  # (1000 - 1) // 100 = 9 windows
    inputs = torch.cat([b[0] for b in batches])
    assert torch.equal(inputs.flatten(), torch.arange(900))
    assert torch.equal(torch.cat([b[1] for b in batches]).flatten(), torch.arange(1, 901))
    assert len(list(val_batches(bin_file, "uint16", seq_len=100, batch_size=4, max_batches=2))) == 2
