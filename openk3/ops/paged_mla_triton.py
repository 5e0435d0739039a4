"""The Triton kernels behind ``openk3.ops.paged_mla.paged_mla_decode`` (imported only on CUDA).

``paged_mla_decode_kernel``: one program per (row b, tile of BLOCK_H heads, context split). It
walks its split of row b's tokens (positions ``first_pos[b] .. context_lens[b] - 1``, from 0
without ``HAS_FIRST``) BLOCK_N at a time, fetching each token's cache row through the block
table (so any block size works, 64 or 6144), and keeps an online softmax: running max ``m``,
running sum ``row_sum`` and the unnormalised output ``acc`` [BLOCK_H, R]. The split's normalised
output and its log-sum-exp go to ``o_part`` / ``lse_part``.

``merge_splits_kernel``: one program per (row, head) merges that row's splits by their
log-sum-exp (``openk3.ops.paged_mla.merge_splits_ref``) and writes the output in its dtype: one
kernel where the PyTorch merge took a softmax, a batched matmul and a cast.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_mla_decode_kernel(
    q_lat_ptr, q_rope_ptr, cache_ptr, block_table_ptr, context_lens_ptr, first_pos_ptr, o_part_ptr, lse_part_ptr,
    stride_ql_b, stride_ql_h, stride_qr_b, stride_qr_h, stride_cache, stride_table,
    num_heads, block_size, scale,
    R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    HAS_FIRST: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_ok = heads < num_heads
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)

    q_lat = tl.load(q_lat_ptr + b * stride_ql_b + heads[:, None] * stride_ql_h + r[None, :],
                    mask=head_ok[:, None] & (r[None, :] < R), other=0.0)  # [BLOCK_H, BLOCK_R]
    if P > 0:
        q_rope = tl.load(q_rope_ptr + b * stride_qr_b + heads[:, None] * stride_qr_h + p[None, :],
                         mask=head_ok[:, None] & (p[None, :] < P), other=0.0)  # [BLOCK_H, BLOCK_P]

    # this split's tokens: whole tiles of BLOCK_N from the row's first position, the last split
    # possibly short or empty
    context_len = tl.load(context_lens_ptr + b).to(tl.int32)
    first = 0
    if HAS_FIRST:
        first = tl.load(first_pos_ptr + b).to(tl.int32)
    tiles_per_split = tl.cdiv(tl.cdiv(context_len - first, BLOCK_N), NUM_SPLITS)
    start = first + split * tiles_per_split * BLOCK_N
    end = tl.minimum(context_len, start + tiles_per_split * BLOCK_N)

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block_id = tl.load(block_table_ptr + b * stride_table + pos // block_size, mask=valid, other=0)
        row = (block_id.to(tl.int64) * block_size + pos % block_size) * stride_cache  # int64 offsets
        c = tl.load(cache_ptr + row[:, None] + r[None, :],
                    mask=valid[:, None] & (r[None, :] < R), other=0.0)  # [BLOCK_N, BLOCK_R]
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N] fp32
        if P > 0:
            k_r = tl.load(cache_ptr + row[:, None] + R + p[None, :],
                          mask=valid[:, None] & (p[None, :] < P), other=0.0)  # [BLOCK_N, BLOCK_P]
            s += tl.dot(q_rope, tl.trans(k_r), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every tile has a valid token
        alpha = tl.exp(m - m_new)
        weights = tl.exp(s - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(weights, axis=1)
        acc = acc * alpha[:, None] + tl.dot(weights.to(c.dtype), c, input_precision=PRECISION)
        m = m_new

    has_tokens = row_sum > 0
    out = acc / tl.where(has_tokens, row_sum, 1.0)[:, None]  # an empty split writes zeros
    lse = tl.where(has_tokens, m + tl.log(row_sum), float("-inf"))
    o_offsets = ((b * num_heads + heads[:, None]) * NUM_SPLITS + split) * R + r[None, :]
    tl.store(o_part_ptr + o_offsets, out, mask=head_ok[:, None] & (r[None, :] < R))
    tl.store(lse_part_ptr + (b * num_heads + heads) * NUM_SPLITS + split, lse, mask=head_ok)


@triton.jit
def merge_splits_kernel(o_part_ptr, lse_part_ptr, out_ptr, R, NUM_SPLITS,
                        BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # row * num_heads + head
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_part_ptr + bh * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)  # finite: every row has a token, so some split has one
    weights = tl.exp(lse - top)
    weights = weights / tl.sum(weights, axis=0)  # an empty split (lse -inf) weighs 0
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        o = tl.load(o_part_ptr + (bh * NUM_SPLITS + s[:, None]) * R + r[None, :],
                    mask=(s[:, None] < NUM_SPLITS) & (r[None, :] < R), other=0.0)  # [BLOCK_S, BLOCK_R]
        merged = tl.sum(o * weights[:, None], axis=0)
        tl.store(out_ptr + bh * R + r, merged.to(out_ptr.dtype.element_ty), mask=r < R)
