"""Attention over packed sequences whose queries are the last tokens of their keys.

Sequence ``i`` has ``Tq_i`` queries (rows ``cu_seqlens_q[i] : cu_seqlens_q[i+1]``) and ``Tk_i >=
Tq_i`` keys and values (rows ``cu_seqlens_k[i] : cu_seqlens_k[i+1]``); its query ``j`` sits at key
position ``Tk_i - Tq_i + j`` and attends to keys ``0 ..`` that position (the causal mask aligned
to the bottom right: a prefill chunk over its cached prefix plus itself). With ``causal=False``
every query sees all keys of its own sequence (the vision tower: the patches of one image).

* ``varlen_causal_attention_ref``: plain PyTorch, the reference: one
  ``scaled_dot_product_attention`` per sequence, the same call the MLA layer makes.
* ``varlen_causal_attention``: the entry point. On CUDA in bf16 / fp16 one FlashAttention-2
  varlen call for the whole batch (PyTorch's own kernel; its causal mask is bottom-right
  aligned). FlashAttention-2 needs one head dim (a multiple of 8, at most 256) for q, k and v,
  so v is zero-padded to q's and the padding columns are dropped from the output.
* ``split_attention``: one causal sequence (a single prompt's chunk, the serving case that
  matters most: a cold long prompt, a short chunk after a long cached prefix) in parts merged by
  their log-sum-exps: the cached prefix cut into pieces every query sees whole, and the causal
  tail (the prefix's remainder and the queries' own keys). On CUDA the prefix goes to cuDNN's
  fused attention (Hopper kernels, 2.3x FlashAttention-2's rate, V at its own head dim) in one
  batched call, cut into as many runs as fill the SMs about four times (a 1,024-token chunk
  alone is only 128 blocks of 64 queries; less work than ``CUDNN_MIN_PAIRS`` stays in
  FlashAttention-2, cut the same way; less work still, with the SMs filled, takes one
  FlashAttention-2 call: ``_split_pays``); the tail runs in FlashAttention-2, or from
  ``CUDNN_MIN_TOKENS`` queries in cuDNN as a top-left causal square (``square_by``: zero
  queries in front of the real ones make its alignment the bottom-right one). cuDNN builds a
  plan per shape (~40 ms, once): lengths are padded to eight buckets per octave (padding
  queries of an unmasked call, or keys at the end of a top-left causal square, change no real
  row), and run lengths are rounded down to eight per octave (``_run_align``; the rest joins
  the tail), so the key side has a few plans per run count. (cuDNN's own varlen entry point
  spent ~55 ms of host time per call: docs/benchmarks.md, twentieth session.)
  ``attention_lse_ref`` is the parts' reference. ``merge_parts`` merges them by their
  log-sum-exps (one Triton kernel on CUDA, ``merge_parts_ref`` its reference).
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F

from openk3.ops.fast import importable, use_fast_path

CUDNN_MIN_TOKENS = 1024  # a causal tail of this many queries runs in cuDNN's fused attention
CUDNN_MIN_PAIRS = 1 << 23  # queries x prefix keys from which the prefix runs in cuDNN: less work
# than a 512-token chunk over a 16K prefix is quick in FlashAttention-2, and a cuDNN plan (built
# per shape, 40-150 ms the first time) would cost more than it saves
CUDNN_PIECE_KEYS = 256  # cuDNN's runs of prefix keys are multiples of at least this (fewer plans)
_MERGE_TRITON = "openk3.ops.attention_merge_triton"
SPLIT_MIN_TOKENS = 2048  # a chunk with a short prefix (or none) splits from this many queries: at
# 1,024 one FlashAttention-2 call beat the parts (cold 0.107 against 0.145 ms; 1,024 after 1,024
# 0.14 against 0.94: host-bound), from 8,192 cuDNN's square wins 2x (H200, docs/benchmarks.md)


def varlen_causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cu_seqlens_q_cpu: torch.Tensor, cu_seqlens_k_cpu: torch.Tensor,
                                scale: float, causal: bool = True) -> torch.Tensor:
    """The reference: a loop over sequences (offsets read from the host copies)."""
    out = []
    for qa, qb, ka, kb in zip(cu_seqlens_q_cpu[:-1].tolist(), cu_seqlens_q_cpu[1:].tolist(),
                              cu_seqlens_k_cpu[:-1].tolist(), cu_seqlens_k_cpu[1:].tolist()):
        Tq, Tk = qb - qa, kb - ka
        qi, ki, vi = (t.transpose(0, 1) for t in (q[qa:qb], k[ka:kb], v[ka:kb]))  # [H, T, dim]
        if Tq == Tk or not causal:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, scale=scale)
        else:
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_cpu, cu_seqlens_k_cpu) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"`q`, `k`, `v` must be [T, H, dim], got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    if k.shape[:2] != v.shape[:2] or k.shape[1:] != q.shape[1:]:
        raise ValueError(f"`k` must be [Tk, H, {q.shape[-1]}] and `v` [Tk, H, dv] with q's H = "
                         f"{q.shape[1]}, got {list(k.shape)} and {list(v.shape)}")
    n = cu_seqlens_q_cpu.numel()
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("cu_seqlens_k_cpu", cu_seqlens_k_cpu)):
        if t.numel() != n:
            raise ValueError(f"`{name}` has {t.numel()} offsets, `cu_seqlens_q_cpu` {n}")
    # Python ints: a prefill's few offsets checked in microseconds (torch ops on host tensors
    # cost ~40 us of every MLA layer's attention; docs/benchmarks.md, thirty-first session)
    cu_q, cu_k = cu_seqlens_q_cpu.tolist(), cu_seqlens_k_cpu.tolist()
    if cu_q[-1] != q.shape[0] or cu_k[-1] != k.shape[0]:
        raise ValueError(f"the offsets end at {cu_q[-1]} queries and {cu_k[-1]} keys, got "
                         f"{q.shape[0]} and {k.shape[0]}")
    if any(kb - ka < qb - qa for qa, qb, ka, kb in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])):
        raise ValueError("every sequence needs at least as many keys as queries")


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                            cu_seqlens_q_cpu: torch.Tensor, cu_seqlens_k_cpu: torch.Tensor,
                            scale: float, causal: bool = True) -> torch.Tensor:
    """Bottom-right causal (or, with ``causal=False``, full) attention over packed sequences.

    Args:
        q: [Tq, H, D] packed queries; k: [Tk, H, D] and v: [Tk, H, Dv] packed keys and values.
        cu_seqlens_q, cu_seqlens_k: [N+1] offsets on q's device; ``*_cpu``: the same on the host
            (the kernel's maximum lengths and the reference's loop come from them, no sync).
        scale: softmax scale.
        causal: False lets every query see every key of its sequence.

    Returns:
        [Tq, H, Dv].

    Example:
        >>> q, k, v = torch.randn(5, 2, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 4)
        >>> cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 4, 9])  # 2 of 4, 3 of 5
        >>> varlen_causal_attention(q, k, v, cu_q, cu_k, cu_q, cu_k, scale=8 ** -0.5).shape
        torch.Size([5, 2, 4])
    """
    _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_cpu, cu_seqlens_k_cpu)
    D, Dv = q.shape[-1], v.shape[-1]
    if use_fast_path(q) and q.dtype in (torch.bfloat16, torch.float16) and Dv <= D <= 256 and D % 8 == 0:
        Tq, P = q.shape[0], k.shape[0] - q.shape[0]
        if causal and cu_seqlens_q_cpu.numel() == 2 and _split_pays(q, P):
            m = _groups(q, 64)
            return split_attention(q, k, v, scale, m, _run_align(P // m), attend=_flash_lse,
                                   pieces=_cudnn_pieces if Tq * P >= CUDNN_MIN_PAIRS else None,
                                   square=_cudnn_tail)
        return _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_cpu, cu_seqlens_k_cpu,
                             scale, causal)
    return varlen_causal_attention_ref(q, k, v, cu_seqlens_q_cpu, cu_seqlens_k_cpu, scale, causal)


def _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_cpu, cu_seqlens_k_cpu, scale,
                  causal):
    return _flash(q, k, v, cu_seqlens_q.int(), cu_seqlens_k.int(), cu_seqlens_q_cpu, cu_seqlens_k_cpu, scale,
                  causal)[0]


def _flash(q, k, v, cu_q, cu_k, cu_seqlens_q_cpu, cu_seqlens_k_cpu, scale, causal):
    """FlashAttention-2's varlen kernel (PyTorch's own; int32 offsets on the device, their host
    copies for the maximum lengths): (out [Tq, H, Dv], its log-sum-exps as the kernel returns
    them). One head dim for q, k and v: v is zero-padded to q's, the padding columns dropped."""
    Dv = v.shape[-1]
    v = F.pad(v, (0, q.shape[-1] - Dv)).contiguous()
    out, lse = torch.ops.aten._flash_attention_forward(
        q.contiguous(), k.contiguous(), v, cu_q, cu_k, int(cu_seqlens_q_cpu.diff().max()),
        int(cu_seqlens_k_cpu.diff().max()), 0.0, causal, False, scale=scale)[:2]  # no dropout, no debug mask
    return out[..., :Dv], lse


def attention_lse_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q_cpu: torch.Tensor,
                      cu_seqlens_k_cpu: torch.Tensor, scale: float, causal: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of a part: (out [Tq, H, Dv] in q's dtype, natural log-sum-exp of each
    query's scaled scores [H, Tq] in fp32), the mask as ``varlen_causal_attention``'s."""
    out, lse = [], []
    for qa, qb, ka, kb in zip(cu_seqlens_q_cpu[:-1].tolist(), cu_seqlens_q_cpu[1:].tolist(),
                              cu_seqlens_k_cpu[:-1].tolist(), cu_seqlens_k_cpu[1:].tolist()):
        Tq, Tk = qb - qa, kb - ka
        s = torch.einsum("qhd,khd->hqk", q[qa:qb].float(), k[ka:kb].float()) * scale
        if causal:
            visible = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
            s = s.masked_fill(~visible, float("-inf"))
        m = s.logsumexp(-1)  # [H, Tq]
        out.append(torch.einsum("hqk,khd->qhd", (s - m[..., None]).exp(), v[ka:kb].float()).to(q.dtype))
        lse.append(m)
    return torch.cat(out), torch.cat(lse, dim=1)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int,
                    align: int = 1, attend=attention_lse_ref, pieces=None, square=None) -> torch.Tensor:
    """Bottom-right causal attention of one sequence, in parts merged by their log-sum-exps.

    The cached prefix (the first ``P = Tk - Tq`` keys) is cut into ``m = min(groups, P // align)``
    runs of ``L`` keys, L the largest multiple of ``align`` with ``m * L <= P``, which every
    query sees whole: ``pieces(q, k, v, scale)`` attends to them, k and v [m, L, H, *],
    unmasked, and returns (out [m, Tq, H, Dv], lse [m, H, Tq]); without it, or when it declines
    (returns None), ``attend`` runs them in one varlen call with the queries repeated per run. The rest of the keys (the prefix's
    remainder and the queries' own) is the causal tail, bottom-right aligned: ``square(q, k, v,
    scale)`` when given and it does not decline (returns None), else ``attend`` causal.
    ``attend`` has ``attention_lse_ref``'s form.

    Args:
        q: [Tq, H, D]; k: [Tk, H, D]; v: [Tk, H, Dv], Tk >= Tq.
        groups: how many runs the prefix is cut into at most (at least 1).
        align: a run's length is a multiple of this (a kernel's plan per shape: fewer shapes).

    Returns:
        [Tq, H, Dv] in q's dtype (the parts merged in fp32).
    """
    Tq, P = q.shape[0], k.shape[0] - q.shape[0]
    m = min(groups, P // align)
    L = P // max(m, 1) // align * align
    if m:
        runs = (q, k[:m * L].unflatten(0, (m, L)), v[:m * L].unflatten(0, (m, L)), scale)
        res = None if pieces is None else pieces(*runs)
        o_runs, lse_runs = res if res is not None else _pieces_by(attend, *runs)
    tail = k.shape[0] - m * L
    res = None if square is None else square(q, k[m * L:], v[m * L:], scale)
    o, lse = res if res is not None else attend(q, k[m * L:], v[m * L:], torch.tensor([0, Tq]),
                                                torch.tensor([0, tail]), scale, True)
    return merge_parts(o_runs, lse_runs, o, lse).to(q.dtype) if m else o


def merge_parts_ref(o_runs: torch.Tensor, lse_runs: torch.Tensor, o_tail: torch.Tensor,
                    lse_tail: torch.Tensor) -> torch.Tensor:
    """Attention over keys cut into parts, from each part's output and log-sum-exp: the m runs
    o_runs [m, Tq, H, Dv] with lse_runs [m, H, Tq] and the tail o_tail [Tq, H, Dv] with lse_tail
    [H, Tq] (natural logs). Each part's share of a query's softmax is exp(lse_i - logsumexp_i
    lse_i). Returns [Tq, H, Dv] in fp32."""
    lse = torch.cat([lse_runs, lse_tail[None]]).float()
    w = (lse - lse.logsumexp(0)).exp().transpose(1, 2)[..., None]  # [m + 1, Tq, H, 1]
    return (o_runs.float() * w[:-1]).sum(0) + o_tail.float() * w[-1]


def merge_parts(o_runs: torch.Tensor, lse_runs: torch.Tensor, o_tail: torch.Tensor,
                lse_tail: torch.Tensor) -> torch.Tensor:
    """``merge_parts_ref`` (any strides, last dim contiguous for the outputs); on CUDA one Triton
    kernel (``attention_merge_triton.py``) that returns o_tail's dtype."""
    if not (use_fast_path(o_tail) and importable(_MERGE_TRITON) and o_runs.stride(-1) == 1
            and o_tail.stride(-1) == 1):
        return merge_parts_ref(o_runs, lse_runs, o_tail, lse_tail)
    import triton

    from openk3.ops.attention_merge_triton import merge_parts_kernel

    m, Tq, H, Dv = o_runs.shape
    out = torch.empty(Tq, H, Dv, dtype=o_tail.dtype, device=o_tail.device)
    block_q = 16
    merge_parts_kernel[(triton.cdiv(Tq, block_q), H)](
        o_runs, lse_runs, o_tail, lse_tail, out, m, Tq, Dv, *o_runs.stride()[:3], *lse_runs.stride(),
        *o_tail.stride()[:2], *lse_tail.stride(), *out.stride()[:2],
        BLOCK_Q=block_q, BLOCK_D=triton.next_power_of_2(Dv), num_warps=4)
    return out


def _pieces_by(attend, q, k, v, scale):
    """``split_attention``'s prefix pieces through ``attend``: one unmasked varlen call, the
    queries repeated per piece."""
    n, L = k.shape[:2]
    Tq, H = q.shape[:2]
    o, lse = attend(q.repeat(n, 1, 1), k.flatten(0, 1), v.flatten(0, 1), torch.arange(n + 1) * Tq,
                    torch.arange(n + 1) * L, scale, False)
    return o.unflatten(0, (n, Tq)), lse.unflatten(1, (n, Tq)).transpose(0, 1)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _flash_lse(q, k, v, cu_seqlens_q_cpu, cu_seqlens_k_cpu, scale, causal):
    """``attention_lse_ref`` by FlashAttention-2 (``_flash``), the offsets uploaded here."""
    cu_q, cu_k = (t.int().pin_memory().to(q.device, non_blocking=True)  # pinned: no wait on the GPU
                  for t in (cu_seqlens_q_cpu, cu_seqlens_k_cpu))
    out, lse = _flash(q, k, v, cu_q, cu_k, cu_seqlens_q_cpu, cu_seqlens_k_cpu, scale, causal)
    if lse.dim() == 3:  # the padded layout [N, H, max_q] of older builds
        lse = lse.transpose(0, 1).flatten(1)[:, :q.shape[0]] if lse.shape[0] == 1 else \
            torch.cat([lse[i, :, :b - a] for i, (a, b) in enumerate(zip(cu_seqlens_q_cpu[:-1].tolist(),
                                                                        cu_seqlens_q_cpu[1:].tolist()))], 1)
    return out, lse  # [Tq, H, Dv], [H, Tq]


def _cudnn_bucket(T: int) -> int:
    """cuDNN plans are built per shape: lengths are padded up to eight sizes per octave (at most
    12.5% more rows, at least 64)."""
    step = 1 << max(6, T.bit_length() - 4)
    return -(-T // step) * step


_CUDNN_FAILED: list[str] = []


def _cudnn(q, k, v, scale, causal):
    """cuDNN's fused attention on [B, T, H, *] tensors (any strides, last dim contiguous):
    (out [B, Tq, H, Dv], lse [B, H, Tq] fp32), or None once cuDNN has refused a call (warned
    once; the callers then take FlashAttention-2)."""
    if _CUDNN_FAILED:
        return None
    try:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), None, True, 0.0, causal, False, scale=scale)[:2]
    except torch.OutOfMemoryError:
        raise  # not a refusal: the caller's to handle, cuDNN stays on
    except RuntimeError as e:
        _CUDNN_FAILED.append(str(e))
        warnings.warn(f"cuDNN's fused attention refused {list(q.shape)} x {list(k.shape)} queries x keys "
                      f"({str(e).splitlines()[0]}); FlashAttention-2 from now on", stacklevel=3)
        return None
    return out.transpose(1, 2), lse.reshape(q.shape[0], q.shape[2], q.shape[1]).float()


def square_by(dense, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """The causal tail (Tq queries, the last of Tk >= Tq keys, bottom-right aligned) through a
    top-left causal kernel ``dense(q, k, v, scale, causal)`` on [1, B, H, *] tensors, which
    returns (out [1, B, H, Dv], lse [1, H, B]) or None: one square of B rows, Tk padded up to
    ``_cudnn_bucket``. The queries sit in rows Tk - Tq .. Tk - 1, where top-left and
    bottom-right alignment agree; the rows before them are zero queries and the rows after are
    zero keys, which no real row sees. Their results are dropped. Returns None if ``dense``
    does."""
    Tq, Tk = q.shape[0], k.shape[0]
    B, front = _cudnn_bucket(Tk), Tk - Tq
    # one pad each (F.pad: a new tensor, so the kernel gets contiguous rows); the keys and values
    # go as they are when the bucket is their length (any strides, last dim contiguous)
    padded = [F.pad(q, (0, 0, 0, 0, front, B - Tk)) if B != Tq else q.contiguous(),
              *(F.pad(t, (0, 0, 0, 0, 0, B - Tk)) if B != Tk else t for t in (k, v))]
    res = dense(*(p[None] for p in padded), scale, True)
    if res is None:
        return None
    return res[0][0, front:Tk], res[1][0, :, front:Tk]


def _cudnn_tail(q, k, v, scale):
    """``split_attention``'s tail in cuDNN (``square_by``) from ``CUDNN_MIN_TOKENS`` queries and
    a prefix remainder no longer than the queries (its zero query rows are wasted work); None
    (FlashAttention-2) otherwise or if cuDNN refuses."""
    Tq = q.shape[0]
    if _CUDNN_FAILED or Tq < CUDNN_MIN_TOKENS or k.shape[0] - Tq > Tq:
        return None
    return square_by(_cudnn, q, k, v, scale)


def _cudnn_pieces(q, k, v, scale):
    """``split_attention``'s prefix runs k, v [m, L, H, *] in one cuDNN call: the queries copied
    per run and padded up to ``_cudnn_bucket`` (padded queries of an unmasked call change no
    real row). None (FlashAttention-2) if cuDNN refuses."""
    if _CUDNN_FAILED:
        return None
    m, Tq = k.shape[0], q.shape[0]
    B = _cudnn_bucket(Tq)
    if B == Tq:  # the queries once per run: one copy (none for one run)
        qs = q[None] if m == 1 else q[None].expand(m, *q.shape).contiguous()
    else:
        qs = q.new_zeros(m, B, *q.shape[1:])
        qs[:, :Tq] = q
    res = _cudnn(qs, k, v, scale, False)
    return None if res is None else (res[0][:, :Tq], res[1][:, :, :Tq])


def _run_align(length: int) -> int:
    """What a run of ``length`` prefix keys is rounded down to a multiple of: eight lengths per
    octave, at least ``CUDNN_PIECE_KEYS`` (each length is a cuDNN plan; the rest, under 12.5%,
    goes to the tail)."""
    return max(CUDNN_PIECE_KEYS, 1 << max(0, length.bit_length() - 4))


def _split_pays(q: torch.Tensor, P: int) -> bool:
    """Whether one sequence's Tq queries over P prefix keys (and their own) go to
    ``split_attention``: a prefix big enough for cuDNN (``CUDNN_MIN_PAIRS``), a prefix whose
    queries alone would leave half the SMs idle in one call (64 queries x heads a block), or
    ``SPLIT_MIN_TOKENS`` queries and more (cuDNN's causal square)."""
    Tq = q.shape[0]
    if Tq * P >= CUDNN_MIN_PAIRS or Tq >= SPLIT_MIN_TOKENS:
        return True
    return P > 0 and 2 * math.ceil(Tq / 64) * q.shape[1] <= _sm_count(q.device)


def _groups(q: torch.Tensor, rows: int) -> int:
    """How many runs of the prefix go side by side so that their query blocks (``rows`` queries
    x heads x runs) fill the SMs about four times."""
    blocks = math.ceil(q.shape[0] / rows) * q.shape[1]
    return max(1, math.ceil(4 * _sm_count(q.device) / blocks))
