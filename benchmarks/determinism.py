"""Run-to-run determinism of the router logits and of a training forward on CUDA (seventeenth
session: graphed and eager steps of the same model drifted apart with the split router logits
and agreed without them). Each case runs REPEATS times with a differently sized allocation in
between (other addresses) and random values written into the allocator's free blocks (a read of
memory no op wrote would differ), and counts distinct results; the model case also runs the
first training step of fresh instances of one model (same seed and batches). Results:
docs/benchmarks.md, seventeenth session.

Usage: python benchmarks/determinism.py ops | model auto|torch   (CUDA)
``ops`` also sums k = 4 rows per token with ``index_add_`` as the routed experts do: in the
eighteenth session fresh instances first differed at the routed experts' output with either
router logits."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
REPEATS = 24


def garbage(i: int) -> None:
    """Random values in the allocator's cached blocks: a read of memory no op wrote differs."""
    torch.manual_seed(i)
    for n in (1 << 20, 1 << 24, 1 << 27):
        torch.empty(n, device="cuda").normal_()


def distinct(fn) -> int:
    seen = []
    for i in range(REPEATS):
        junk = torch.empty(1 + 4099 * i, device="cuda")  # noqa: F841 - shifts the next allocations
        garbage(i)
        out = fn()
        out = torch.cat([o.detach().flatten().float() for o in out]) if isinstance(out, tuple) else out.detach().clone()
        if not any(torch.equal(out, s) for s in seen):
            seen.append(out)
    return len(seen)


def ops() -> None:
    from openk3.ops.router import _halves, router_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    for n, d, e in ((128, 1024, 64), (256, 1024, 64), (16384, 1024, 64)):
        x = torch.randn(n, d, device="cuda", generator=g).bfloat16()
        w = torch.randn(e, d, device="cuda", generator=g) * 0.02
        w2 = _halves(w)
        cases = {
            "split": lambda: router_logits(x, w, backend="split"),
            "torch (fp32 linear)": lambda: router_logits(x, w, backend="torch"),
            "mm out_dtype=fp32": lambda: torch.mm(x, w2.t(), out_dtype=torch.float32),
            "mm bf16": lambda: x @ w2.t(),
            "mm fp32 of bf16 values": lambda: x.float() @ w2.float().t(),
        }
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        dy = torch.randn(n, e, device="cuda", generator=g)

        def with_grad(backend):
            y = router_logits(xg, wg, backend=backend)
            dx, dw = torch.autograd.grad(y, (xg, wg), dy)
            return y, dx, dw

        # the routed experts' sum over each token's k = 4 rows (RoutedExperts.forward_sorted):
        # fp32 atomics, whose order of additions may vary
        rows = torch.randn(n * 4, d, device="cuda", generator=g)
        token = torch.randperm(n * 4, device="cuda", generator=g) // 4
        cases["index_add_ of k=4 rows"] = lambda: torch.zeros(n, d, device="cuda").index_add_(0, token, rows)
        cases["split with grads"] = lambda: with_grad("split")
        cases["torch with grads"] = lambda: with_grad("torch")
        for name, fn in cases.items():
            print(f"ops N={n} d={d} E={e}: {name}: {distinct(fn)} distinct of {REPEATS}", flush=True)


def model(backend: str) -> None:
    import functools

    import openk3.model.moe as moe
    from tests.train.test_graphed import _batch, _gpu_training

    if backend != "auto":
        moe.router_logits = functools.partial(moe.router_logits, backend=backend)
    t, _ = _gpu_training(grad_accum=1)
    inputs, targets = (x.cuda() for x in _batch(0, t=64))

    def loss():
        with torch.no_grad(), t.autocast():
            return t.model(inputs, labels=targets).loss

    print(f"model forward, router logits {backend}: {distinct(loss)} distinct of {REPEATS}", flush=True)

    def grad_loss():
        with t.autocast():
            return t.model(inputs, labels=targets).loss.detach()

    print(f"model forward with autograd, router logits {backend}: {distinct(grad_loss)} distinct of "
          f"{REPEATS}", flush=True)
    # fresh instances: every module's output in call order during a forward with autograd, to
    # name the first module whose output differs between instances
    traces = []
    for i in range(3):
        garbage(200 + i)
        tr, _ = _gpu_training(grad_accum=1)
        trace = []

        def record(module, _args, out, name=None):
            out = out[0] if isinstance(out, tuple) else out
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                trace.append((name, out.detach().double().sum().item()))

        handles = [m.register_forward_hook(functools.partial(record, name=n))
                   for n, m in tr.model.named_modules() if n]
        with tr.autocast():
            tr.model(inputs, labels=targets).loss.backward()
        for h in handles:
            h.remove()
        traces.append(trace)
        del tr
    first = next(((k, a[0]) for k, (a, b, c) in enumerate(zip(*traces)) if not a[1] == b[1] == c[1]), None)
    print(f"fresh instances' forward, router logits {backend}: {len(traces[0])} module outputs, first "
          f"differing: {first}", flush=True)
    # the failing test's first step (two micro-batches, backward, the balancer's update, no
    # optimiser step) on fresh instances of the same model
    from openk3.train.optim import set_lr
    from openk3.train.trainer import train_step
    batches = [tuple(x.cuda() for x in _batch(i, t=64)) for i in range(2)]
    firsts = []
    for i in range(4):
        garbage(100 + i)
        tr, cfg = _gpu_training(grad_accum=2)
        set_lr(tr.optimizers, 0.0)
        loss_f, norm, _ = train_step(tr, batches, cfg)
        firsts.append((loss_f, float(norm)))
        del tr
    print(f"first steps of fresh instances, router logits {backend}: {firsts}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "ops":
        ops()
    else:
        model(sys.argv[2])
