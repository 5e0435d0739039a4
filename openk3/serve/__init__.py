"""Serving engine: pure-policy scheduler and cache bookkeeping (no tensors), and the sampler."""

from openk3.serve.block_manager import (
    Allocation,
    BlockCopy,
    BlockManager,
    CacheConfig,
    KDARestore,
    PrefixCacheStats,
)
from openk3.serve.sampler import SamplingParams, sample
from openk3.serve.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from openk3.serve.sequence import Sequence, SequenceStatus

__all__ = [
    "Allocation", "BlockCopy", "BlockManager", "CacheConfig", "KDARestore", "PrefixCacheStats",
    "SamplingParams", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Sequence", "SequenceStatus",
    "sample",
]
