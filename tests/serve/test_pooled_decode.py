"""The serving decode step of a KDA layer with its states updated in place in the pool
(``KDAttention._pooled_decode`` through ``PagedKDAView.decode_pools``) against the same layer
on the gathered states (the generate path's ``KDAState``): the same outputs and the same new
states, exactly, on the CPU's reference ops; other rows of the pool untouched."""

import pytest
import torch

import openk3.model.kda as kda_mod
from openk3 import build_model, preset
from openk3.model.cache import KDAState
from openk3.model.fuse import fuse_projections
from openk3.serve.paged_views import KDAPool, PagedKDAView


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_pooled_decode_equals_the_gathered_step(arch, monkeypatch):
    cfg = preset("debug")
    if arch == "kimi_linear":
        cfg = cfg.replace(arch="kimi_linear", kda_gate_lower_bound=None, moe_latent_size=None,
                          attn_res_block_size=None, hidden_act="silu")
    model = fuse_projections(build_model(cfg, seed=0).eval().requires_grad_(False))
    layer = next(m for m in model.modules() if isinstance(m, kda_mod.KDAttention))
    calls = []
    for name in ("causal_conv1d_update_", "kda_decode_"):
        op = getattr(kda_mod, name)
        monkeypatch.setattr(kda_mod, name, lambda *a, _op=op, _name=name, **k: calls.append(_name) or _op(*a, **k))
    torch.manual_seed(1)
    pool = KDAPool(cfg, num_layers=1, n=6, device="cpu", dtype=torch.float32)
    for t in pool.tensors():
        t.normal_()
    slots = torch.tensor([4, 0, 2])
    start = [t.clone() for t in pool.tensors()]
    x = torch.randn(3, 1, cfg.hidden_size)
    state = KDAState(recurrent=pool.recurrent[0, slots].clone(), conv_q=pool.conv_q[0, slots].clone(),
                     conv_k=pool.conv_k[0, slots].clone(), conv_v=pool.conv_v[0, slots].clone())
    with torch.no_grad():
        want = layer(x, state)
        got = layer(x, PagedKDAView(pool, 0, slots, None, None))
    assert calls == ["causal_conv1d_update_", "kda_decode_"]  # the in-place path ran
    assert torch.equal(got, want)
    assert torch.equal(pool.recurrent[0, slots], state.recurrent)
    assert torch.equal(pool.conv_qkv[0, slots], state.conv_qkv)
    others = torch.tensor([1, 3, 5])
    for t, s in zip(pool.tensors(), start):
        assert torch.equal(t[0, others], s[0, others])


def test_a_packed_prefill_view_has_no_decode_pools():
    pool = KDAPool(preset("debug"), num_layers=2, n=3, device="cpu", dtype=torch.float32)
    cu = torch.tensor([0, 2, 5])
    assert PagedKDAView(pool, 1, torch.tensor([0, 2]), cu, cu).decode_pools() is None
    rec, conv, slots = PagedKDAView(pool, 1, torch.tensor([2]), None, None).decode_pools()
    assert rec.data_ptr() == pool.recurrent[1].data_ptr() and conv.data_ptr() == pool.conv_qkv[1].data_ptr()
    assert conv.is_contiguous() and rec.is_contiguous()
