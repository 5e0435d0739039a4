"""Training data for ``openk3 train``: corpus -> byte-level BPE -> flat token memmaps -> batches.

Why this shape:

* **A corpus that is always there.** With no sources given we train on the Python standard
  library of the running interpreter (~730 files, ~12 MB without its tests, PSF licence), so
  ``openk3 train --preset debug`` works on a fresh laptop with no network, and the result is a
  small code model, fitting K3's coding focus. User data is text files, directories of text
  files, or JSONL with a ``text`` field.
* **Tokenise once, stream many times.** ``prepare_data`` trains (or loads) the tokenizer,
  tokenises every document once with an ``<|eos|>`` after each, and writes two flat arrays,
  ``train.bin`` and ``val.bin`` (uint16 when every id fits, else uint32), that training reads
  through ``np.memmap``: random windows cost a few page reads, never a re-tokenisation.
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
* **Exact resume.** ``TokenStream`` draws batch ``i``'s window offsets from a counter-based
  Philox generator keyed by ``(seed, i)``, so its position is two integers: its ``state_dict``
  is plain JSON for the checkpoint, and a resumed run sees exactly the batches it would have
  seen. (Not a ``torch.Generator``: re-seeding one per batch keeps only 32 bits of the seed,
  so batches would repeat, and its running state is 5 KB of bytes.) Every rank draws the
  same global batch of ``world_size * batch_size`` offsets and keeps its own slice, so N ranks
  of B see the same data as one process of N*B.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Bump when the on-disk layout or the tokenisation recipe changes: old caches are then ignored.
FORMAT_VERSION = 1

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2, as in the `debug` preset

# Files taken from a source directory. `.jsonl` files are read as JSONL (one document per
# line, its `text` field); the others are one document per file. `.json` is left out on
# purpose: a single JSON value has no agreed place for the text.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")

# Directories of the stdlib that are not part of the library itself.
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}

# BPE training sees at most this much text (every k-th train document beyond it): the merges
# a byte-level BPE learns settle long before gigabytes, and training stays in seconds.
MAX_TOKENIZER_TRAIN_BYTES = 32_000_000

_ENCODE_CHUNK_DOCS = 256  # documents per `encode_batch_fast` call: enough for the thread pool
_LOG_EVERY_S = 10.0
_PHI_FRAC = (math.sqrt(5) - 1) / 2  # golden-ratio fraction, for the held-out split


def default_cache_root() -> Path:
    """``$OPENK3_CACHE`` if set, else ``~/.cache/openk3``."""
    return Path(os.environ.get("OPENK3_CACHE") or Path.home() / ".cache" / "openk3")


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


def _resolve_sources(sources: list[str] | None) -> list[Path]:
    """The concrete files behind ``sources`` (directories expanded, sorted), checked to exist."""
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


def _read_documents(path: Path) -> Iterator[str]:
    """The non-empty documents of one file: the whole file, or one per JSONL line."""
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


def _documents_of(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield from _read_documents(path)


def iter_documents(sources: list[str] | None) -> Iterator[str]:
    """The documents of a corpus, in a deterministic order; empty documents are skipped.

    ``sources=None`` is the default corpus (``default_corpus_files``). Otherwise each source
    is a text file (one document, read as UTF-8 with undecodable bytes replaced), a ``.jsonl``
    file (one document per line, from its string ``text`` field), or a directory, searched
    recursively for ``TEXT_SUFFIXES`` (hidden files and directories skipped).

    Raises ValueError naming the file (and ``file:line`` for JSONL) for a missing source, a
    malformed JSONL line, or a corpus with no documents at all.
    """
    n = 0
    for doc in _documents_of(_resolve_sources(sources)):
        n += 1
        yield doc
    if n == 0:
        raise ValueError(f"corpus {sources or 'stdlib'} holds no non-empty documents")


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

    Fields:
        data_dir: the cache directory holding everything below.
        tokenizer_path: its ``tokenizer.json`` (trained, or a copy of the user's).
        train_path, val_path: flat token arrays (``np.memmap(path, dtype)``), an eos after each
            document.
        dtype: ``"uint16"`` or ``"uint32"``.
        train_tokens, val_tokens: lengths of the two arrays.
        train_documents, val_documents: documents in each split.
        eos_id: the id appended after each document.
        vocab_size: the tokenizer's vocabulary (with special tokens); the model's
            ``vocab_size`` must be at least this.
    """

    data_dir: Path
    tokenizer_path: Path
    train_path: Path
    val_path: Path
    dtype: str
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int
    eos_id: int
    vocab_size: int

    @classmethod
    def from_dir(cls, data_dir: str | Path) -> PreparedData:
        """Reopen a prepared cache directory from its ``meta.json``."""
        data_dir = Path(data_dir)
        meta = json.loads((data_dir / "meta.json").read_text())
        return cls(data_dir=data_dir, tokenizer_path=data_dir / "tokenizer.json",
                   train_path=data_dir / "train.bin", val_path=data_dir / "val.bin",
                   **{k: meta[k] for k in ("dtype", "train_tokens", "val_tokens", "train_documents",
                                           "val_documents", "eos_id", "vocab_size")})


def _cache_key(files: list[Path], sources: list[str] | None, vocab_size: int | None,
               tokenizer_path: Path | None, val_fraction: float) -> str:
    h = hashlib.sha256()
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    tok_hash = hashlib.sha256(tokenizer_path.read_bytes()).hexdigest() if tokenizer_path else None
    h.update(json.dumps({"format": FORMAT_VERSION, "files": stats, "vocab_size": vocab_size,
                         "tokenizer": tok_hash, "val_fraction": val_fraction}).encode())
    name = "stdlib" if sources is None else Path(sources[0]).stem or "data"
    return f"{name}-{f'v{vocab_size}' if vocab_size else 'tok'}-{h.hexdigest()[:16]}"


def _fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def prepare_data(sources: list[str] | None, cache_dir: str | Path | None = None,
                 vocab_size: int | None = None, tokenizer_path: str | Path | None = None,
                 val_fraction: float = 0.005, log: Callable[[str], None] = print) -> PreparedData:
    """Tokenise a corpus once into ``train.bin`` / ``val.bin`` memmaps, or reuse the cached ones.

    Args:
        sources: files / directories / JSONL as in ``iter_documents``; None = stdlib corpus.
        cache_dir: cache root (None = ``default_cache_root()``); the data goes into a
            subdirectory named by a hash of the inputs.
        vocab_size: size of the BPE to train; required unless ``tokenizer_path`` is given
            (and then ignored).
        tokenizer_path: a user ``tokenizer.json`` to use instead of training one (its
            end-of-document token is the one its ``tokenizer_config.json`` names, else
            ``<|eos|>``, ``</s>``, ``<|endoftext|>``, ...).
        val_fraction: share of documents held out for validation, in [0, 0.5]; with > 0 at
            least one document is held out.
        log: progress messages go here.

    Returns a ``PreparedData``. Raises ValueError for bad sources (see ``iter_documents``),
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
    files = _resolve_sources(sources)
    sources = None if sources is None else [str(s) for s in sources]
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final_dir = root / "data" / _cache_key(files, sources, vocab_size, tokenizer_path, val_fraction)
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
        sample = (doc for i, doc in enumerate(_documents_of(files))
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
        docs = _documents_of(files)
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


def _open_tokens(bin_path: str | Path, dtype, seq_len: int) -> np.ndarray:
    """The token array at ``bin_path``, checked to hold at least one window of seq_len + 1."""
    bin_path = Path(bin_path)
    dtype = np.dtype(dtype)
    if not bin_path.is_file():
        raise ValueError(f"{bin_path}: token file not found")
    n = bin_path.stat().st_size // dtype.itemsize
    if n < seq_len + 1:
        raise ValueError(f"{bin_path}: {n} tokens, but a window of seq_len={seq_len} needs "
                         f"{seq_len + 1}; use more data or a shorter seq_len")
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,))


class TokenStream:
    """Endless training batches of random windows over a token memmap, resumable exactly.

    Batch ``i`` draws ``world_size * batch_size`` window starts from a Philox generator keyed
    by ``(seed, i)`` (identical on every rank) and keeps slice ``rank``, so ranks see
    disjoint windows and N ranks of B see the same data as one process of N*B.

    Yields ``(inputs [B, T] int64, targets [B, T] int64)`` with ``targets[:, t] = inputs[:, t+1]``
    within a window of T + 1 tokens (``B = batch_size``, ``T = seq_len``).

    Example::

        stream = TokenStream(data.train_path, data.dtype, seq_len=256, batch_size=16)
        inputs, targets = next(stream)
        state = stream.state_dict()   # into the checkpoint; load_state_dict() to resume
    """

    def __init__(self, bin_path: str | Path, dtype, seq_len: int, batch_size: int,
                 seed: int = 0, rank: int = 0, world_size: int = 1):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len={seq_len}, batch_size={batch_size}: both must be >= 1")
        if seed < 0:
            raise ValueError(f"seed={seed}: must be >= 0")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
        self.tokens = _open_tokens(bin_path, dtype, seq_len)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed = seed
        self.batches_drawn = 0

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(inputs [B, T] int64, targets [B, T] int64)`` for this rank."""
        T, B = self.seq_len, self.batch_size
        # Window starts s with s + T + 1 <= n, for the whole world; this rank keeps its B.
        key = np.array([self.seed, self.batches_drawn], dtype=np.uint64)
        rng = np.random.Generator(np.random.Philox(key=key))
        starts = rng.integers(0, len(self.tokens) - T, self.world_size * B)
        starts = starts[self.rank * B:(self.rank + 1) * B]
        self.batches_drawn += 1
        windows_BT1 = torch.from_numpy(np.stack([self.tokens[s:s + T + 1] for s in starts]).astype(np.int64))
        return windows_BT1[:, :-1].contiguous(), windows_BT1[:, 1:].contiguous()

    def state_dict(self) -> dict:
        """Position in the stream (plain ints, JSON-serialisable): seed and batches drawn."""
        return {"seed": self.seed, "batches_drawn": self.batches_drawn,
                "seq_len": self.seq_len, "global_batch_size": self.world_size * self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken. The global batch (world_size * batch_size)
        and seq_len must match; how it is split over ranks may differ."""
        for name, mine in (("seq_len", self.seq_len), ("global_batch_size", self.world_size * self.batch_size)):
            if state[name] != mine:
                raise ValueError(f"TokenStream state has {name}={state[name]}, this stream {mine}")
        self.seed = state["seed"]
        self.batches_drawn = state["batches_drawn"]


def val_batches(bin_path: str | Path, dtype, seq_len: int, batch_size: int,
                max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic validation batches: consecutive windows from the start of the array.

    Window k covers tokens ``[k*T, k*T + T + 1)``, so every token is predicted at most once.
    Yields ``(inputs [b, T] int64, targets [b, T] int64)`` with ``b = batch_size`` except
    possibly a smaller last batch; at most ``max_batches`` batches (None = all).
    """
    tokens = _open_tokens(bin_path, dtype, seq_len)
    T = seq_len
    n_windows = (len(tokens) - 1) // T
    n_batches = math.ceil(n_windows / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        ks = range(b * batch_size, min((b + 1) * batch_size, n_windows))
        windows_BT1 = torch.from_numpy(np.stack([tokens[k * T:k * T + T + 1] for k in ks]).astype(np.int64))
        yield windows_BT1[:, :-1].contiguous(), windows_BT1[:, 1:].contiguous()

