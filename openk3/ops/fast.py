"""When to take a fast path, and the compiled versions of small elementwise ops.

The reference ops are plain PyTorch. On CUDA the elementwise ones (RMSNorm, gated RMSNorm,
SiTU-GLU) run through ``torch.compile`` of the *same* function, which fuses them into one
kernel each; the numerics are the reference's, so the tests that compare the two only have to
allow for fusion-order rounding.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch


def use_fast_path(x: torch.Tensor) -> bool:
    """Fast paths run on CUDA unless ``OPENK3_REFERENCE=1`` forces the references everywhere."""
    return x.is_cuda and os.environ.get("OPENK3_REFERENCE", "0") != "1"


def compiled(fn: Callable) -> Callable:
    """``torch.compile`` ``fn`` lazily (first CUDA call), with dynamic shapes."""

    @functools.cache
    def get() -> Callable:
        return torch.compile(fn, dynamic=True, fullgraph=True)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return get()(*args, **kwargs)

    return wrapper
