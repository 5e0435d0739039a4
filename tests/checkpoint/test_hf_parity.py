"""Parity with transformers' KimiLinearForCausalLM, the external reference for Kimi Linear."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

import openk3  # noqa: E402

CONFIGS = {
    "q_lora_null_4layers": dict(num_hidden_layers=4, q_lora_rank=None,
                                layer_types=["linear_attention"] * 3 + ["full_attention"],
                                num_local_experts=8, num_experts_per_tok=2),
    "q_lora_set_mla_first": dict(num_hidden_layers=3, q_lora_rank=24, num_local_experts=6,
                                 num_experts_per_tok=3,
                                 layer_types=["full_attention", "linear_attention", "full_attention"]),
    "dense_layers_in_the_middle": dict(num_hidden_layers=4, q_lora_rank=None, num_local_experts=8,
                                       num_experts_per_tok=2,
                                       layer_types=["linear_attention", "full_attention"] * 2,
                                       mlp_layer_types=["sparse", "dense", "sparse", "dense"]),
    "many_experts_top4": dict(num_hidden_layers=5, q_lora_rank=None, num_local_experts=16,
                              num_experts_per_tok=4,
                              layer_types=["linear_attention", "linear_attention", "full_attention",
                                           "linear_attention", "full_attention"]),
}


def _hf_model(overrides: dict, seed: int = 0) -> KimiLinearForCausalLM:
    torch.manual_seed(seed)
    kw = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
              v_head_dim=12, qk_nope_head_dim=16, linear_head_dim=16, linear_num_heads=3,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    model = KimiLinearForCausalLM(KimiLinearConfig(**kw)).float().eval()
    with torch.no_grad():  # random router bias, norms and decay so every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            if name.endswith("A_log"):
                p.copy_(torch.randn_like(p) * 0.5)
            if name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            if name.endswith("gate.weight"):
                p.normal_(0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    ref = _hf_model(CONFIGS[name])
    ref.save_pretrained(tmp_path)
    ours = openk3.load_pretrained(tmp_path, dtype=torch.float32)
    assert ours.cfg.arch == "kimi_linear"
    ids = torch.randint(3, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids).logits
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-4, f"relative error {rel:.2e}"


def test_greedy_continuation_matches_transformers(tmp_path):
    ref = _hf_model(CONFIGS["q_lora_set_mla_first"], seed=3)
    ref.save_pretrained(tmp_path)
    ours = openk3.load_pretrained(tmp_path, dtype=torch.float32)
    prompt = torch.tensor([[5, 17, 42, 8, 63, 9, 11]])
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, prompt.shape[1]:].tolist()
    from openk3.generate import generate
    got = generate(ours, prompt[0].tolist(), max_new_tokens=12, temperature=0.0)
    assert got == want


@pytest.mark.parametrize("name", ["q_lora_null_4layers", "dense_layers_in_the_middle"])
def test_save_roundtrip_is_exact_and_readable_by_transformers(tmp_path, name):
    ref = _hf_model(CONFIGS[name])
    ref.save_pretrained(tmp_path / "hf")
    ours = openk3.load_pretrained(tmp_path / "hf", dtype=torch.float32)
    openk3.save_pretrained(ours, tmp_path / "ours")
    again = openk3.load_pretrained(tmp_path / "ours", dtype=torch.float32)
    for (n, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    back = KimiLinearForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids = torch.randint(3, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, rtol=0, atol=0)
