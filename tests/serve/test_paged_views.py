"""The engine's views of its paged cache against the generate path's ``MLAState``: a decode batch
through ``paged_mla_decode`` (absorbed form) and packed prefill chunks through one varlen
attention (expanded form), for sequences scattered over shuffled blocks among garbage rows,
give what the MLA layer gives attending over each sequence on its own (the former gather path)."""

from __future__ import annotations

import pytest
import torch

from openk3 import preset
from openk3.model.cache import MLAState
from openk3.model.mla import MLAttention
from openk3.serve.paged_views import DecodeBatch, PagedMLAView, PrefillBatch, prefix_kv_weight

BLOCK = 4
NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    mla = MLAttention(preset("debug")).eval()
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(0, 0.2)
    return mla


def rows(table: list[int], start: int, end: int) -> torch.Tensor:
    """Cache rows of positions [start, end) of a sequence with this block table."""
    return torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)], dtype=torch.long)


def setup(layer, pasts: list[int], width: int):
    """Per sequence: its past latents (an MLAState) and a block table of shuffled blocks; the
    cache is random garbage except where the pasts are written."""
    cfg = layer.cfg
    cache = torch.randn(NUM_BLOCKS * BLOCK, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    blocks = torch.randperm(NUM_BLOCKS).tolist()
    tables, states = [], []
    for past in pasts:
        tables.append([blocks.pop() for _ in range(width)])
        state = MLAState()
        if past:
            with torch.no_grad():
                layer(torch.randn(1, past, cfg.hidden_size), state)
            cache[rows(tables[-1], 0, past)] = torch.cat([state.latent[0], state.k_rope[0]], dim=-1)
        states.append(state)
    return cache, tables, states


@torch.no_grad()
def test_decode_view_equals_attending_over_each_sequence(layer):
    pasts = [5, 1, 12, 7]  # within a block, at its edge, over several blocks
    cache, tables, states = setup(layer, pasts, width=4)
    x = torch.randn(len(pasts), 1, layer.cfg.hidden_size)
    want = torch.cat([layer(x[b:b + 1], st) for b, st in enumerate(states)])
    batch = DecodeBatch(torch.cat([rows(t, p, p + 1) for t, p in zip(tables, pasts)]),
                        torch.tensor(tables, dtype=torch.int32), torch.tensor(pasts) + 1, BLOCK)
    got = layer(x, PagedMLAView(cache, batch))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_packed_prefill_view_equals_attending_over_each_sequence(layer):
    chunks = [(0, 5), (7, 3), (2, 9), (4, 1)]  # (cached past, new tokens)
    cache, tables, states = setup(layer, [past for past, _ in chunks], width=4)
    xs = [torch.randn(1, n, layer.cfg.hidden_size) for _, n in chunks]
    want = torch.cat([layer(x, st) for x, st in zip(xs, states)], dim=1)
    cu_q = torch.tensor([0] + [n for _, n in chunks]).cumsum(0)
    cu_k = torch.tensor([0] + [past + n for past, n in chunks]).cumsum(0)
    batch = PrefillBatch(torch.cat([rows(t, past, past + n) for t, (past, n) in zip(tables, chunks)]),
                         torch.cat([rows(t, 0, past + n) for t, (past, n) in zip(tables, chunks)]),
                         cu_q, cu_k, cu_q, cu_k)
    got = layer(torch.cat(xs, dim=1), PagedMLAView(cache, batch))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_verify_segments_through_the_decode_view(layer):
    """T = 3 queries per sequence (a speculative verify step): query j of a sequence reads its
    past and the segment up to itself, as the layer attending over the whole segment does."""
    pasts, T = [5, 1, 9], 3
    cache, tables, states = setup(layer, pasts, width=4)
    x = torch.randn(len(pasts), T, layer.cfg.hidden_size)
    want = torch.cat([layer(x[b:b + 1], st) for b, st in enumerate(states)])
    batch = DecodeBatch(torch.cat([rows(t, p, p + T) for t, p in zip(tables, pasts)]),
                        torch.tensor(tables, dtype=torch.int32).repeat_interleave(T, 0),
                        (torch.tensor(pasts)[:, None] + torch.arange(1, T + 1)).flatten(), BLOCK)
    got = layer(x, PagedMLAView(cache, batch))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_prefix_kv_weight_gives_keys_and_values_and_follows_the_weight(layer):
    """One GEMM over cache rows [c | k_r] with the widened weight: each head's [k_nope | k_r]
    and value, as kv_b_proj and a broadcast of k_r give them; an in-place change of kv_b_proj's
    weight (a weight update) rebuilds it."""
    H, nope, rope, v_dim, R = layer.num_heads, layer.nope, layer.rope, layer.v_dim, layer.rank
    ctx = torch.randn(11, R + rope)

    def want():
        c, k_r = ctx.split([R, rope], dim=-1)
        k_nope, v = layer.kv_b_proj(c).view(11, H, nope + v_dim).split([nope, v_dim], dim=-1)
        return torch.cat([k_nope, k_r[:, None].expand(11, H, rope), v], dim=-1)

    got = torch.nn.functional.linear(ctx, prefix_kv_weight(layer)).view(11, H, -1)
    torch.testing.assert_close(got, want(), rtol=1e-6, atol=1e-6)
    before = layer.kv_b_proj.weight.clone()
    layer.kv_b_proj.weight.mul_(-2)
    try:
        got = torch.nn.functional.linear(ctx, prefix_kv_weight(layer)).view(11, H, -1)
        torch.testing.assert_close(got, want(), rtol=1e-6, atol=1e-6)
    finally:
        layer.kv_b_proj.weight.copy_(before)
