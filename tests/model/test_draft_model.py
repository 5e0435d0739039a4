"""The EAGLE-3 draft: the fused depths, the fusion's initialisation, the forward against the formula
written out here, ``--init mtp`` reproducing the MTP layer, the training-time-test unroll against
running the draft on each chain by itself, and the draft directory round trip."""

import json

import pytest
import torch
import torch.nn.functional as F

from openk3 import build_model, preset
from openk3.checkpoint.draft import load_draft, save_draft
from openk3.model.draft import (DraftConfig, Eagle3Draft, default_fused_blocks, draft_unroll,
                                shift_tokens, target_fingerprint)
from tests.model.test_mtp import TINY, _batch, _mtp_model, _rms

# 4 layers in blocks of 1: bank = [embedding, block 1, block 2, block 3], n = 4 -> fused (1, 2)
DEEP = {**TINY, "num_hidden_layers": 4, "full_attn_layers": (2, 4), "attn_res_block_size": 1}


def _target(seed: int = 0, **changes):
    return build_model(preset("debug").replace(**{**DEEP, **changes}), seed=seed).eval()


def _draft(target, seed: int = 0, perturb: bool = True) -> Eagle3Draft:
    draft = Eagle3Draft(DraftConfig.for_target(target.cfg, "target"))
    draft.init_weights(seed)
    if perturb:  # away from the init, so that a swapped weight or a wrong source shows
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_((0.3 if p.dim() == 1 else 0.02) * torch.randn(p.shape, generator=g))
    return draft


def test_fused_blocks_rule():
    assert default_fused_blocks(preset("k3")) == (1, 4)      # 93 layers, blocks of 12: n = 8
    assert default_fused_blocks(preset("small")) == (1, 2)   # 24 / 6: n = 4
    assert default_fused_blocks(preset("debug")) == (1, 1)   # 8 / 4: n = 2, one sealed block
    assert default_fused_blocks(preset("debug").replace(**TINY)) == (0, 0)  # one block: the embedding
    assert default_fused_blocks(preset("debug").replace(**DEEP)) == (1, 2)
    with pytest.raises(ValueError, match="attn_res_block_size=None"):
        default_fused_blocks(preset("kimi-linear-48b"))


def test_fusion_init_picks_the_final_hidden_state_exactly():
    target = _target()
    draft = _draft(target, perturb=False)
    ids, _ = _batch()
    hidden, bank = target.model.hidden_and_blocks(ids)
    assert len(bank) == 4 and torch.equal(hidden, target.model(ids))
    d = DEEP["hidden_size"]
    torch.testing.assert_close(draft.fc.weight, torch.cat([torch.zeros(d, 2 * d), torch.eye(d)], 1),
                               rtol=0, atol=0)
    assert torch.equal(draft.fuse(hidden, bank), hidden)


def test_bank_holds_the_block_outputs():
    """bank[k] is the running sum after block k: with blocks of one layer, layer k - 1's output."""
    target = _target()
    ids, _ = _batch()
    outputs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outputs.append(o)) for layer in target.model.layers]
    _, bank = target.model.hidden_and_blocks(ids)
    for h in hooks:
        h.remove()
    assert torch.equal(bank[0], target.model.embed_tokens(ids))
    for k in (1, 2, 3):  # layer k's attention output replaces p, so the sealed p is layer k-1's output
        assert torch.equal(bank[k], outputs[k - 1])


def test_draft_step_matches_the_formula():
    """g = shared_head.norm(a + moe(ln2(a))), a = u + attn(ln1(u)),
    u = eh_proj(cat(enorm(embed(x_{t+1})), hnorm(fc(cat(bank[1], bank[2], h)))))."""
    target = _target()
    draft = _draft(target)
    ids, _ = _batch()
    hidden, bank = target.model.hidden_and_blocks(ids)
    layer, eps = draft.layer, target.cfg.rms_norm_eps
    f = torch.cat([bank[1], bank[2], hidden], -1) @ draft.fc.weight.T
    e = target.model.embed_tokens.weight[torch.cat([ids[:, 1:], ids[:, -1:]], 1)]
    u = torch.cat([_rms(e, layer.enorm.weight, eps), _rms(f, layer.hnorm.weight, eps)], -1) @ layer.eh_proj.weight.T
    a = u + layer.self_attn(_rms(u, layer.input_layernorm.weight, eps))
    want = _rms(a + layer.mlp(_rms(a, layer.post_attention_layernorm.weight, eps)), layer.shared_head.norm.weight, eps)
    got = draft_unroll(draft, draft.fuse(hidden, bank), target.model.embed_tokens, ids, 1)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_init_mtp_reproduces_the_mtp_layer():
    """MTP input h_t (final hidden after norm) = fc([bank[lo] | bank[mid] | h]) with fc = [0|0|I];
    the MTP weights copied unchanged: the draft's first-step logits are the MTP layer's, bit for
    bit, and their cross-entropy is the target's own mtp_loss."""
    target = _mtp_model()
    draft = _draft(target)  # perturbed: from_mtp must overwrite everything
    draft.from_mtp(target.mtp[0])
    for name, p in target.mtp[0].state_dict().items():
        assert torch.equal(draft.layer.state_dict()[name], p), name
    ids, labels = _batch()
    hidden, bank = target.model.hidden_and_blocks(ids)
    g = draft_unroll(draft, draft.fuse(hidden, bank), target.model.embed_tokens, ids, 1)[0]
    mtp = target.mtp[0](hidden, target.model.embed_tokens(shift_tokens(ids, 1)))
    assert torch.equal(target.lm_head(g), target.lm_head(mtp))
    next_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    ce = F.cross_entropy(target.lm_head(g).flatten(0, 1), next_labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(ce, target(ids, labels=labels).mtp_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("steps", [2, 3])
def test_unroll_equals_running_each_chain_alone(steps):
    """Step i at position t is the draft run causally over its own chain: the target's fused
    states at positions 0..t, then its own outputs g0_t, ..., g(i-1)_t with the tokens
    x_{t+2}, ..., x_{t+i+1}, which is how the draft runs when serving. Written for S = 2 and 3."""
    target = _target()
    draft = _draft(target)
    ids, _ = _batch(T=9)
    embed = target.model.embed_tokens
    hidden, bank = target.model.hidden_and_blocks(ids)
    f = draft.fuse(hidden, bank)
    outs = draft_unroll(draft, f, embed, ids, steps)
    T = ids.shape[1]
    assert torch.equal(outs[0], draft(f, embed(shift_tokens(ids, 1))))  # step 0: plain causal
    for i in range(1, steps):
        for t in range(T - 1 - i):  # the counted positions
            states = torch.cat([f[:, :t + 1]] + [outs[j][:, t:t + 1] for j in range(i)], 1)
            tokens = torch.cat([ids[:, 1:t + 2], ids[:, t + 2:t + i + 2]], 1)  # x_1..x_{t+1}, x_{t+2}..x_{t+i+1}
            alone = draft(states, embed(tokens))[:, -1]
            torch.testing.assert_close(outs[i][:, t], alone, rtol=1e-5, atol=1e-5)


def test_unroll_feeds_the_drafts_own_state():
    """Changing the target's fused state at position t alone changes step 1 at t only through
    step 0's output: step 1 never reads f_t, f_{t'} of later positions, or other chains' drafts."""
    target = _target()
    draft = _draft(target)
    ids, _ = _batch(T=9)
    hidden, bank = target.model.hidden_and_blocks(ids)
    f = draft.fuse(hidden, bank)
    outs = draft_unroll(draft, f, target.model.embed_tokens, ids, 2)
    f2 = f.clone()
    f2[:, 5] += 1.0
    outs2 = draft_unroll(draft, f2, target.model.embed_tokens, ids, 2)
    for i in range(2):
        # causal: earlier chains unchanged, up to fp32 rounding: position 5's new routing changes
        # how many rows each expert's matmul has, and on some CPUs (seen 2026-12-01) the BLAS
        # blocking for another row count rounds the other rows differently in the last bit
        torch.testing.assert_close(outs[i][:, :5], outs2[i][:, :5], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(outs[i][:, 5], outs2[i][:, 5])


def test_draft_directory_round_trip_and_refusals(tmp_path):
    target = _target()
    draft = _draft(target)
    save_draft(draft, tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["fused_blocks"] == [1, 2] and config["hidden_size"] == DEEP["hidden_size"]
    assert config["target_fingerprint"] == target_fingerprint(target.cfg)
    assert config["ttt_steps"] == 3 and config["loss"] == "lk"
    loaded = load_draft(tmp_path / "draft", target)
    for name, p in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
    assert not any(n.startswith(("embed", "lm_head")) for n in loaded.state_dict())
    # an MTP layer does not change the fingerprint: the same target trained with one still fits
    assert target_fingerprint(target.cfg.replace(num_nextn_predict_layers=1)) == target_fingerprint(target.cfg)
    # nor does a vision tower: a K3 target loaded with it or text-only was two targets
    assert target_fingerprint(preset("debug-vl")) == target_fingerprint(preset("debug-vl").replace(vision_config=None))
    other = _target(hidden_size=96)
    with pytest.raises(ValueError, match="trained for another target.*hidden_size 96"):
        load_draft(tmp_path / "draft", other)
    with pytest.raises(ValueError, match="has no config.json"):
        load_draft(tmp_path, target)
    weights = tmp_path / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])  # was safetensors' own error
    with pytest.raises(ValueError, match="model.safetensors: cannot read the draft's weights"):
        load_draft(tmp_path / "draft", target)
    weights.unlink()
    with pytest.raises(ValueError, match="has no model.safetensors"):
        load_draft(tmp_path / "draft", target)
