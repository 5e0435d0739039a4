"""Serving engine: ``EngineConfig``, pure-policy scheduler and cache bookkeeping (no tensors),
and the sampler."""

from openk3.serve.block_manager import (
    Allocation,
    BlockCopy,
    BlockManager,
    BlockTableUpdate,
    KDARestore,
    KDASave,
    PrefixCacheStats,
)
from openk3.serve.config import EngineConfig
from openk3.serve.sampler import SamplingParams, sample
from openk3.serve.scheduler import Scheduler, SchedulerOutput
from openk3.serve.sequence import Sequence, SequenceStatus

__all__ = [
    "Allocation", "BlockCopy", "BlockManager", "BlockTableUpdate", "EngineConfig", "KDARestore",
    "KDASave", "PrefixCacheStats",
    "SamplingParams", "Scheduler", "SchedulerOutput", "Sequence", "SequenceStatus", "sample",
]
