"""Tokenised training data on disk: corpus -> byte-level BPE -> flat token arrays, cached.

Why this shape:

* **Tokenise once, stream many times.** ``prepare_data`` trains (or loads) the tokenizer,
  tokenises every document of the corpus (``openk3.train.corpus``) once with an ``<|eos|>``
  after each, and writes two flat arrays, ``train.bin`` and ``val.bin`` (uint16 when every
  id fits, else uint32), that ``openk3.train.stream`` reads through ``np.memmap``.
* **A cache keyed by what went in.** The output directory is named by a hash of the resolved
  file list (paths, sizes, mtimes), the vocabulary size, the user tokenizer's content hash, the
  validation fraction and ``FORMAT_VERSION``; a second call with the same inputs returns at
  once, a changed file gives a new directory. The cache root is ``$OPENK3_CACHE`` or
  ``~/.cache/openk3``, for the default corpus *and* for user data: we never write beside user
  files (they may be read-only or shared) nor into the interpreter's stdlib. The directory is
  built under a temporary name and renamed into place, so a crash or a concurrent rank never
  leaves a half-written cache that looks complete.
* **Held-out split by document**, so no document straddles train and val and the validation
  loss measures text the model never saw. Document ``i`` is held out when the golden-ratio
  sequence ``frac(i * phi)`` falls below ``val_fraction``: deterministic, spread evenly over
  the corpus, and document 0 is always held out, so the split is never empty.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from openk3.train.corpus import read_documents, resolve_sources

# Bump when the on-disk layout or the tokenisation recipe changes: old caches are then ignored.
FORMAT_VERSION = 1

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2, as in the `debug` preset

# BPE training sees at most this much text (every k-th train document beyond it): the merges
# a byte-level BPE learns settle long before gigabytes, and training stays in seconds.
MAX_TOKENIZER_TRAIN_BYTES = 32_000_000

_ENCODE_CHUNK_DOCS = 256  # documents per `encode_batch_fast` call: enough for the thread pool
_LOG_EVERY_S = 10.0
_PHI_FRAC = (math.sqrt(5) - 1) / 2  # golden-ratio fraction, for the held-out split


def default_cache_root() -> Path:
    """``$OPENK3_CACHE`` if set, else ``~/.cache/openk3``."""
    return Path(os.environ.get("OPENK3_CACHE") or Path.home() / ".cache" / "openk3")


def train_bpe_tokenizer(documents: Iterable[str], vocab_size: int, path: str | Path) -> Tokenizer:
    """Train a byte-level BPE on ``documents`` and save it as a ``tokenizer.json`` at ``path``.

    Special tokens ``<|pad|>``=0, ``<|bos|>``=1, ``<|eos|>``=2 (the ``debug`` preset's ids),
    then the 256 byte symbols, then merges up to ``vocab_size`` (fewer if the text runs out
    of pairs seen at least twice). Byte-level means every string encodes, and
    ``decode(encode(s)) == s``.

    Example::

        tok = train_bpe_tokenizer(["def f(x):\\n    return x\\n"] * 100, 300, "tokenizer.json")
        assert tok.decode(tok.encode("def g(): pass").ids) == "def g(): pass"
    """
    min_vocab = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least {min_vocab} "
                         f"(3 special tokens + 256 bytes)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def _eos_id(tok: Tokenizer, tokenizer_path: Path) -> int:
    """The end-of-document id: the one ``tokenizer_config.json`` names, else a common spelling."""
    candidates = [EOS_TOKEN, "</s>", "<|endoftext|>", "<|im_end|>", "[EOS]", "<eos>"]
    cfg_file = tokenizer_path.parent / "tokenizer_config.json"
    if cfg_file.exists():
        eos = json.loads(cfg_file.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            candidates.insert(0, eos)
    for name in candidates:
        tid = tok.token_to_id(name)
        if tid is not None:
            return tid
    raise ValueError(f"{tokenizer_path}: no end-of-document token found (looked for {candidates})")


def _is_val(index: int, val_fraction: float) -> bool:
    """Document ``index`` goes to the held-out split (document 0 always, if val_fraction > 0)."""
    return (index * _PHI_FRAC) % 1.0 < val_fraction


@dataclass
class PreparedData:
    """A tokenised corpus on disk, as written by ``prepare_data``.

    The cache directory also holds ``meta.json``: these fields, plus the token and document
    counts of each split, the sources and the build time, for a person looking at the cache.

    Fields:
        tokenizer_path: its ``tokenizer.json`` (trained, or a copy of the user's).
        train_path, val_path: flat token arrays (``np.memmap(path, dtype)``), an eos after each
            document.
        dtype: ``"uint16"`` or ``"uint32"``.
        eos_id: the id appended after each document.
        vocab_size: the tokenizer's vocabulary (with special tokens); the model's
            ``vocab_size`` must be at least this.
    """

    tokenizer_path: Path
    train_path: Path
    val_path: Path
    dtype: str
    eos_id: int
    vocab_size: int

    @classmethod
    def from_dir(cls, data_dir: str | Path) -> PreparedData:
        """Reopen a prepared cache directory from its ``meta.json``."""
        data_dir = Path(data_dir)
        meta = json.loads((data_dir / "meta.json").read_text())
        return cls(tokenizer_path=data_dir / "tokenizer.json", train_path=data_dir / "train.bin",
                   val_path=data_dir / "val.bin",
                   **{k: meta[k] for k in ("dtype", "eos_id", "vocab_size")})


def _cache_key(files: list[Path], sources: list[str] | None, vocab_size: int | None,
               tokenizer_path: Path | None, val_fraction: float) -> str:
    h = hashlib.sha256()
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    tok_hash = None
    if tokenizer_path:  # tokenizer_config.json beside it picks the end-of-document id (_eos_id)
        tok_hash = hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()
        config = tokenizer_path.parent / "tokenizer_config.json"
        if config.exists():
            tok_hash += hashlib.sha256(config.read_bytes()).hexdigest()
    h.update(json.dumps({"format": FORMAT_VERSION, "files": stats, "vocab_size": vocab_size,
                         "tokenizer": tok_hash, "val_fraction": val_fraction}).encode())
    name = "stdlib" if sources is None else Path(sources[0]).stem or "data"
    return f"{name}-{f'v{vocab_size}' if vocab_size else 'tok'}-{h.hexdigest()[:16]}"


def _fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def prepare_data(sources: list[str] | None, vocab_size: int | None = None,
                 tokenizer_path: str | Path | None = None, val_fraction: float = 0.005,
                 log: Callable[[str], None] = print) -> PreparedData:
    """Tokenise a corpus once into ``train.bin`` / ``val.bin`` memmaps, or reuse the cached ones.

    Args:
        sources: files / directories / JSONL as in ``corpus.resolve_sources``; None = the
            stdlib corpus. The data goes into a subdirectory of ``default_cache_root()``
            named by a hash of the inputs.
        vocab_size: size of the BPE to train; required unless ``tokenizer_path`` is given
            (and then ignored).
        tokenizer_path: a user ``tokenizer.json`` to use instead of training one (its
            end-of-document token is the one its ``tokenizer_config.json`` names, else
            ``<|eos|>``, ``</s>``, ``<|endoftext|>``, ...).
        val_fraction: share of documents held out for validation, in [0, 0.5]; with > 0 at
            least one document is held out.
        log: progress messages go here.

    Returns a ``PreparedData``. Raises ValueError for bad sources (see ``openk3.train.corpus``),
    an unusable tokenizer, or a corpus too small to split.
    """
    if not 0.0 <= val_fraction <= 0.5:
        raise ValueError(f"val_fraction={val_fraction}: must be in [0, 0.5]")
    tokenizer_path = Path(tokenizer_path).expanduser() if tokenizer_path is not None else None
    if tokenizer_path is not None and not tokenizer_path.is_file():
        raise ValueError(f"{tokenizer_path}: tokenizer file not found")
    if tokenizer_path is None and vocab_size is None:
        raise ValueError("vocab_size is needed to train a tokenizer (or give tokenizer_path)")
    if tokenizer_path is not None:
        vocab_size = None  # unused, so kept out of the cache key
    files = resolve_sources(sources)
    sources = None if sources is None else [str(s) for s in sources]
    key = _cache_key(files, sources, vocab_size, tokenizer_path, val_fraction)
    final_dir = default_cache_root() / "data" / key
    if (final_dir / "meta.json").exists():
        log(f"data: reusing {final_dir}")
        return PreparedData.from_dir(final_dir)

    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", dir=final_dir.parent))
    try:
        _build(files, sources, tokenizer_path, vocab_size, val_fraction, tmp_dir, log)
        try:
            os.replace(tmp_dir, final_dir)
        except OSError:
            # Another process (e.g. another rank) finished the same key first: use theirs.
            if not (final_dir / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    log(f"data: wrote {final_dir}")
    return PreparedData.from_dir(final_dir)


def _build(files: list[Path], sources: list[str] | None, tokenizer_path: Path | None,
           vocab_size: int | None, val_fraction: float, out: Path, log: Callable[[str], None]) -> None:
    """Write tokenizer.json, train.bin, val.bin and meta.json (last) into ``out``."""
    t0 = time.perf_counter()
    if tokenizer_path is None:
        total_bytes = sum(p.stat().st_size for p in files)
        stride = max(1, math.ceil(total_bytes / MAX_TOKENIZER_TRAIN_BYTES))
        log(f"data: training a byte-level BPE (vocab {vocab_size}) on "
            f"{total_bytes / 1e6:.1f} MB{f' (1 in {stride} documents)' if stride > 1 else ''}")
        sample = (doc for i, doc in enumerate(read_documents(files))
                  if not _is_val(i, val_fraction) and i % stride == 0)
        tok = train_bpe_tokenizer(sample, vocab_size, out / "tokenizer.json")
        log(f"data: trained tokenizer ({tok.get_vocab_size()} tokens) in {time.perf_counter() - t0:.1f} s")
    else:
        shutil.copyfile(tokenizer_path, out / "tokenizer.json")
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_id = _eos_id(tok, tokenizer_path or out / "tokenizer.json")
    dtype = np.uint16 if n_vocab <= 2**16 else np.uint32

    t1 = time.perf_counter()
    counts = {"train": [0, 0], "val": [0, 0]}  # split -> [documents, tokens]
    last_log = t1
    with open(out / "train.bin", "wb") as f_train, open(out / "val.bin", "wb") as f_val:
        docs = read_documents(files)
        while chunk := [d for _, d in zip(range(_ENCODE_CHUNK_DOCS), docs)]:
            first = sum(c[0] for c in counts.values())
            ids = {"train": [], "val": []}
            for j, enc in enumerate(tok.encode_batch_fast(chunk, add_special_tokens=False)):
                split = "val" if _is_val(first + j, val_fraction) else "train"
                ids[split] += enc.ids
                ids[split].append(eos_id)
                counts[split][0] += 1
            for split, f in (("train", f_train), ("val", f_val)):
                np.asarray(ids[split], dtype=dtype).tofile(f)
                counts[split][1] += len(ids[split])
            if time.perf_counter() - last_log > _LOG_EVERY_S:
                last_log = time.perf_counter()
                log(f"data: tokenised {first + len(chunk)} documents ...")
    n_docs = counts["train"][0] + counts["val"][0]
    if n_docs == 0:
        raise ValueError(f"corpus {sources or 'stdlib'} holds no non-empty documents")
    if counts["train"][0] == 0:
        raise ValueError(f"corpus {sources or 'stdlib'} has {n_docs} document(s), all held out for "
                         f"validation: add documents or pass val_fraction=0")
    n_tokens = counts["train"][1] + counts["val"][1]
    log(f"data: tokenised {len(files)} files, {n_docs} documents, {_fmt_count(n_tokens)} tokens "
        f"(train {_fmt_count(counts['train'][1])}, val {_fmt_count(counts['val'][1])}) "
        f"in {time.perf_counter() - t1:.1f} s")
    meta = {"format_version": FORMAT_VERSION, "sources": sources, "dtype": np.dtype(dtype).name,
            "train_tokens": counts["train"][1], "val_tokens": counts["val"][1],
            "train_documents": counts["train"][0], "val_documents": counts["val"][0],
            "eos_id": eos_id, "vocab_size": n_vocab, "val_fraction": val_fraction,
            "seconds": round(time.perf_counter() - t0, 2)}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
