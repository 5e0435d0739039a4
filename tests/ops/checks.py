"""What the op tests share: every output and every gradient compared with its own tolerance,
packed-sequence offsets, NaN-poisoned allocations for kernels' outputs, running a module's
docstring examples, and running a script under the Triton interpreter."""

from __future__ import annotations

import contextlib
import doctest
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.forkserver import ForkServer


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_all_close(actual: dict, expected: dict, tols: dict) -> None:
    """Compare every tensor named in ``expected`` with its own tolerance; report all misses."""
    assert actual.keys() == expected.keys()
    errors = {name: rel_err(actual[name], expected[name]) for name in expected}
    misses = {name: f"{err:.1e} > {tols[name]:.0e}" for name, err in errors.items()
              if not err <= tols[name]}  # `not <=` also catches NaN
    assert not misses, f"relative errors: {misses}"


def run_with_grads(fn, inputs: dict, out_names: tuple[str, ...] = ("o", "S"),
                   seed: int = 1) -> dict:
    """fn(**inputs) -> outputs named ``out_names`` (None for one not computed). Returns the
    outputs and the gradient of every input under random cotangents (fixed by ``seed``, so two
    implementations see the same ones)."""
    leaves = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}
    outs = dict(zip(out_names, fn(**leaves)))
    outs = {name: t for name, t in outs.items() if t is not None}
    gen = torch.Generator().manual_seed(seed)
    loss = sum((t.float() * torch.randn(t.shape, generator=gen).to(t.device)).sum()
               for t in outs.values())
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return outs | dict(zip(leaves, grads))


def cu_seqlens_of(lengths, device="cpu") -> torch.Tensor:
    """Offsets [N+1] of packed sequences of these lengths: 0, l0, l0 + l1, ..."""
    return torch.tensor((0, *lengths), device=device).cumsum(0)


@contextlib.contextmanager
def nan_poisoned_empty():
    """While active, ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` return
    floating tensors filled with NaN: output a kernel leaves unwritten then fails a comparison
    instead of passing on whatever the allocator handed back."""
    def poisoned(make):
        def wrapper(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return wrapper

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", poisoned(torch.empty))
        mp.setattr(torch, "empty_like", poisoned(torch.empty_like))
        mp.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))
        yield


def run_doctests(module) -> None:
    """Run ``module``'s docstring examples; there must be some and all must pass."""
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0, f"{result.failed} example(s) of {module.__name__} failed"


# The interpreter's scripts run in children of one fork server (tests/forkserver.py) that has
# imported torch, Triton and openk3's ops under TRITON_INTERPRET=1 (~2.8 s a process on CI's
# CPUs, for ~17 scripts).
_server: ForkServer | None = None


def _interpreter_env() -> tuple[Path, dict]:
    root = Path(__file__).resolve().parents[2]
    interpreter = root / ".venv" / "triton-interpreter"
    if not (interpreter / "triton").is_dir():
        pytest.importorskip("triton")
    return root, dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(root), str(interpreter), os.environ.get("PYTHONPATH", "")]))


def run_triton_interpreted(script: str) -> None:
    """Run ``script`` with ``TRITON_INTERPRET=1`` (the interpreter is chosen when a kernel is
    defined, so it cannot be switched on in this process) from the repository root: in a child
    of a fork server on Linux, else in a subprocess of its own. It must print a last line ending
    in ``ok``. Triton comes from ``.venv/triton-interpreter`` (``scripts/setup.sh``) when it is
    not importable here."""
    root, env = _interpreter_env()
    script = textwrap.dedent(script)
    global _server
    if sys.platform == "linux":
        _server = _server or ForkServer(("numpy", "torch", "triton", "openk3.ops"), env)
        code, out, err, _ = _server.run("script", script)
    else:
        run = subprocess.run([sys.executable, "-c", script], env=env, cwd=root,
                             capture_output=True, text=True, timeout=300, check=False)
        code, out, err = run.returncode, run.stdout, run.stderr
    assert code == 0 and out.strip().endswith("ok"), err[-3000:]
