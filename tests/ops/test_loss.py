"""The linear cross-entropy (LM loss): the reference against ``F.cross_entropy`` over explicit
logits in float64, ignored targets, the autocast casts, and the model's ``labels`` forward
against cross-entropy of its logits. The ``gpu`` tests compare fla-core's fused kernel with the
fp32 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import openk3.ops.loss as loss_ops
from openk3 import build_model, preset
from openk3.ops.loss import IGNORE_INDEX, linear_cross_entropy
from tests.ops.checks import assert_all_close, nan_poisoned_empty, run_doctests, run_with_grads

# fp32 against float64: rounding of d-term dot products and of V-term sums only
FP32_TOL = 1e-5
# bf16 operands against fp32 or float64 on the same values: each logit is rounded to bf16 (at
# most 2^-9 of it), and so is its gradient. One token's loss can be off by 2^-9 of its target
# logit and of the logits in its log-sum-exp (~3e-3 relative with logits of std 2); the mean
# over N tokens averages that away (~2e-6 at N = 1000). The gradients are off by ~2e-3.
BF16_TOLS = {"loss": 5e-3, "hidden": 1e-2, "weight": 1e-2}


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def loss_inputs(N: int, V: int, d: int, device="cpu", ignore_every: int = 7) -> dict:
    """hidden [N, d], weight [V, d] with logits of a few units, targets [N] with every
    ``ignore_every``-th one IGNORE_INDEX (none when 0)."""
    targets = torch.randint(0, V, (N,), device=device)
    if ignore_every:
        targets[::ignore_every] = IGNORE_INDEX
    return dict(hidden=torch.randn(N, d, device=device),
                weight=torch.randn(V, d, device=device) * 2 / d ** 0.5, targets=targets)


def explicit_logits_loss(hidden, weight, targets, ignore_index=IGNORE_INDEX):
    """F.cross_entropy over the logits written out, in float64."""
    logits = hidden.double() @ weight.double().T                                 # [N, V]
    return (F.cross_entropy(logits, targets, ignore_index=ignore_index),)


def with_grads(fn, x: dict) -> dict:
    """fn's loss and the gradients of hidden and weight (targets carry none)."""
    targets = x["targets"]
    return run_with_grads(lambda hidden, weight: fn(hidden, weight, targets),
                          {"hidden": x["hidden"], "weight": x["weight"]}, out_names=("loss",))


def reference(hidden, weight, targets):
    return (linear_cross_entropy(hidden, weight, targets),)


@pytest.mark.parametrize("N", [1, 13, 63])
def test_reference_matches_cross_entropy_over_explicit_logits(N):
    x = loss_inputs(N, 50, 16)
    x["targets"][0] = 3  # N = 1 keeps a counted row
    actual = with_grads(reference, x)
    assert actual["loss"].dtype == torch.float32 and actual["loss"].dim() == 0
    assert_all_close(actual, with_grads(explicit_logits_loss, x),
                     dict.fromkeys(("loss", "hidden", "weight"), FP32_TOL))


def test_ignored_rows_count_for_nothing():
    x = loss_inputs(20, 50, 16, ignore_every=3)
    kept = x["targets"] != IGNORE_INDEX
    loss = linear_cross_entropy(**x)
    torch.testing.assert_close(loss, linear_cross_entropy(
        x["hidden"][kept], x["weight"], x["targets"][kept]))
    # another ignore_index: padding id 0
    targets = torch.where(kept, x["targets"], 0)
    torch.testing.assert_close(linear_cross_entropy(x["hidden"], x["weight"], targets, 0), loss)


def test_all_targets_ignored_gives_zero_loss_and_gradients():
    x = loss_inputs(5, 50, 16, ignore_every=1)
    out = with_grads(reference, x)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in out.values())  # not NaN


def test_bf16_operands():
    x = loss_inputs(33, 50, 16)
    low = x | {n: x[n].bfloat16() for n in ("hidden", "weight")}
    actual = with_grads(reference, low)
    assert actual["loss"].dtype == torch.float32
    assert actual["hidden"].dtype == actual["weight"].dtype == torch.bfloat16
    assert_all_close(actual, with_grads(explicit_logits_loss, low), BF16_TOLS)


def test_weight_is_cast_to_the_hidden_dtype():
    # an fp32 master weight with a bf16 hidden state computes in bf16; its gradient is fp32
    x = loss_inputs(9, 50, 16)
    low = x | {"hidden": x["hidden"].bfloat16()}
    mixed = with_grads(reference, low)
    assert mixed["hidden"].dtype == torch.bfloat16 and mixed["weight"].dtype == torch.float32
    same = with_grads(reference, low | {"weight": x["weight"].bfloat16()})
    assert_all_close(mixed, same, dict.fromkeys(mixed, 0.0))


def test_autocast_computes_as_the_linear_layer_would():
    # the trainer's old path under autocast: F.linear in bf16, then fp32 cross-entropy
    x = loss_inputs(17, 50, 16)

    def old_path(hidden, weight, targets):
        return (F.cross_entropy(F.linear(hidden, weight).float(), targets),)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        actual, expected = with_grads(reference, x), with_grads(old_path, x)
    assert actual["hidden"].dtype == actual["weight"].dtype == torch.float32
    assert_all_close(actual, expected, dict.fromkeys(actual, 0.0))


@pytest.mark.parametrize("name,bad,message", [
    ("hidden", torch.randn(2, 5, 16), "`hidden`"),
    ("hidden", torch.zeros(10, 16, dtype=torch.long), "`hidden`"),
    ("hidden", torch.randn(0, 16), "no rows"),
    ("weight", torch.randn(50, 15), "`weight`"),
    ("targets", torch.zeros(9, dtype=torch.long), "`targets`"),
    ("targets", torch.zeros(10, dtype=torch.int32), "`targets`"),
    ("backend", "triton", "`backend`"),
])
def test_rejects_bad_arguments(name, bad, message):
    kwargs = loss_inputs(10, 50, 16) | {name: bad}
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(**kwargs)


def test_fla_backend_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        linear_cross_entropy(**loss_inputs(4, 50, 16), backend="fla")


def test_docstring_examples_run():
    run_doctests(loss_ops)


def small_model(tie: bool = False):
    cfg = preset("debug").replace(num_hidden_layers=4, full_attn_layers=(4,),
                                  tie_word_embeddings=tie)
    return build_model(cfg), cfg


def loss_and_grads(model, loss) -> dict:
    """loss and the gradient of every parameter that gets one."""
    loss.backward()
    grads = {"loss": loss.detach()} | {n: p.grad.clone() for n, p in model.named_parameters()
                                        if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_model_loss_equals_cross_entropy_of_its_logits(tie):
    model, cfg = small_model(tie)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    labels = torch.randint(0, cfg.vocab_size, (2, 11))
    labels[0, :3] = IGNORE_INDEX
    out = model(ids, labels=labels)
    assert out.logits is None
    actual = loss_and_grads(model, out.loss)
    logits = model(ids).logits
    expected = loss_and_grads(model, F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    assert ("lm_head.weight" in actual) is not tie  # tied: the embedding's gradient holds both
    # the same fp32 operations, the logits flattened before the matmul rather than after
    assert_all_close(actual, expected, dict.fromkeys(expected, 1e-6))


def test_model_rejects_labels_it_cannot_use():
    model, cfg = small_model()
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="labels must be"):
        model(ids, labels=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=1, labels=ids)


# Relative errors of fla against the fp32 reference on the same values. fp32: the same products
# summed in another order (no TF32: PyTorch's default). bf16: as BF16_TOLS for the reference in
# bf16, and fla sums the weight gradient over its 8 row chunks in bf16 (about twice the error).
FLA_TOLS = {"fp32": dict.fromkeys(("loss", "hidden", "weight"), 1e-5), "bf16": BF16_TOLS}
# (hidden dtype, weight dtype, under bf16 autocast); every case but fp32 computes in bf16
FLA_CASES = {"fp32": (torch.float32, torch.float32, False),
             "bf16": (torch.bfloat16, torch.bfloat16, False),  # FSDP2's bf16 parameters
             "bf16-fp32weight": (torch.bfloat16, torch.float32, False),
             "autocast": (torch.float32, torch.float32, True)}  # one GPU: fp32 master weight


def fla_vs_reference(x: dict, case: str) -> tuple[dict, dict]:
    """fla on ``x`` in the case's dtypes (writing into NaN-poisoned buffers); the reference in
    fp32 on the same values (rounded to bf16 where the case computes in bf16)."""
    hidden_dtype, weight_dtype, autocast = FLA_CASES[case]
    x = x | {"hidden": x["hidden"].to(hidden_dtype), "weight": x["weight"].to(weight_dtype)}

    def fla(hidden, weight, targets):
        return (linear_cross_entropy(hidden, weight, targets, backend="fla"),)

    with nan_poisoned_empty(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        actual = with_grads(fla, x)
    assert actual["hidden"].dtype == hidden_dtype and actual["weight"].dtype == weight_dtype
    rounded = torch.float32 if case == "fp32" else torch.bfloat16
    expected = with_grads(reference, x | {n: x[n].to(rounded).float() for n in ("hidden", "weight")})
    return actual, expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(FLA_CASES))
# N: one token, and two counts that leave fla's last row chunk short (chunks of 128 and 1024)
@pytest.mark.parametrize("N", [1, 1000, 4099], ids=lambda n: f"N{n}")
# V: odd; above 65,536 fla's loss kernel splits the vocabulary into blocks (K3's 163,840 does)
@pytest.mark.parametrize("V", [5003, 70001], ids=lambda v: f"V{v}")
def test_fla_matches_reference(case, N, V):
    x = loss_inputs(N, V, 256, device="cuda")
    x["targets"][0] = 7  # N = 1 keeps a counted row
    actual, expected = fla_vs_reference(x, case)
    assert_all_close(actual, expected, FLA_TOLS["fp32" if case == "fp32" else "bf16"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["fp32", "bf16"])
def test_fla_all_targets_ignored_gives_zero(case):
    actual, _ = fla_vs_reference(loss_inputs(300, 5003, 256, device="cuda", ignore_every=1), case)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in actual.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_model_loss_on_gpu_takes_fla_and_matches_its_logits(monkeypatch):
    # the trainer's step: bf16 autocast, fp32 model; the loss must come from fla's kernel
    real_fla, hidden_dtypes = loss_ops._loss_fla, []

    def counting_fla(hidden, *args):
        hidden_dtypes.append(hidden.dtype)
        return real_fla(hidden, *args)

    monkeypatch.setattr(loss_ops, "_loss_fla", counting_fla)
    model, cfg = small_model()
    model.cuda()
    ids = torch.randint(0, cfg.vocab_size, (2, 300), device="cuda")
    labels = torch.randint(0, cfg.vocab_size, (2, 300), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, labels=labels).loss
        logits = model(ids).logits
    assert hidden_dtypes == [torch.bfloat16]
    expected = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-3, atol=0)
