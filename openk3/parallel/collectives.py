"""The few collectives the training loop itself runs; each is a no-op without a process group,
so the loop reads the same with one process or many."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if _active():
        dist.barrier()


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """The mean of ``t`` over all ranks, in place (every rank gets it); returns ``t``."""
    if _active():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t


def main_rank_first(fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0, then on the other ranks: for work that fills a cache (tokenising a
    corpus), which the other ranks then read instead of all writing it at once."""
    if not _active():
        return fn()
    main = dist.get_rank() == 0
    result = fn() if main else None
    dist.barrier()
    return result if main else fn()
