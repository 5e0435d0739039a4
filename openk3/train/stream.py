"""Batches for ``openk3 train`` from the flat token arrays ``prepare_data`` writes.

**Exact resume.** ``TokenStream`` draws batch ``i``'s window offsets from a counter-based
Philox generator keyed by ``(seed, i)``, so its position is two integers: its ``state_dict``
is plain JSON for the checkpoint, and a resumed run sees exactly the batches it would have
seen. (Not a ``torch.Generator``: re-seeding one per batch keeps only 32 bits of the seed,
so batches would repeat, and its running state is 5 KB of bytes.) Every rank draws the
same global batch of ``world_size * batch_size`` offsets and keeps its own slice, so N ranks
of B see the same data as one process of N*B.

Both readers go through ``np.memmap``: a random window costs a few page reads, never a
re-tokenisation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch


def num_tokens(bin_path: str | Path, dtype) -> int:
    """Tokens in the array at ``bin_path`` (0 when there is no such file)."""
    bin_path = Path(bin_path)
    return bin_path.stat().st_size // np.dtype(dtype).itemsize if bin_path.is_file() else 0


def _open_tokens(bin_path: str | Path, dtype, seq_len: int) -> np.ndarray:
    """The token array at ``bin_path``, checked to hold at least one window of seq_len + 1."""
    bin_path = Path(bin_path)
    dtype = np.dtype(dtype)
    if not bin_path.is_file():
        raise ValueError(f"{bin_path}: token file not found")
    n = num_tokens(bin_path, dtype)
    if n < seq_len + 1:
        raise ValueError(f"{bin_path}: {n} tokens, but a window of seq_len={seq_len} needs "
                         f"{seq_len + 1}; use more data or a shorter seq_len")
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,))


def _inputs_and_targets(windows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of T + 1 tokens -> ``(inputs [b, T] int64, targets [b, T] int64)``, shifted by one."""
    windows_BT1 = torch.from_numpy(np.stack(windows).astype(np.int64))
    return windows_BT1[:, :-1].contiguous(), windows_BT1[:, 1:].contiguous()


class TokenStream:
    """Endless training batches of random windows over a token memmap, resumable exactly.

    Batch ``i`` draws ``world_size * batch_size`` window starts from a Philox generator keyed
    by ``(seed, i)`` (identical on every rank) and keeps slice ``rank``, so ranks see
    disjoint windows and N ranks of B see the same data as one process of N*B.

    Example::

        stream = TokenStream(data.train_path, data.dtype, seq_len=256, batch_size=16)
        inputs, targets = stream.next_batch()
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

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(inputs [B, T] int64, targets [B, T] int64)`` for this rank, with
        ``targets[:, t] = inputs[:, t+1]`` within a window of T + 1 tokens
        (``B = batch_size``, ``T = seq_len``)."""
        T, B = self.seq_len, self.batch_size
        # Window starts s with s + T + 1 <= n, for the whole world; this rank keeps its B.
        key = np.array([self.seed, self.batches_drawn], dtype=np.uint64)
        rng = np.random.Generator(np.random.Philox(key=key))
        starts = rng.integers(0, len(self.tokens) - T, self.world_size * B)
        starts = starts[self.rank * B:(self.rank + 1) * B]
        self.batches_drawn += 1
        return _inputs_and_targets([self.tokens[s:s + T + 1] for s in starts])

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
                max_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic validation batches: consecutive windows from the start of the array.

    Window k covers tokens ``[k*T, k*T + T + 1)``, so every token is predicted at most once.
    Yields ``(inputs [b, T] int64, targets [b, T] int64)`` with ``b = batch_size`` except
    possibly a smaller last batch; at most ``max_batches`` batches.
    """
    tokens = _open_tokens(bin_path, dtype, seq_len)
    T = seq_len
    n_windows = (len(tokens) - 1) // T
    for b in range(min(math.ceil(n_windows / batch_size), max_batches)):
        ks = range(b * batch_size, min((b + 1) * batch_size, n_windows))
        yield _inputs_and_targets([tokens[k * T:k * T + T + 1] for k in ks])
