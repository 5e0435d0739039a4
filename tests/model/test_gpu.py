"""Fast paths against references on CUDA (run on the device; skipped on CPU CI)."""

import pytest
import torch

from openk3 import build_model, preset
from openk3.model.moe import RoutedExperts, run_experts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_grouped_mm_experts_match_loop(monkeypatch):
    cfg = preset("debug").replace(num_experts=16, moe_intermediate_size=128)
    ex = RoutedExperts(cfg, 256).cuda().bfloat16()
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.05)
    x = torch.randn(999, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx = torch.randint(0, 16, (999, 2), device="cuda")
    idx[:, 1] = (idx[:, 0] + 1) % 16
    idx[:500, 0] = 3  # skewed routing, and expert 7 gets nothing below
    idx[idx == 7] = 8
    w = torch.rand(999, 2, device="cuda")
    fast = ex(x, idx, w)
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    xs = x[order // 2]
    counts = torch.bincount(flat, minlength=16)
    def looped(xs):
        monkeypatch.setenv("OPENK3_REFERENCE", "1")
        try:
            return run_experts(cfg, ex.w1, ex.w3, ex.w2, xs, counts)
        finally:
            monkeypatch.setenv("OPENK3_REFERENCE", "0")

    grouped = run_experts(cfg, ex.w1, ex.w3, ex.w2, xs, counts)
    torch.testing.assert_close(grouped, looped(xs), rtol=2e-2, atol=2e-2)
    g = torch.randn_like(fast)
    (gx_fast,) = torch.autograd.grad(fast, x, g)
    ref = torch.zeros_like(fast).index_add_(0, order // 2, looped(xs).float()
                                            * w.reshape(-1)[order].unsqueeze(-1))
    (gx_ref,) = torch.autograd.grad(ref, x, g)
    assert rel(fast, ref) < 1e-2 and rel(gx_fast, gx_ref) < 1e-2


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_model_fast_path_matches_reference_and_decodes(arch, monkeypatch):
    """bf16 fast path (full sequence, and prefill + token-by-token decode) against the fp32
    reference: no worse than twice the bf16 *reference* path's own error, plus a little for
    the different summation orders of the fused kernels."""
    # dense MLPs only: with MoE, bf16 rounding differences flip top-k choices, a discontinuity
    # that says nothing about the paths compared here (the experts have their own test above)
    cfg = preset("debug").replace(linear_head_dim=64, hidden_size=256, dense_mlp_layers=tuple(range(1, 9)))
    if arch == "kimi_linear":
        cfg = cfg.replace(arch="kimi_linear", kda_gate_lower_bound=None, moe_latent_size=None,
                          attn_res_block_size=None, hidden_act="silu", routed_scaling_factor=2.446)
    model32 = build_model(cfg, device="cuda").eval()
    with torch.no_grad():
        for n, p in model32.named_parameters():
            if n.endswith("_res.proj.weight"):
                p.normal_(0, 0.05)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16).eval()
    model.load_state_dict(model32.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 300), device="cuda")
    with torch.no_grad():
        monkeypatch.setenv("OPENK3_REFERENCE", "1")
        exact = model32(ids).logits
        ref = model(ids).logits
        monkeypatch.setenv("OPENK3_REFERENCE", "0")
        fast = model(ids).logits
        cache = model.new_cache()
        parts = [model(ids[:, :250], cache).logits]
        parts += [model(ids[:, t:t + 1], cache).logits for t in range(250, 300)]
        decoded = torch.cat(parts, 1)
    base = rel(ref, exact)
    errors = {"bf16 reference": base, "fast": rel(fast, exact), "decode": rel(decoded, exact)}
    assert 0 < base < 0.1, errors  # bf16 logits of this random model: ~3e-2 on CPU
    assert errors["fast"] <= 2 * base + 2e-3 and errors["decode"] <= 2 * base + 2e-3, errors


def test_mtp_loss_fast_path_matches_reference(monkeypatch):
    """The MTP loss on CUDA (fla's fused linear cross-entropy through the shared lm_head, fla's
    KDA and AttnRes kernels underneath) against the reference path, loss and gradients, fp32."""
    cfg = preset("debug").replace(num_nextn_predict_layers=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 129), device="cuda")
    inputs, labels = ids[:, :-1], ids[:, 1:]
    results = []
    for reference in ("1", "0"):
        monkeypatch.setenv("OPENK3_REFERENCE", reference)
        model = build_model(cfg, device="cuda", seed=0).train()
        out = model(inputs, labels=labels)
        (out.loss + 0.3 * out.mtp_loss).backward()
        results.append((out.loss.detach(), out.mtp_loss.detach(), model.mtp[0].eh_proj.weight.grad,
                        model.lm_head.weight.grad))
    for fast, ref in zip(results[1], results[0]):
        assert rel(fast, ref) < 1e-2
