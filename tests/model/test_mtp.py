"""Multi-token prediction: the MTP layer against the formula written out here, causality, its
loss, gradients into the MTP layer and the shared embedding and head, the config field, the
parameter count and the optimiser grouping."""

import pytest
import torch
import torch.nn.functional as F

from openk3 import build_model, preset
from openk3.ops.loss import IGNORE_INDEX
from openk3.params import count_parameters
from openk3.train.optim import build_optimizers, head_slices

TINY = {"num_hidden_layers": 2, "full_attn_layers": (2,), "hidden_size": 64, "linear_head_dim": 16,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16,
        "q_lora_rank": 32, "intermediate_size": 96, "moe_intermediate_size": 32,
        "moe_latent_size": 48, "attn_res_block_size": 2, "vocab_size": 300}


def _mtp_model(seed: int = 0):
    model = build_model(preset("debug").replace(num_nextn_predict_layers=1, **TINY), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from unit norms so that a swapped norm weight shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _batch(seed: int = 1, T: int = 13):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (2, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, min(4, T - 1)] = IGNORE_INDEX  # an ignored target: neither loss counts it
    return ids[:, :-1], labels


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_mtp_hidden(model, ids):
    """shared_head.norm(h') at every position t, from h_t and embed(x_{t+1}), written out:
    u = eh_proj(cat(enorm(e), hnorm(h))); a = u + attn(ln1(u)); h' = a + moe(ln2(a))."""
    mtp, eps = model.mtp[0], model.cfg.rms_norm_eps
    h = model.model(ids)  # the main model's final (normed) hidden states
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
    e = model.model.embed_tokens.weight[nxt]
    u = torch.cat([_rms(e, mtp.enorm.weight, eps), _rms(h, mtp.hnorm.weight, eps)], -1) @ mtp.eh_proj.weight.T
    a = u + mtp.self_attn(_rms(u, mtp.input_layernorm.weight, eps))
    out = a + mtp.mlp(_rms(a, mtp.post_attention_layernorm.weight, eps))
    return _rms(out, mtp.shared_head.norm.weight, eps)


def _reference_losses(model, ids, labels):
    """(main loss, MTP loss) from full logits: the MTP head is lm_head, its target at t is
    labels[t + 1], the last position has none."""
    logits = model(ids).logits
    main = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    mtp_logits = _reference_mtp_hidden(model, ids) @ model.lm_head.weight.T
    mtp = F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                          ignore_index=IGNORE_INDEX)
    return main, mtp


def test_mtp_loss_matches_the_formula():
    model = _mtp_model().eval()
    ids, labels = _batch()
    with torch.no_grad():
        out = model(ids, labels=labels)
        main, mtp = _reference_losses(model, ids, labels)
    torch.testing.assert_close(out.loss, main, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.mtp_loss, mtp, rtol=1e-5, atol=1e-6)
    assert model(ids).logits is not None and model(ids).mtp_loss is None  # no labels: no MTP


def test_mtp_layer_is_causal_and_reads_the_next_token():
    """Position t depends on tokens up to t+1 only: changing the last token changes positions
    T-2 and T-1 (T-1 reads it as the placeholder x_{t+1}), nothing before."""
    model = _mtp_model().eval()
    ids, _ = _batch()
    other = ids.clone()
    other[:, -1] = (other[:, -1] + 1) % 300
    with torch.no_grad():
        a, b = _reference_mtp_hidden(model, ids), _reference_mtp_hidden(model, other)
        h = model.model(ids)
        mtp_out = model.mtp[0](h, model.model.embed_tokens(torch.cat([ids[:, 1:], ids[:, -1:]], 1)))
    torch.testing.assert_close(mtp_out, a, rtol=1e-5, atol=1e-6)  # the module is the formula
    # (not bit for bit: the experts' matmuls group other token sets)
    torch.testing.assert_close(a[:, :-2], b[:, :-2], rtol=1e-5, atol=1e-6)
    assert (a[:, -2] - b[:, -2]).abs().max() > 1e-2


def test_gradient_reaches_the_mtp_layer_and_the_shared_embedding_and_head():
    model = _mtp_model().train()
    ids, labels = _batch()
    model(ids, labels=labels).mtp_loss.backward()  # the MTP loss alone
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or name in ("lm_head.weight", "model.embed_tokens.weight"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    # through h_t the MTP loss trains the main model too (DeepSeek-V3)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_mtp_gradients_match_the_reference():
    model = _mtp_model().train()
    ids, labels = _batch()
    out = model(ids, labels=labels)
    (out.loss + 0.3 * out.mtp_loss).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    main, mtp = _reference_losses(model, ids, labels)
    (main + 0.3 * mtp).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n, grad in want.items():
        torch.testing.assert_close(got[n], grad, rtol=1e-4, atol=1e-6, msg=n)


def test_one_token_sequences_have_no_mtp_target():
    model = _mtp_model().eval()
    ids, labels = _batch(T=1)
    with torch.no_grad():
        assert model(ids, labels=labels).mtp_loss.item() == 0.0  # every target ignored


@pytest.mark.parametrize("n,msg", [(2, "must be 0 or 1"), (-1, "must be 0 or 1")])
def test_num_nextn_predict_layers_is_validated(n, msg):
    with pytest.raises(ValueError, match=f"ModelConfig.num_nextn_predict_layers={n}: {msg}"):
        preset("debug").replace(num_nextn_predict_layers=n)


def test_without_mtp_the_model_has_no_mtp_parameters():
    model = build_model(preset("debug").replace(**TINY), device="meta")
    assert not any(n.startswith("mtp") for n in model.state_dict())


def test_parameter_count_adds_the_mtp_layer_apart():
    cfg = preset("debug").replace(**TINY)
    base, with_mtp = count_parameters(cfg), count_parameters(cfg.replace(num_nextn_predict_layers=1))
    layer = build_model(cfg.replace(num_nextn_predict_layers=1), device="meta").mtp[0]
    experts = sum(p.numel() for n, p in layer.named_parameters() if n.startswith("mlp.experts."))
    assert with_mtp["total"] - base["total"] == sum(p.numel() for p in layer.parameters())
    assert with_mtp["breakdown"]["MTP routed experts"] == experts
    assert with_mtp["active"] - base["active"] == (
        with_mtp["breakdown"]["MTP"] + experts * cfg.num_experts_per_token // cfg.num_experts)


def test_optimiser_groups_take_the_mtp_layer():
    """Matrices (eh_proj, the MLA block, per head, the experts) go to Muon, norms to AdamW;
    the shared head and embedding stay where they were (AdamW, once)."""
    model = _mtp_model()
    muon, adamw = build_optimizers(model, lr=1e-3, weight_decay=0.1)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    mtp = model.mtp[0]
    for name, p in mtp.named_parameters():
        want = in_adamw if p.dim() < 2 or name == "mlp.gate.weight" else in_muon
        assert id(p) in want, name
    assert mtp.self_attn.o_proj.weight in head_slices(model)
    assert id(model.lm_head.weight) in in_adamw and id(model.model.embed_tokens.weight) in in_adamw
