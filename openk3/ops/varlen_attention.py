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
  so v is zero-padded to q's and the padding columns are dropped from the output. (cuDNN's
  fused attention, which takes V at its own head dim, ran its kernels faster on a cold 32K
  prefill but spent ~50 ms of host time per varlen call: ``benchmarks/mla_prefill_attention.py``,
  docs/benchmarks.md, twentieth session.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.fast import use_fast_path


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
    if cu_seqlens_q_cpu[-1] != q.shape[0] or cu_seqlens_k_cpu[-1] != k.shape[0]:
        raise ValueError(f"the offsets end at {int(cu_seqlens_q_cpu[-1])} queries and "
                         f"{int(cu_seqlens_k_cpu[-1])} keys, got {q.shape[0]} and {k.shape[0]}")
    if bool((cu_seqlens_k_cpu.diff() < cu_seqlens_q_cpu.diff()).any()):
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
        return _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_cpu, cu_seqlens_k_cpu,
                             scale, causal)
    return varlen_causal_attention_ref(q, k, v, cu_seqlens_q_cpu, cu_seqlens_k_cpu, scale, causal)


def _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_cpu, cu_seqlens_k_cpu, scale,
                  causal):
    Dv = v.shape[-1]
    v = F.pad(v, (0, q.shape[-1] - Dv)).contiguous()  # FlashAttention-2: one head dim for q, k and v
    out = torch.ops.aten._flash_attention_forward(
        q.contiguous(), k.contiguous(), v, cu_seqlens_q.int(), cu_seqlens_k.int(),
        int(cu_seqlens_q_cpu.diff().max()), int(cu_seqlens_k_cpu.diff().max()),
        0.0, causal, False, scale=scale)[0]  # dropout 0, causal (bottom-right), no debug mask
    return out[..., :Dv]
