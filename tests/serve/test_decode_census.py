"""benchmarks/decode_census.py: every op is given to the innermost module range around it."""

import torch
from torch import nn

from benchmarks.decode_census import attribute, label_modules, summarise


class Inner(nn.Module):
    def forward(self, x):
        return torch.sigmoid(torch.tanh(x))  # two ops, both Inner's


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        y = x.sin()             # Outer's own op
        y = self.inner(y)
        return y.exp()          # Outer's again, after Inner's range closed


def test_ops_go_to_the_innermost_module_range():
    model = Outer()
    remove = label_modules(model)
    x = torch.randn(4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
        torch.cos(x)  # outside every module: the runner's
    remove()
    rows = attribute(prof.events(), on_cuda=False)
    got = sorted((label, name) for label, name, _ in rows)
    assert got == sorted([("/Outer", "aten::sin"), ("/Outer", "aten::exp"), ("Outer/Inner", "aten::tanh"),
                          ("Outer/Inner", "aten::sigmoid"), ("(runner)", "aten::cos")])
    table = {r["module"]: r["kernels"] for r in summarise(rows)}
    assert table == {"/Outer": 2, "Outer/Inner": 2, "(runner)": 1}
    # the hooks are gone: a second profile sees no module ranges
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
    assert {label for label, _, _ in attribute(prof.events(), on_cuda=False)} == {"(runner)"}


def test_leaves_are_labelled_but_not_what_is_inside_them():
    model = nn.Sequential(Outer())
    remove = label_modules(model, leaves=(Outer,))
    x = torch.randn(4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
    remove()
    rows = attribute(prof.events(), on_cuda=False)
    assert {label for label, _, _ in rows} == {"Sequential/Outer"} and len(rows) == 4  # Inner's too
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
