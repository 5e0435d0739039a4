"""Whole-model properties: cache decoding, AttnRes wiring, router, MLA forms, parameter count."""

import pytest
import torch

import openk3.model.model as model_mod
from openk3 import build_model, preset
from openk3.model.cache import MLAState
from openk3.model.mla import MLAttention
from openk3.model.moe import Router
from openk3.params import count_parameters


def _randomise(model, seed=0):
    """Move away from the training init (zero queries, unit norms) so every path is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("proj.weight") and p.shape[0] == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model


@pytest.mark.parametrize("name", ["debug", "debug-kimi-linear"])
def test_token_by_token_decoding_reproduces_full_logits(name):
    cfg = preset("debug")
    if name == "debug-kimi-linear":
        cfg = cfg.replace(arch="kimi_linear", kda_gate_lower_bound=None, moe_latent_size=None,
                          attn_res_block_size=None, hidden_act="silu", routed_scaling_factor=2.446)
    model = _randomise(build_model(cfg)).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 29), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        for split in (1, 13):
            cache = model.new_cache()
            parts = [model(ids[:, :split], cache).logits]
            parts += [model(ids[:, t:t + 1], cache).logits for t in range(split, 20)]
            parts.append(model(ids[:, 20:], cache).logits)  # a chunk after decoding (chunked prefill)
            inc = torch.cat(parts, 1)
            assert {layer.length for layer in cache.layers if isinstance(layer, MLAState)} == {29}
            torch.testing.assert_close(inc, full, rtol=1e-4, atol=1e-4)


def test_mla_absorbed_decode_equals_expanded():
    cfg = preset("debug")
    mla = MLAttention(cfg)
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(3, 11, cfg.hidden_size)
    with torch.no_grad():
        full = mla(x)
        st = MLAState()
        mla(x[:, :10], st)
        assert st.latent.shape[-1] + st.k_rope.shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
        last = mla(x[:, 10:], st)
    torch.testing.assert_close(last, full[:, 10:], rtol=1e-5, atol=1e-5)


def test_router_bias_selects_but_does_not_weight():
    cfg = preset("debug")
    r = Router(cfg)
    with torch.no_grad():
        r.weight.normal_()
    x = torch.randn(5, cfg.hidden_size)
    scores, idx, w = r(x)
    r.e_score_correction_bias[3] = 10.0  # force expert 3 into every token's top-k
    scores2, idx2, w2 = r(x)
    assert torch.equal(scores, scores2)
    assert (idx2 == 3).any(-1).all()
    want = scores.gather(1, idx2)
    torch.testing.assert_close(w2, want / want.sum(-1, keepdim=True) * cfg.routed_scaling_factor)


def test_attn_res_block_sealing_matches_spec(monkeypatch):
    cfg = preset("debug").replace(num_hidden_layers=93, full_attn_layers=tuple(range(4, 93, 4)) + (93,),
                                  attn_res_block_size=12, hidden_size=16, vocab_size=64,
                                  num_experts=2, num_experts_per_token=1, moe_intermediate_size=8,
                                  moe_latent_size=8, intermediate_size=16, linear_num_heads=1,
                                  linear_head_dim=8, num_attention_heads=1, q_lora_rank=8,
                                  kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    model = build_model(cfg)
    counts = []
    real = model_mod.attn_res_agg
    monkeypatch.setattr(model_mod, "attn_res_agg", lambda s, *a: counts.append(len(s)) or real(s, *a))
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))
    sealed = 0
    want = []
    for i in range(93):
        if sealed:
            want.append(sealed + 1)  # attention read
        if i % 12 == 0:
            sealed += 1
        want.append(sealed + 1)  # MLP read
    want.append(sealed + 1)  # final read
    assert counts == want
    assert counts[-1] == 9  # embedding + 7 full blocks + the live partial sum


def test_backward_reaches_every_parameter():
    cfg = preset("debug")
    model = _randomise(build_model(cfg))
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    out = model(ids)
    torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten()).backward()
    no_grad = [n for n, p in model.named_parameters()
               if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert no_grad == []
    # layer 0 reads the bare embedding (the bank is empty), so its attention-input AttnRes
    # query is unused (frozen), though the checkpoint carries it
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["model.layers.0.self_attention_res.norm.weight",
                      "model.layers.0.self_attention_res.proj.weight"]


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_sealed_bank_gives_autograds_gradients(monkeypatch, checkpointed):
    """The bank's entries are sealed (their reads sum their gradients, ``openk3.ops.attnres``):
    every parameter's gradient is autograd's own sum's, also with recomputed layers."""
    from openk3.parallel.compile import checkpoint_layers

    cfg = preset("debug")
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))

    def grads():
        model = _randomise(build_model(cfg, seed=0))
        if checkpointed:
            checkpoint_layers(model)
        out = model(ids)
        torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten()).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    sealed = grads()
    monkeypatch.setattr(model_mod, "seal", lambda t: t)
    plain = grads()
    assert sealed.keys() == plain.keys()
    for name, g in plain.items():
        assert ((sealed[name] - g).norm() / g.norm()) < 1e-5, name


def test_autocast_bank_holds_one_dtype(monkeypatch):
    """Under autocast (training: fp32 weights) the embedding enters the AttnRes bank in the
    autocast dtype, beside the layers' bf16 outputs: cast once, not at every read; the values
    every AttnRes read sees are the same (each read cast it to that dtype before). Layer 0,
    whose bank is empty, now normalises the bf16 embedding (as the transformers model does)."""
    cfg = preset("debug")
    model = _randomise(build_model(cfg))
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    seen = []
    real = model_mod.attn_res_agg
    monkeypatch.setattr(model_mod, "attn_res_agg", lambda s, *a: seen.append([t.dtype for t in s]) or real(s, *a))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, bank = model.model.hidden_and_blocks(ids)
    assert bank[0].dtype == torch.bfloat16
    torch.testing.assert_close(bank[0], model.model.embed_tokens(ids).bfloat16(), rtol=0, atol=0)
    assert seen and all(d == torch.bfloat16 for dtypes in seen for d in dtypes)
    with torch.no_grad():  # no autocast: the embedding keeps the weights' dtype
        assert model.model.hidden_and_blocks(ids)[1][0].dtype == torch.float32


def test_k3_parameter_count():
    """Exact totals, recomputed here from K3_SPEC §1-2 term by term (deleting any sub-module, or
    changing one size, changes them)."""
    d, V, L, n_mla = 7168, 163840, 93, 24
    HK, K, H = 96 * 128, 128, 96
    kda = 4 * d * HK + HK * d + 3 * HK * 4 + d * K + K * HK + d * H + H + HK + K
    mla = (d * 1536 + 1536 + 1536 * H * 192 + d * (512 + 64) + 512 + 512 * H * 256
           + d * H * 128 + H * 128 * d)
    E, k, latent, F = 896, 16, 3584, 3072
    routed = E * 3 * latent * F
    moe = E * d + d * latent + latent + latent * d + routed + 3 * d * 6144
    per_layer = 6 * d  # two norms and two AttnRes reads (norm weight + query each)
    total = (2 * V * d + 3 * d + L * per_layer + (L - n_mla) * kda + n_mla * mla
             + 3 * d * 33792 + (L - 1) * moe)
    active = total - (L - 1) * routed * (E - k) // E
    assert (total, active) == (2_779_484_393_568, 105_363_935_328)  # the text backbone
    # K3_SPEC §6: the MoonViT-V2 tower (27 blocks, width 1024, qkv 1536, MLP 4096, patch 14,
    # a [64, 64, 1024] position table, RMSNorms) and the projector (4096 -> 4096 -> 7168, RMSNorm)
    Dv = 1024
    tower = 27 * (Dv * 3 * 1536 + 1536 * Dv + 2 * Dv * 4096 + 2 * Dv) + Dv * 3 * 14 * 14 + 64 * 64 * Dv + Dv
    projector = 4096 * 4096 + 4096 * d + d
    r = count_parameters(preset("k3"))
    assert (r["breakdown"]["vision tower"], r["breakdown"]["vision projector"]) == (tower, projector)
    assert (r["total"], r["active"]) == (total + tower + projector, active + tower + projector)


def test_kimi_linear_48b_matches_released_checkpoint_size():
    # the released checkpoint holds 49,122,681,728 values, of which 26*256 are router biases (buffers)
    assert count_parameters(preset("kimi-linear-48b"))["total"] + 26 * 256 == 49_122_681_728


def test_layers_return_their_own_tensor_in_training():
    """With autograd every decoder layer returns a tensor that is not a view (FSDP2 warns about a
    view output: an in-place op on it would skip the pre-backward all-gather), and the MoE with
    a residual is the MoE plus the residual."""
    torch.manual_seed(0)
    cfg = preset("debug")
    model = _randomise(build_model(cfg))
    x = torch.randn(2, 5, cfg.hidden_size, requires_grad=True)
    bank = [torch.randn(2, 5, cfg.hidden_size)]
    for layer in model.model.layers:
        assert not layer(x, bank)._is_view(), layer.index
    moe = next(layer.mlp for layer in model.model.layers if cfg.is_moe_layer(layer.index))
    r = torch.randn(2, 5, cfg.hidden_size)
    with_residual = moe(x, residual=r.clone())
    assert not with_residual._is_view()
    torch.testing.assert_close(with_residual, moe(x) + r, rtol=1e-6, atol=1e-6)


def test_cast_model_keeps_the_fp32_tensors_values():
    """build_model(dtype=...) cast everything down, then routers and decay parameters back up:
    rounded to the low dtype. They keep their fp32 values; everything else is cast."""
    from openk3.model.model import _fp32_tensors

    cfg = preset("debug")
    want = build_model(cfg, seed=3)
    got = build_model(cfg, seed=3, dtype=torch.bfloat16)
    kept = {n for n, t in want.named_parameters() if any(getattr(m, a) is t for m, a in _fp32_tensors(want))}
    assert any(n.endswith(".gate.weight") for n in kept) and any(n.endswith("A_log") for n in kept)
    for (n, g), w in zip(got.state_dict().items(), want.state_dict().values()):
        if n in kept or n.endswith("e_score_correction_bias"):
            assert g.dtype == torch.float32 and torch.equal(g, w), n
        elif w.is_floating_point():
            assert g.dtype == torch.bfloat16 and torch.equal(g, w.to(torch.bfloat16)), n
