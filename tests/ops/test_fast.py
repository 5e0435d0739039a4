"""``openk3.ops.fast``: when a fast path is taken, the ``compiled`` wrapper of the
elementwise ops (eager fallback at dynamo's recompile limit, one graph across widths), and the
compile markers that do not import dynamo (``constant_result``, ``compile_disabled``)."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from openk3.ops import fast
from openk3.ops.norm import rms_norm_ref


@pytest.mark.parametrize("reference,expected", [("0", True), ("1", False)])
def test_fast_path_on_cuda_unless_reference_forced(monkeypatch, reference, expected):
    class CudaLike:  # use_fast_path reads only is_cuda; a CUDA tensor cannot exist on CI
        is_cuda = True

    monkeypatch.setenv("OPENK3_REFERENCE", reference)
    assert fast.use_fast_path(CudaLike()) is expected
    assert not fast.use_fast_path(torch.zeros(1))


_WITHOUT_DYNAMO = """
import sys
import torch
import openk3, openk3.cli, openk3.serve.engine
from openk3.ops import fast
assert "torch._dynamo" not in sys.modules
calls = []
@fast.compile_disabled("test")
def prepared(x):
    calls.append(torch.compiler.is_compiling())
    return x + 1
@fast.compile_disabled("test")
def lazy(x):
    calls.append(torch.compiler.is_compiling())
    return x - 1
x = torch.randn(4)
assert torch.equal(prepared(x), x + 1) and "torch._dynamo" not in sys.modules  # called directly
from torch._dynamo.testing import CompileCounter
fast.prepare_compile()  # gives `prepared` its disabled form; `lazy` gets its own at its first call
for fn, graphs in ((prepared, 2), (lazy, None)):
    counter = CompileCounter()
    graph = torch.compile(lambda x: fn(x * 2) * 3, backend=counter)
    assert torch.equal(graph(x), fn(x * 2) * 3)
    assert graphs is None or counter.frame_count == graphs, counter.frame_count
assert calls == [False] * 5, calls  # never traced: both ran eagerly under the compiled caller
print("ok")
"""


def test_importing_openk3_does_not_import_dynamo_and_disabled_functions_stay_out_of_traces():
    """``import torch._dynamo`` costs ~2.3 s of every process's start (torchrun ranks, CLI calls,
    test subprocesses), so openk3 imports it only to compile. ``compile_disabled`` functions
    decorated before that still never get traced: made disabled by ``prepare_compile``, or at
    their first call under a trace."""
    run = subprocess.run([sys.executable, "-c", _WITHOUT_DYNAMO], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=120, check=False)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_constant_result_marks_a_function_as_torch_does():
    def ours():
        return 1

    def torchs():
        return 1

    assert fast.constant_result(ours) is ours
    assert torch.compiler.assume_constant_result(torchs) is torchs
    assert vars(ours) == vars(torchs) == {"_dynamo_marked_constant": True}


def test_compile_disabled_functions_break_the_graph_once_dynamo_is_loaded():
    calls = []

    @fast.compile_disabled("test: runs as it is")
    def opaque(x):
        calls.append(torch.compiler.is_compiling())
        return x + 1

    def f(x):
        return opaque(x * 2) * 3

    counter = CompileCounter()
    fast.prepare_compile()
    graph = torch.compile(f, backend=counter)
    x = torch.randn(4)
    torch.testing.assert_close(graph(x), f(x))
    assert counter.frame_count == 2  # x * 2, then * 3: opaque runs outside both graphs
    assert calls == [False, False]  # never traced, run eagerly both times


def test_compiled_falls_back_to_eager_when_dynamo_gives_up(monkeypatch):
    """Serving calls the compiled norms with many ranks/dtypes/grad modes; when dynamo hits its
    recompile limit for one kind of call, that kind runs eagerly (once warned), others stay
    compiled."""
    compiled_calls = []

    def fake_compile(fn, **kw):
        def run(*args):
            if args[0].dim() == 3:
                raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile limit")
            compiled_calls.append(args[0].dim())
            return fn(*args)
        return run

    monkeypatch.setattr(fast.torch, "compile", fake_compile)
    double = fast.compiled(lambda x: x * 2)
    with pytest.warns(UserWarning, match="recompile limit"):
        assert torch.equal(double(torch.ones(1, 2, 3)), torch.full((1, 2, 3), 2.0))
    assert torch.equal(double(torch.ones(1, 2, 3)), torch.full((1, 2, 3), 2.0))  # eager, no warning
    assert torch.equal(double(torch.ones(4)), torch.full((4,), 2.0))
    assert compiled_calls == [1]


def test_compiled_norm_keeps_one_graph_across_widths(monkeypatch, request):
    """Norms of every width (1024 hidden, 384/512 LoRA ranks, 128 heads...) share one dynamic
    graph per kind of call: weights are Parameters, whose shapes dynamo would treat as static."""
    torch._dynamo.reset()
    counter, real_compile = CompileCounter(), torch.compile
    monkeypatch.setattr(fast.torch, "compile", lambda fn, **kw: real_compile(fn, backend=counter, **kw))
    norm = fast.compiled(rms_norm_ref)
    request.addfinalizer(torch._dynamo.reset)  # leave rms_norm_ref's recompile budget to later tests
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*recompile limit")  # no eager fallback
        for width in (64, 96, 128, 384, 512, 1024, 200):
            w = torch.nn.Parameter(torch.rand(width) + 0.5)
            for shape in ((3, 5, width), (7, width)):
                x = torch.randn(*shape, requires_grad=True)
                y = norm(x, w, 1e-6)
                torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-6))
                y.sum().backward()
                assert w.grad is not None
    assert counter.frame_count <= 4, counter.frame_count  # one graph per rank (+ respecialisation)


def test_compiled_op_keeps_more_graphs_than_dynamos_default(monkeypatch, request):
    """RL calls one norm in ~a dozen kinds of way (engine, trainer, teachers; ranks, dtypes, grad
    modes): past dynamo's default of 8 graphs per function they would run eagerly. A compiled op
    keeps up to ``OP_RECOMPILE_LIMIT``, and dynamo's global limit is left as it was."""
    torch._dynamo.reset()
    counter, real_compile = CompileCounter(), torch.compile
    monkeypatch.setattr(fast.torch, "compile", lambda fn, **kw: real_compile(fn, backend=counter, **kw))
    norm = fast.compiled(rms_norm_ref)
    request.addfinalizer(torch._dynamo.reset)
    default = torch._dynamo.config.recompile_limit
    kinds = [(shape, dtype, grad) for shape in ((5, 8), (2, 5, 8), (2, 3, 5, 8))
             for dtype in (torch.float32, torch.float64) for grad in (False, True)]
    assert len(kinds) > default < fast.OP_RECOMPILE_LIMIT
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*recompile limit")  # no eager fallback
        for shape, dtype, grad in kinds:
            w = torch.rand(8, dtype=dtype) + 0.5
            x = torch.randn(*shape, dtype=dtype, requires_grad=grad)
            torch.testing.assert_close(norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    assert counter.frame_count > default, counter.frame_count
    assert torch._dynamo.config.recompile_limit == default
