"""``kda_decode_``: one KDA decode token per row whose recurrent states live in a pool (the
serving engine's state slots), read and written in place.

The serving decode step used to gather each row's state out of the pool (``index_select``),
run the step, and scatter the new state back (``index_copy_``): two extra kernels per KDA
layer, and at batch 128 of ``small`` two extra reads and writes of 64 MB per layer. fla's
``fused_recurrent_kda`` has a continuous-batching mode made for this (vLLM's layout): with
``ssm_state_indices`` it reads row n's state from ``pool[indices[n]]`` and, with
``inplace_final_state``, writes the new state there. It also applies beta's sigmoid in the
kernel, so the raw beta logits go in (one cast and one sigmoid kernel fewer).

Reference (CPU, or ``backend="torch"``): gather, ``kda_decode_step``, scatter.

``kda_verify_pooled``: T tokens per row from the states of pool rows, which are read and not
written (the speculative verify step; the rollback writes the state after the kept tokens:
``rollback_recompute_``). fla's kernel in its plain batch mode on the gathered states (its
continuous-batching mode writes the state after every token to the pool), with the gate and
beta's sigmoid in the kernel and no zero fill of the output.
"""

from __future__ import annotations

import contextlib

import torch

from openk3.ops.fast import compile_disabled
from openk3.ops.kda.decode import kda_decode_step
from openk3.ops.kda.naive import kda_recurrent_ref
from openk3.ops.kda.dispatch import _validate_kda_inputs
from openk3.ops.kda.gate import SAFE_LOWER_BOUND, a_log_heads, kda_gate
from openk3.ops.kda.verify import _check_pool, _pick_backend, _refuse_grad


def kda_decode_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                beta_logits: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                pool: torch.Tensor, slots: torch.Tensor, *,
                lower_bound: float | None = SAFE_LOWER_BOUND, scale: float | None = None,
                use_qk_l2norm: bool = True, backend: str = "auto") -> torch.Tensor:
    """One token per row, the states of rows ``slots`` of ``pool`` advanced in place.

    Args:
        q, k: ``[B, 1, H, K]`` (after the short convolution); v: ``[B, 1, H, V]``.
        f: raw decay logits ``[B, 1, H, K]`` or ``[B, 1, H*K]``.
        beta_logits: ``[B, 1, H]`` *before* the sigmoid (``b_proj``'s output).
        A_log, dt_bias, lower_bound, scale, use_qk_l2norm: as ``kda``'s.
        pool: ``[n, H, K, V]`` fp32 states; rows ``slots[b]`` hold each row's state before the
            token and are replaced by the state after it.
        slots: ``[B]`` integer rows of ``pool``, distinct (only a scratch row may repeat: its
            contents are then undefined).
        backend: ``"fla"`` (CUDA), ``"torch"`` the reference, ``"auto"`` fla on CUDA.

    Returns:
        o ``[B, 1, H, V]`` in v.dtype.

    Example::

        >>> B, H, K = 2, 2, 8
        >>> q, k, v, f = (torch.randn(B, 1, H, K) for _ in range(4))
        >>> b, pool = torch.randn(B, 1, H), torch.randn(5, H, K, K)
        >>> before = pool.clone()
        >>> o = kda_decode_(q, k, v, f, b, torch.zeros(H), torch.zeros(H * K), pool, torch.tensor([4, 1]))
        >>> o.shape, torch.equal(pool[0], before[0]), torch.equal(pool[4], before[4])
        (torch.Size([2, 1, 2, 8]), True, False)
    """
    B, T, H, K = q.shape
    if T != 1:
        raise ValueError(f"kda_decode_: one token per row, got q {list(q.shape)}")
    _validate_kda_inputs(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, None, backend, B)
    _check_pool(pool, slots, B, H, K, v.shape[-1])
    if pool.device != q.device or not pool.is_contiguous():
        raise ValueError(f"`pool` must be a contiguous tensor on q's device {q.device}, got "
                         f"{'a' if pool.is_contiguous() else 'a non-contiguous'} one on {pool.device}")
    _refuse_grad("kda_decode_", q=q, k=k, v=v, f=f, beta_logits=beta_logits, pool=pool)
    if _pick_backend(backend, q) == "fla":
        return _decode_fla(q, k, v, f.reshape(B, 1, H, K), beta_logits, A_log, dt_bias, pool, slots,
                           lower_bound, scale, use_qk_l2norm)
    g = kda_gate(f.reshape(B, 1, H, K), A_log, dt_bias, lower_bound)
    o, S = kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], torch.sigmoid(beta_logits[:, 0].float()),
                           pool.index_select(0, slots), scale=scale, use_qk_l2norm=use_qk_l2norm)
    pool.index_copy_(0, slots, S)
    return o[:, None]


def _decode_fla(q, k, v, f, beta_logits, A_log, dt_bias, pool, slots, lower_bound, scale, use_qk_l2norm):
    """``kda_decode_`` on fla's ``fused_recurrent_kda`` forward in continuous-batching mode;
    arguments validated, f ``[B, 1, H, K]``. (Runs on CPU tensors too, in Triton's interpreter.)"""
    return _fla_forward(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, scale, use_qk_l2norm,
                        initial_state=pool, inplace_final_state=True, ssm_state_indices=slots)


@compile_disabled("fla-core's Triton KDA kernels run as they are")
def _fla_forward(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, **states):
    """fla's ``fused_recurrent_kda`` forward with the gate and beta's sigmoid in the kernel and
    ``states`` its state arguments; returns o."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    H, K = q.shape[2:]
    v = v.contiguous()
    device = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with device:  # what the public wrapper's input_guard does
        o, _ = fused_recurrent_kda_fwd(
            q=q.contiguous(), k=k.contiguous(), v=v, g=f.contiguous(), beta=beta_logits.contiguous(),
            A_log=a_log_heads(A_log, H).contiguous(), dt_bias=dt_bias.reshape(H * K), scale=scale,
            use_qk_l2norm_in_kernel=use_qk_l2norm, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
            out=torch.empty_like(v), **states)  # every element is written: no zero fill
    return o


def kda_verify_pooled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                      beta_logits: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      pool: torch.Tensor, slots: torch.Tensor, *,
                      lower_bound: float | None = SAFE_LOWER_BOUND, scale: float | None = None,
                      use_qk_l2norm: bool = True, backend: str = "auto") -> torch.Tensor:
    """T tokens per row from the states in rows ``slots`` of ``pool``, which is not modified.

    Args:
        q, k: ``[B, T, H, K]`` (after the short convolution); v: ``[B, T, H, V]``.
        f: raw decay logits ``[B, T, H, K]`` or ``[B, T, H*K]``.
        beta_logits: ``[B, T, H]`` *before* the sigmoid.
        A_log, dt_bias, lower_bound, scale, use_qk_l2norm: as ``kda``'s.
        pool: ``[n, H, K, V]`` fp32 states; rows ``slots[b]`` hold each row's state before its
            first token.
        slots: ``[B]`` integer rows of ``pool`` (repeats allowed: nothing is written).
        backend: ``"fla"`` (CUDA), ``"torch"`` the reference, ``"auto"`` fla on CUDA.

    Returns:
        o ``[B, T, H, V]`` in v.dtype: ``kda``'s output from the gathered states.

    Example::

        >>> B, T, H, K = 2, 3, 2, 8
        >>> q, k, v, f = (torch.randn(B, T, H, K) for _ in range(4))
        >>> b, pool = torch.randn(B, T, H), torch.randn(5, H, K, K)
        >>> before = pool.clone()
        >>> o = kda_verify_pooled(q, k, v, f, b, torch.zeros(H), torch.zeros(H * K), pool, torch.tensor([4, 1]))
        >>> o.shape, torch.equal(pool, before)
        (torch.Size([2, 3, 2, 8]), True)
    """
    B, T, H, K = q.shape
    _validate_kda_inputs(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, None, backend, B)
    _check_pool(pool, slots, B, H, K, v.shape[-1])
    if pool.device != q.device:
        raise ValueError(f"`pool` is on {pool.device}, q on {q.device}")
    _refuse_grad("kda_verify_pooled", q=q, k=k, v=v, f=f, beta_logits=beta_logits, pool=pool)
    states = pool.index_select(0, slots)
    f = f.reshape(B, T, H, K)
    if _pick_backend(backend, q) == "fla":
        return _verify_pooled_fla(q, k, v, f, beta_logits, A_log, dt_bias, states, lower_bound, scale,
                                  use_qk_l2norm)
    o, _ = kda_recurrent_ref(q, k, v, kda_gate(f, A_log, dt_bias, lower_bound), torch.sigmoid(beta_logits.float()),
                             scale, initial_state=states, use_qk_l2norm=use_qk_l2norm)
    return o


def _verify_pooled_fla(q, k, v, f, beta_logits, A_log, dt_bias, states, lower_bound, scale, use_qk_l2norm):
    """``kda_verify_pooled`` on fla's ``fused_recurrent_kda`` forward from the gathered states
    (writing none); arguments validated, f ``[B, T, H, K]``."""
    return _fla_forward(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, scale, use_qk_l2norm,
                        initial_state=states, inplace_final_state=False, output_final_state=False)
