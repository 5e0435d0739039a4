"""Tokenizers: a checkpoint's ``tokenizer.json`` (``tokenizers``), Kimi's ``tiktoken.model``
(``tiktoken``, offline from the local file), raw UTF-8 bytes (only when asked for), and the
visible-ids tokenizer that random-init models get."""

from __future__ import annotations

import json
from pathlib import Path

# Kimi's pre-tokenisation regex (tokenization_kimi.py): Han runs are split off on their own.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL = 256


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 (needs vocab_size >= 256); ids above 255 decode to nothing."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_id(self, name: str) -> int | None:
        """The id of special token ``name``, or None: bytes have no special tokens."""
        return None


class VisibleTokenizer(ByteTokenizer):
    """For random-init models: text in as UTF-8 bytes (so ASCII round-trips), and every id out
    as visible text of its own: printable ASCII, tab and newline as themselves, any other id as
    ``<id>``. A random model's output then streams, and stop strings match, as real text does."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) if 32 <= i < 127 or i in (9, 10) else f"<{i}>" for i in ids)


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(f"{path}: cannot read the tokenizer ({e})") from e

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def token_id(self, name: str) -> int | None:
        """The id of the (special) token ``name``, or None when the vocabulary lacks it."""
        return self.tok.token_to_id(name)


class TiktokenTokenizer:
    """Kimi's BPE file + 256 reserved special ids after the ranks; names from tokenizer_config."""

    def __init__(self, model_file: Path):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:
            raise ValueError(f"{model_file}: reading a tiktoken.model needs `pip install tiktoken`") from e
        ranks = load_tiktoken_bpe(str(model_file))
        n = len(ranks)
        names = {n + i: f"<|reserved_token_{i}|>" for i in range(NUM_RESERVED_SPECIAL)}
        cfg_file = model_file.parent / "tokenizer_config.json"
        if cfg_file.exists():
            for tid, entry in json.loads(cfg_file.read_text()).get("added_tokens_decoder", {}).items():
                names[int(tid)] = entry["content"]
        self.enc = tiktoken.Encoding(name=model_file.parent.name, pat_str=KIMI_PAT_STR,
                                     mergeable_ranks=ranks,
                                     special_tokens={v: k for k, v in names.items()})

    def encode(self, text: str) -> list[int]:
        # special-token strings in the text (chat templates) become their ids, as Kimi's own does
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        # an id past the vocabulary (a model's vocabulary can be wider) decodes to nothing, as
        # ``tokenizers`` does: tiktoken raised, and the engine then failed every request in flight
        known = self.enc.n_vocab
        return self.enc.decode([i for i in ids if 0 <= i < known])

    def token_id(self, name: str) -> int | None:
        """The id of special token ``name``, or None when there is none of that name."""
        return self.enc.encode_single_token(name) if name in self.enc.special_tokens_set else None


TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")


def load_tokenizer(path: str | Path):
    """The tokenizer stored in checkpoint directory ``path`` (``tokenizer.json`` read with
    ``tokenizers``, else Kimi's ``tiktoken.model``), or, for ``path="bytes"``, raw UTF-8 bytes.
    A directory with neither file is an error naming them: silently falling back to bytes would
    print garbage for any real model."""
    if str(path) == "bytes":
        return ByteTokenizer()
    path = Path(path)
    if path.is_file() and path.name in TOKENIZER_FILES:
        path = path.parent
    if (path / "tokenizer.json").exists():
        return HFTokenizer(path / "tokenizer.json")
    if (path / "tiktoken.model").exists():
        return TiktokenTokenizer(path / "tiktoken.model")
    raise ValueError(f"{path}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); copy the model's "
                     "tokenizer there, give another with --tokenizer DIR, or --tokenizer bytes for "
                     "raw UTF-8 bytes")
