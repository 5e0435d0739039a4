"""The LM loss at a preset's head: fla's fused linear cross-entropy vs materialised logits.

One training step's loss on one GPU, as the trainer computes it: N tokens' final hidden states
(fp32) and the fp32 master ``lm_head.weight`` under bf16 autocast. Rows, forward + backward:

* ``logits``: ``linear_cross_entropy(backend="torch")``, the [N, V] logits in fp32 then
  ``F.cross_entropy``: what the trainer did before (the same operations).
* ``fused``: ``linear_cross_entropy(backend="fla")``, what the trainer does now (fla's kernel,
  weight gradient summed over row chunks in bf16).
* ``fused, fp32 sums``: fla's default ``accumulate_grad_in_fp32=True``, called directly: the
  weight gradient summed in fp32 by an fp32 matmul (the alternative ``linear_cross_entropy``
  does not take).

Each row: milliseconds (CUDA events, median after warm-up), peak memory above the inputs,
and relative errors of loss and gradients against the fp32 reference on the same
bf16-rounded operands. Floor: three [N, d] x [d, V] bf16 matmuls, 6 N d V flops: 8.2 ms for
``small`` (N = 16,384, d = 1024, V = 65,536) at 800 TFLOP/s.

Run on the device: ``python benchmarks/loss_bench.py [--preset small] [--tokens 16384]``.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time, environment, rel_err, write_results
from openk3 import preset
from openk3.ops.loss import fla_linear_cross_entropy, linear_cross_entropy


def fla_fp32_sums(hidden, weight, targets):
    with torch.autocast("cuda", enabled=False):  # the casts linear_cross_entropy makes
        return fla_linear_cross_entropy()(hidden.bfloat16(), targets, weight.bfloat16())


ROWS = {
    "logits": lambda h, w, t: linear_cross_entropy(h, w, t, backend="torch"),
    "fused": lambda h, w, t: linear_cross_entropy(h, w, t, backend="fla"),
    "fused, fp32 sums": fla_fp32_sums,
}


def loss_and_grads(fn, hidden, weight, targets, autocast: bool = True):
    h, w = (t.detach().requires_grad_() for t in (hidden, weight))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, targets)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=16384, help="N: batch x sequence length")
    args = ap.parse_args()
    print(environment())
    cfg = preset(args.preset)
    N, d, V = args.tokens, cfg.hidden_size, cfg.vocab_size
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, d, device="cuda", generator=g)
    weight = torch.randn(V, d, device="cuda", generator=g) * 2 / d ** 0.5  # logits of std 2
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    # the fp32 reference on the operands bf16 autocast sees
    expected = loss_and_grads(ROWS["logits"], hidden.bfloat16().float(),
                              weight.bfloat16().float(), targets, autocast=False)
    rows = []
    for name, fn in ROWS.items():  # results are written after every row: a timeout keeps them
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        actual = loss_and_grads(fn, hidden, weight, targets)
        peak = torch.cuda.max_memory_allocated() - base
        row = {"path": name, "N": N, "d": d, "V": V,
               "ms": 1e3 * cuda_time(lambda: loss_and_grads(fn, hidden, weight, targets)),
               "peak_GiB": peak / 2**30}
        row |= {f"err_{n}": rel_err(a, b)
                for n, a, b in zip(("loss", "dhidden", "dweight"), actual, expected)}
        rows.append(row)
        write_results("loss_bench", rows)
    print(f"fused vs logits: {rows[0]['ms'] / rows[1]['ms']:.2f}x faster, "
          f"{rows[0]['peak_GiB'] / rows[1]['peak_GiB']:.1f}x less memory", flush=True)


if __name__ == "__main__":
    main()
