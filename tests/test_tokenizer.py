"""Checkpoint tokenizers: Kimi's tiktoken.model + tokenizer_config.json, tokenizer.json, bytes."""

import base64
import json

import pytest

from openk3.tokenizer import NUM_RESERVED_SPECIAL, ByteTokenizer, VisibleTokenizer, load_tokenizer


def _write_tiktoken_checkpoint(path):
    # a tiny BPE: the 256 bytes, then a few merges; Kimi's files are this format at 163840 ranks
    ranks = [bytes([b]) for b in range(256)] + [b"de", b"def", b" f", "中文".encode()]
    (path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(tok).decode()} {i}\n" for i, tok in enumerate(ranks)))
    n = len(ranks)
    (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        str(n): {"content": "[BOS]"}, str(n + 1): {"content": "[EOS]"},
        str(n + 5): {"content": "<|im_end|>"}}}))
    return n


def test_kimi_tiktoken_checkpoint(tmp_path):
    pytest.importorskip("tiktoken")
    n = _write_tiktoken_checkpoint(tmp_path)
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("def f")
    assert ids == [n - 3, n - 2]  # "def", " f": the merges apply after Kimi's pre-tokenisation
    assert tok.decode(ids) == "def f"
    # special tokens named in tokenizer_config.json and the reserved ones after the ranks
    assert tok.encode("[EOS]") == [n + 1] and tok.encode("<|im_end|>") == [n + 5]
    assert tok.decode([n + 2]) == "<|reserved_token_2|>"
    assert tok.decode([n + NUM_RESERVED_SPECIAL - 1]) == f"<|reserved_token_{NUM_RESERVED_SPECIAL - 1}|>"
    # Han characters form their own pre-token (so "中文" is one merge, not split with "x")
    assert tok.encode("x中文") == [ord("x"), n - 1]
    # an id past the vocabulary (a wider model's) decodes to nothing, as tokenizer.json's do
    # (tiktoken raised, and the engine then failed every request in flight)
    assert tok.decode([ord("a"), n + NUM_RESERVED_SPECIAL, 10**6, ord("b")]) == "ab"


def test_hf_tokenizer_json(tmp_path):
    from openk3.train.data import train_bpe_tokenizer

    train_bpe_tokenizer(["def f(x):\n    return x\n"] * 50, 300, tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path)
    assert tok.decode(tok.encode("def f(x):")) == "def f(x):"


def test_bytes_only_when_asked_for(tmp_path):
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer)
    assert tok.encode("é") == [0xC3, 0xA9] and tok.decode([0xC3, 0xA9]) == "é"
    with pytest.raises(ValueError, match=r"no tokenizer \(tokenizer.json or tiktoken.model\).*--tokenizer bytes"):
        load_tokenizer(tmp_path)


def test_visible_tokenizer_decodes_every_id_to_visible_text():
    tok = VisibleTokenizer()
    assert tok.decode(tok.encode("def f(x):\n\treturn 1")) == "def f(x):\n\treturn 1"
    text = tok.decode(list(range(4096)))
    assert "\ufffd" not in text and all(c.isprintable() or c in "\n\t" for c in text)
    assert tok.decode([3000, 65, 0]) == "<3000>A<0>"
