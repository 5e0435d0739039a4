"""When to take a fast path, and the compiled versions of small elementwise ops.

The reference ops are plain PyTorch. On CUDA the elementwise ones (RMSNorm, gated RMSNorm,
SiTU-GLU) run through ``torch.compile`` of the *same* function, which fuses them into one
kernel each; the numerics are the reference's, so the tests that compare the two only have to
allow for fusion-order rounding. Inside a region that is itself being compiled (the decoder
layers' attention and MLPs, ``openk3.parallel.compile``) they are traced as plain code instead,
so the region's graph fuses them with their neighbours.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import threading
import warnings
from typing import Callable

import torch


def use_fast_path(x: torch.Tensor) -> bool:
    """Fast paths run on CUDA unless ``OPENK3_REFERENCE=1`` forces the references everywhere."""
    return x.is_cuda and not _reference_forced()


def launch_device(t: torch.Tensor):
    """A context making ``t``'s CUDA device current for a Triton launch (Triton launches on the
    current device); a no-op for CPU tensors (the tests run Triton's interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an op on these tensors (None entries are skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result`` without importing dynamo: that decorator only
    sets this attribute on ``fn`` (``torch/_dynamo/decorators.py``; ``tests/ops/test_fast.py``
    checks that it still does), but importing ``torch._dynamo`` for it costs ~2.3 s of every
    process's start (each torchrun rank, each ``openk3`` command), where only compiling code
    needs dynamo."""
    fn._dynamo_marked_constant = True
    return fn


# per compile_disabled function, the call that makes (once) and returns its disabled form
_PENDING_DISABLED: list[Callable[[], Callable]] = []


def compile_disabled(reason: str) -> Callable[[Callable], Callable]:
    """``torch.compiler.disable(reason=reason)`` as a decorator that does not import dynamo (see
    ``constant_result``). While ``torch._dynamo`` is not imported nothing can trace ``fn``, and the
    wrapper calls it directly; from then on it calls ``torch.compiler.disable(fn)``, made by
    ``prepare_compile`` (which openk3's own ``torch.compile`` calls run first, so their traces see
    the disabled function as before) or at the first call (a trace that meets it first breaks at
    that call, as it would at the disabled function)."""
    def decorate(fn: Callable) -> Callable:
        if "torch._dynamo" in sys.modules:
            return torch.compiler.disable(fn, reason=reason)
        made: list[Callable] = []

        def disabled() -> Callable:
            if not made:
                made.append(torch.compiler.disable(fn, reason=reason))
            return made[0]

        _PENDING_DISABLED.append(disabled)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if "torch._dynamo" not in sys.modules:  # no tracer exists to keep out
                return fn(*args, **kwargs)
            return disabled()(*args, **kwargs)

        return call

    return decorate


def prepare_compile() -> None:
    """Import dynamo and give every ``compile_disabled`` function its disabled form: run before
    ``torch.compile``."""
    import torch._dynamo  # noqa: F401

    for disabled in _PENDING_DISABLED:
        disabled()


@constant_result  # a compiled graph keeps the path chosen when it was traced
def _reference_forced() -> bool:
    return os.environ.get("OPENK3_REFERENCE", "0") == "1"


@functools.cache
def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@constant_result  # dynamo calls it and keeps the result: no import traced
def importable(module: str) -> bool:
    """Whether ``module`` imports (fla-core's kernels need triton); tried once per module."""
    return _imports(module)


def _signature(args) -> tuple:
    """What makes dynamo compile a new graph for these ops: per tensor its rank, dtype, grad
    mode, and which sizes are 1 (sizes 0 and 1 are specialised even with dynamic shapes)."""
    return tuple((a.dim(), a.dtype, a.requires_grad, tuple(n == 1 for n in a.shape))
                 for a in args if isinstance(a, torch.Tensor)) + (torch.is_grad_enabled(),
                                                                  torch.is_inference_mode_enabled())


# dynamo's config is process-wide: calls that flip it hold this lock (re-entrant, uncontended in
# practice: one thread runs the model)
_CONFIG_LOCK = threading.RLock()
# graphs each compiled op may keep (dynamo's default is 8 per function): RL runs one norm in the
# rollout engine (bf16, inference), the trainer (autocast, grad), teachers and the reference, over
# several ranks and size-1 patterns, and went past 8 on the device (eighth session); each graph is
# one small elementwise kernel
OP_RECOMPILE_LIMIT = 32


def compiled(fn: Callable) -> Callable:
    """``torch.compile`` ``fn`` lazily (first CUDA call), with dynamic shapes; while dynamo
    traces a caller (a compiled region), ``fn`` itself, traced as part of that graph.

    If dynamo gives up on a kind of call (the per-function recompile limit, raised to
    ``OP_RECOMPILE_LIMIT`` for these calls: serving and RL call the same norm with many ranks,
    dtypes and grad modes), calls of that kind run ``fn`` eagerly from then on, with one
    warning: the same numerics, just unfused.

    Parameters' shapes stay dynamic too: by default dynamo treats them as static, so every norm
    width (hidden size, q/kv LoRA ranks, MoE latent, KDA head) would cost a graph of its own and
    exhaust the limit within one training run.
    """
    eager: set[tuple] = set()

    @functools.cache
    def get() -> Callable:
        prepare_compile()
        return torch.compile(fn, dynamic=True, fullgraph=True)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        sig = _signature(args)
        if sig in eager:
            return fn(*args, **kwargs)
        graph = get()  # the first call imports dynamo (prepare_compile)
        config = torch._dynamo.config  # set and restored by hand: 2x cheaper than config.patch
        with _CONFIG_LOCK:
            static, config.force_parameter_static_shapes = config.force_parameter_static_shapes, False
            limit, config.recompile_limit = config.recompile_limit, max(config.recompile_limit, OP_RECOMPILE_LIMIT)
            try:
                return graph(*args, **kwargs)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                warnings.warn(f"torch.compile of {fn.__name__} hit its recompile limit; running it "
                              f"eagerly for inputs like {sig}")
                eager.add(sig)
                return fn(*args, **kwargs)
            finally:
                config.force_parameter_static_shapes, config.recompile_limit = static, limit

    return wrapper
