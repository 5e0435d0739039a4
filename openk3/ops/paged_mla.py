"""Paged MLA decode attention: one query token per row over that row's latent cache, read
through a block table (K3_SPEC §1.3, absorbed form; FlashMLA's interface).

The cache holds one ``R + P``-wide row per token (R = ``kv_lora_rank`` latent, P =
``qk_rope_head_dim`` shared key part); token ``t`` of row ``b`` sits at cache row
``block_table[b, t // block_size] * block_size + t % block_size``. Every head attends over the
same rows (multi-query attention with head dim R + P, values = the R-wide latent):

    scores[b, h, t] = scale * (q_lat[b, h] . c[b, t] + q_rope[b, h] . k_r[b, t]),  t < context_lens[b]
    out[b, h]       = softmax_t(scores[b, h]) @ c[b]                                [B, H, R]

Optionally a row reads only positions ``first_pos[b] <= t < context_lens[b]`` (the EAGLE-3 draft
attends from where its cache of a sequence starts, ``openk3/serve/eagle.py``). Several query
rows may share one cache row's blocks: a speculative verify step gives each of a sequence's
``K + 1`` positions its own row, whose context ends at that position (the causal mask).

* ``paged_mla_decode_ref``: plain PyTorch, the reference: gathers the table's blocks, masks past
  ``context_lens`` (the serving engine's former gather path).
* ``paged_mla_decode``: the entry point. On CUDA (bf16, fp16 or fp32) a Triton kernel reads only
  the blocks each row uses: one program per (row, tile of 16 heads, split of the context), an
  online softmax over tiles of tokens, and the splits merged by their log-sum-exp (flash
  decoding) in a second kernel (``merge_splits_ref`` is its reference). The number of splits
  depends only on the batch size and the GPU, never on the context, so a CUDA graph captured
  for one batch size serves every context length.
"""

from __future__ import annotations

import functools

import torch

from openk3.ops.fast import use_fast_path

BLOCK_H = 16  # heads per program: tl.dot needs 16 rows; they share every cache row loaded
MAX_SPLITS = 128


def paged_mla_decode_ref(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                         block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                         scale: float, first_pos: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: gathers ``block_table``'s whole width (pass only the columns in use)."""
    B, W = block_table.shape
    R = q_lat.shape[-1]
    pos = torch.arange(W * block_size, device=cache.device)
    rows = block_table[:, pos // block_size].long() * block_size + pos % block_size  # [B, L]
    ctx = cache[rows]  # [B, L, R + P]
    c, k_r = ctx[..., :R], ctx[..., R:]
    scores = (torch.einsum("bhc,btc->bht", q_lat, c)
              + torch.einsum("bhr,btr->bht", q_rope, k_r)).float() * scale
    outside = pos[None, :] >= context_lens[:, None]  # [B, L]
    if first_pos is not None:
        outside |= pos[None, :] < first_pos[:, None]
    scores = scores.masked_fill(outside[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(c.dtype)
    return torch.einsum("bht,btc->bhc", p, c)


def _validate(q_lat, q_rope, cache, block_table, context_lens, block_size, first_pos) -> None:
    if q_lat.dim() != 3 or q_rope.dim() != 3 or q_lat.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"`q_lat` [B, H, R] and `q_rope` [B, H, P] must agree, got "
                         f"{list(q_lat.shape)} and {list(q_rope.shape)}")
    B, H, R = q_lat.shape
    P = q_rope.shape[-1]
    if cache.dim() != 2 or cache.shape[1] != R + P:
        raise ValueError(f"`cache` must be [rows, R + P] = [rows, {R + P}], got {list(cache.shape)}")
    if q_lat.dtype != cache.dtype or q_rope.dtype != cache.dtype:
        raise ValueError(f"`q_lat`, `q_rope` and `cache` must share a dtype, got "
                         f"{q_lat.dtype}, {q_rope.dtype}, {cache.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"`block_table` must be [B, max_blocks] with B = {B}, got {list(block_table.shape)}")
    if context_lens.shape != (B,):
        raise ValueError(f"`context_lens` must be [B] = [{B}], got {list(context_lens.shape)}")
    if first_pos is not None and (first_pos.shape != (B,) or first_pos.dtype != context_lens.dtype):
        raise ValueError(f"`first_pos` must be [B] = [{B}] of context_lens' dtype {context_lens.dtype}, "
                         f"got {first_pos.dtype} {list(first_pos.shape)}")
    if block_size <= 0:
        raise ValueError(f"`block_size` must be positive, got {block_size}")
    for name, t in (("q_rope", q_rope), ("cache", cache), ("block_table", block_table),
                    ("context_lens", context_lens), ("first_pos", first_pos)):
        if t is not None and t.device != q_lat.device:
            raise ValueError(f"`{name}` is on {t.device}, q_lat on {q_lat.device}")


def paged_mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                     block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                     scale: float, first_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of one token per row over its paged latent cache.

    Args:
        q_lat: [B, H, R] the query with ``kv_b_proj``'s key half absorbed.
        q_rope: [B, H, P] the query's shared-key part.
        cache: [rows, R + P] latent cache (same dtype as the queries).
        block_table: [B, max_blocks] int32 physical block ids; only the first
            ``cdiv(context_lens[b], block_size)`` of row b are read (the reference gathers all).
        context_lens: [B] int tokens per row, >= 1 (the row's new token included).
        block_size: tokens per block.
        scale: softmax scale.
        first_pos: [B] the first position each row reads (None: 0), below its context length;
            the blocks before it are not read.

    Returns:
        [B, H, R] the attention-weighted latent, in the queries' dtype.

    Example:
        >>> cache = torch.randn(4 * 8, 48)  # 4 blocks of 8 tokens, R = 32, P = 16
        >>> table = torch.tensor([[2, 0, 3], [1, 3, 3]], dtype=torch.int32)
        >>> out = paged_mla_decode(torch.randn(2, 2, 32), torch.randn(2, 2, 16), cache, table,
        ...                        torch.tensor([20, 5]), block_size=8, scale=48 ** -0.5)
        >>> out.shape
        torch.Size([2, 2, 32])
    """
    _validate(q_lat, q_rope, cache, block_table, context_lens, block_size, first_pos)
    if use_fast_path(q_lat):
        return _paged_mla_decode_triton(q_lat, q_rope, cache, block_table, context_lens, block_size, scale,
                                        first_pos)
    return paged_mla_decode_ref(q_lat, q_rope, cache, block_table, context_lens, block_size, scale, first_pos)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(batch: int, num_heads: int, device: torch.device) -> int:
    """Context splits per (row, head tile): about two waves of programs over the GPU."""
    tiles = batch * -(-num_heads // BLOCK_H)
    return max(1, min(MAX_SPLITS, 2 * _num_sms(device.index or 0) // tiles))


def _paged_mla_decode_triton(q_lat, q_rope, cache, block_table, context_lens, block_size, scale,
                             first_pos=None):
    from openk3.ops.paged_mla_triton import paged_mla_decode_kernel

    B, H, R = q_lat.shape
    P = q_rope.shape[-1]
    if q_lat.stride(-1) != 1 or q_rope.stride(-1) != 1 or cache.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("`q_lat`, `q_rope`, `cache` and `block_table` need a contiguous last dimension")
    if block_table.dtype != torch.int32:
        raise ValueError(f"`block_table` must be int32, got {block_table.dtype}")
    # the kernel reads row b's length and first position at offset b: a broadcast view (stride 0,
    # e.g. one row's value expanded over its K + 1 verify queries) must become a real vector
    context_lens = context_lens.contiguous()
    first_pos = None if first_pos is None else first_pos.contiguous()
    splits = num_splits(B, H, q_lat.device)
    o_part = torch.empty(B, H, splits, R, device=q_lat.device, dtype=torch.float32)
    lse_part = torch.empty(B, H, splits, device=q_lat.device, dtype=torch.float32)
    fp32 = cache.dtype == torch.float32
    grid = (B, -(-H // BLOCK_H), splits)
    paged_mla_decode_kernel[grid](
        q_lat, q_rope, cache, block_table, context_lens,
        context_lens if first_pos is None else first_pos, o_part, lse_part,  # a pointer never read without it
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0),
        block_table.stride(0), H, block_size, scale,
        R=R, P=P, BLOCK_R=_next_power_of_2(R), BLOCK_P=_next_power_of_2(max(P, 16)),
        BLOCK_H=BLOCK_H, BLOCK_N=16 if fp32 else 32, NUM_SPLITS=splits, HAS_FIRST=first_pos is not None,
        PRECISION="ieee" if fp32 else "tf32", num_warps=4, num_stages=2,
    )
    if splits == 1:
        return o_part[:, :, 0].to(q_lat.dtype)
    return _merge_splits_triton(o_part, lse_part, q_lat.dtype)


def merge_splits_ref(o_part: torch.Tensor, lse_part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Flash decoding's merge: o_part ``[B, H, S, R]`` fp32, each split's softmax-normalised
    output over its own tokens; lse_part ``[B, H, S]`` their log-sum-exps (-inf for a split
    without tokens, which then weighs 0; every row has a token). Returns ``[B, H, R]`` in
    ``dtype``: the splits weighted by ``softmax_s(lse)``."""
    weights = torch.softmax(lse_part, dim=-1)  # [B, H, S]
    return torch.einsum("bhs,bhsr->bhr", weights, o_part).to(dtype)


def _merge_splits_triton(o_part: torch.Tensor, lse_part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from openk3.ops.paged_mla_triton import merge_splits_kernel

    B, H, S, R = o_part.shape
    out = torch.empty(B, H, R, device=o_part.device, dtype=dtype)
    block_s = _next_power_of_2(S)
    block_r = max(16, min(_next_power_of_2(R), 8192 // block_s))  # a tile of <= 8K fp32 values
    if out.numel():
        merge_splits_kernel[(B * H,)](o_part, lse_part, out, R, S, BLOCK_S=block_s, BLOCK_R=block_r,
                                      num_warps=4)
    return out


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
