"""Tokenizers: a checkpoint's ``tokenizer.json`` (``tokenizers``), Kimi's ``tiktoken.model``
(``tiktoken``, offline from the local file), or a byte-level fallback for random-init models."""

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
    """UTF-8 bytes as ids 0..255 (for models without a tokenizer; needs vocab_size >= 256)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


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
        return self.enc.decode(ids)


def load_tokenizer(path: str | Path | None):
    """The tokenizer stored in a checkpoint directory, or ``ByteTokenizer`` when there is none."""
    if path is not None:
        path = Path(path)
        if (path / "tokenizer.json").exists():
            return HFTokenizer(path / "tokenizer.json")
        if (path / "tiktoken.model").exists():
            return TiktokenTokenizer(path / "tiktoken.model")
    return ByteTokenizer()
