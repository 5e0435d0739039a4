"""benchmarks/train_census.py: forward ops go to their module, a backward node's ops to the
module whose forward op made the node, an optimiser's ops to its step."""

import torch
from torch import nn

from benchmarks.decode_census import label_modules, summarise
from benchmarks.train_census import attribute_step


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x):
        return torch.tanh(x * self.w)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x.sin()).exp()


def test_forward_backward_and_optimizer_ops_go_to_their_sources():
    model = Outer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    x = torch.randn(4, requires_grad=True)
    model.inner.w.grad = torch.zeros(4)  # AccumulateGrad then adds into it
    remove = label_modules(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
        opt.step()
    remove()
    rows = attribute_step(prof.events(), on_cuda=False)
    got = {(label, name) for label, name, _ in rows}
    assert {("/Outer", "aten::sin"), ("/Outer", "aten::exp"), ("Outer/Inner", "aten::mul"),
            ("Outer/Inner", "aten::tanh"),
            ("Outer/Inner bwd", "aten::tanh_backward"), ("/Outer bwd", "aten::cos"),
            ("(grad accumulation)", "aten::add_"), ("optimizer SGD.step", "aten::add_")} <= got
    # the backward of Inner's multiply (by w and by x) is Inner's, never Outer's
    assert ("/Outer bwd", "aten::tanh_backward") not in got
    assert {label for label, name, _ in rows if name == "aten::tanh_backward"} == {"Outer/Inner bwd"}
    labels = {r["module"] for r in summarise(rows)}
    assert labels == {"/Outer", "Outer/Inner", "(step)", "Outer/Inner bwd", "/Outer bwd",
                      "(grad accumulation)", "optimizer SGD.step"}


def test_kernel_kinds_sum_by_first_matching_kind():
    from benchmarks.kernel_kinds import kinds

    rows = kinds([["nvjet_sm90_tst_256x128", 30.0, 3], ["chunk_kda_bwd_kernel_intra", 20.0, 1],
                  ["triton_red_fused_add_0", 5.0, 2], ["cutlass_grouped_gemm", 10.0, 1],
                  ["void at::native::vectorized_elementwise_kernel<4, FillFunctor>", 1.0, 7],
                  ["mystery", 0.5, 1]])
    assert rows == [("GEMMs (cuBLAS, CUTLASS)", 40.0, 4), ("fla KDA", 20.0, 1),
                    ("inductor (compiled regions)", 5.0, 2), ("ATen elementwise", 1.0, 7), ("other", 0.5, 1)]


class Table(nn.Module):
    """Ops on a buffer in grad mode: they take the autograd sequence counter's value but make
    no node (as a rotary table or a mask would)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("base", torch.arange(4.0))

    def forward(self):
        return torch.cos(self.base * 2)


class Pick(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, 4))

    def forward(self, table):
        return self.w[0] * table


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.table, self.pick = Table(), Pick()

    def forward(self):
        return self.pick(self.table())


def test_a_node_goes_to_the_module_that_made_it_not_to_an_earlier_op_with_its_number():
    model = Layer()
    remove = label_modules(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model().sum().backward()
    remove()
    rows = attribute_step(prof.events(), on_cuda=False)
    backward = {label for label, _, _ in rows if label.endswith("bwd")}
    assert backward == {"Layer/Pick bwd"}, rows  # the select's and the multiply's backward


def test_kernels_linked_to_no_op_are_counted_unattributed():
    """On CUDA the census must add up to the profile: GPU kernels that no ATen op lists (Triton
    kernels launched from Python) come back as ``(unattributed)``, per name, the rest not twice."""
    from types import SimpleNamespace

    from benchmarks.train_census import _unattributed

    def kernel(name, us, annotation=False):
        return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA, is_user_annotation=annotation,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [kernel("gemm", 10.0), kernel("gemm", 12.0), kernel("momentum_kernel", 5.0),
              kernel("Optimizer.step#Muon.step", 99.0, annotation=True)]
    rows = _unattributed(events, [("gemm", 10.0, "launching op"), ("gemm", 12.0, "launching op")])
    assert rows == [("(unattributed)", "momentum_kernel", 5.0)]
