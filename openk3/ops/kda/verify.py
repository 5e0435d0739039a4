"""KDA over a speculative-verification segment, and the rollback of a KDA layer's state (the
recurrent state and the short-convolution state) to the last accepted token (K3_SPEC §5, #14).

The target model verifies K draft tokens in one forward over T = K + 1 positions per sequence:
the last token it sampled, then the K drafts. Rejection sampling keeps the first ``n_b``
positions of sequence b (``1 <= n_b <= T``: that token and the ``n_b - 1`` accepted drafts; the
corrected or bonus token is fed at the next step). Afterwards the state must be exactly what
feeding the kept positions one at a time leaves,

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   t = 1 .. n_b,

and positions ``n_b + 1 .. T`` must leave no trace. The outputs ``o_t = S_t^T q_t`` of the kept
positions read only positions ``1 .. t``, so the verify forward's are already right: only the
state needs rolling back. Two strategies, timed against each other by
``benchmarks/kda_rollback_bench.py``:

* **snapshot**: ``kda_verify(..., output_states=True)`` keeps every per-position state
  ``S_1 .. S_T`` ``[B, T, H, K, V]`` fp32; once ``n_b`` is known, ``rollback_snapshot_`` copies
  ``S_{n_b}`` into the sequence's pool slot. Extra memory ``T * H * K * V * 4`` bytes per sequence
  and KDA layer, held for every layer from its forward until sampling ends; the forward writes
  T states instead of one.
* **recompute**: ``kda_verify(..., output_states=False)`` writes no state, so the pool slot still
  holds ``S_0``; once ``n_b`` is known, ``rollback_recompute_`` re-runs the recurrence from it
  over the segment with the rejected positions masked (``beta_t = 0`` and ``g_t = 0`` make a
  step the identity, exactly: ``S_t = S_{t-1} * 1 + k_t (0 * ...)``) and writes the final
  state. Extra memory: the segment's inputs q, k, v, f (bf16) and beta, ``T * (8 * H * K + 4 * H)``
  bytes per sequence and layer (~1/32 of one state per position at K = V = 128); extra work: one
  short recurrent pass per layer, which reads ``S_0`` and writes ``S_{n_b}``. Masking instead of
  cutting the segment keeps every shape fixed: no host sync, graph-capturable.

The short convolution's state is a window of its inputs, so its rollback is a gather from the
old state and the segment's (pre-convolution) inputs, whichever KDA strategy is used:
``conv_state_rollback``.

Inference only: verification is a serving step and fla's ``fused_recurrent_kda`` has no
backward, so inputs that require grad (under grad mode) are refused; call under
``torch.no_grad()`` or ``torch.inference_mode()``.

``num_kept`` ``[B]`` (integers ``n_b``) may live on the host or on the device. On the host its
range is checked with a ``ValueError``; on the device it is checked with ``torch._assert_async``,
which does not wait for the device (a bad value fails the next CUDA call instead).
"""

from __future__ import annotations

import torch

from openk3.ops.fast import compile_disabled, use_fast_path
from openk3.ops.kda.dispatch import _validate_kda_inputs
from openk3.ops.kda.fla import fla_available
from openk3.ops.kda.gate import SAFE_LOWER_BOUND, a_log_heads, kda_gate
from openk3.ops.kda.naive import delta_rule_step, kda_recurrent_ref, prepare_qk


def _refuse_grad(fn: str, **tensors: torch.Tensor | None) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise ValueError(f"{fn} is inference-only (no backward): `{name}` requires grad; "
                             f"call it under torch.no_grad() or torch.inference_mode()")


def _check_num_kept(num_kept: torch.Tensor, B: int, T: int, device: torch.device) -> torch.Tensor:
    """``num_kept`` as int64 on ``device``, after checking it is ``[B]`` with values in 1..T."""
    if not isinstance(num_kept, torch.Tensor):
        raise TypeError(f"`num_kept` must be an integer tensor [B] = [{B}], got "
                        f"{type(num_kept).__name__}")
    if num_kept.shape != (B,) or num_kept.dtype.is_floating_point or num_kept.dtype == torch.bool:
        raise ValueError(f"`num_kept` must be an integer tensor [B] = [{B}], got "
                         f"{num_kept.dtype} {list(num_kept.shape)}")
    if num_kept.device.type == "cpu":
        bad = ((num_kept < 1) | (num_kept > T)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"`num_kept` must be in 1..T = 1..{T} (positions kept of the segment), "
                             f"got {num_kept.tolist()} (bad at rows {bad})")
    else:
        torch._assert_async(((num_kept >= 1) & (num_kept <= T)).all())
    return num_kept.to(device=device, dtype=torch.long, non_blocking=True)


def _check_pool(pool: torch.Tensor, slots: torch.Tensor, B: int, H: int, K: int, V: int) -> None:
    if pool.dim() != 4 or pool.shape[1:] != (H, K, V) or pool.dtype != torch.float32:
        raise ValueError(f"`pool` must be fp32 [n, H, K, V] = [n, {H}, {K}, {V}], got "
                         f"{pool.dtype} {list(pool.shape)}")
    if slots.shape != (B,) or slots.dtype.is_floating_point or slots.device != pool.device:
        raise ValueError(f"`slots` must be an integer tensor [B] = [{B}] on the pool's device "
                         f"{pool.device}, got {slots.dtype} {list(slots.shape)} on {slots.device}")


def kda_verify_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, initial_state: torch.Tensor, scale: float | None = None,
                   use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token recurrence of ``kda_recurrent_ref`` (the same ``delta_rule_step``), keeping
    the state after every position.

    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log decay; beta: ``[B, T, H]``;
    initial_state: ``[B, H, K, V]``. Returns o ``[B, T, H, V]`` in v.dtype and the states
    ``[B, T, H, K, V]`` fp32, ``states[:, t]`` the state after position t (0-based).

    Example::

        >>> q, k, v = (torch.randn(2, 4, 3, 8) for _ in range(3))
        >>> g, beta = -torch.rand(2, 4, 3, 8), torch.rand(2, 4, 3)
        >>> o, states = kda_verify_ref(q, k, v, g, beta, torch.zeros(2, 3, 8, 8))
        >>> o.shape, states.shape
        (torch.Size([2, 4, 3, 8]), torch.Size([2, 4, 3, 8, 8]))
    """
    q, k = prepare_qk(q, k, scale, use_qk_l2norm)
    vf, g, beta = v.float(), g.float(), beta.float()
    S = initial_state.float()
    outs, states = [], []
    for t in range(q.shape[1]):
        o_t, S = delta_rule_step(S, q[:, t], k[:, t], vf[:, t], g[:, t], beta[:, t])
        outs.append(o_t)
        states.append(S)
    return torch.stack(outs, dim=1).to(v.dtype), torch.stack(states, dim=1)


def _pick_backend(backend: str, q: torch.Tensor) -> str:
    if backend == "auto":
        return "fla" if use_fast_path(q) and fla_available() else "torch"
    if backend == "fla":
        if not q.is_cuda:
            raise ValueError(f"backend='fla' needs CUDA tensors, got q on {q.device}")
        if not fla_available():
            raise ValueError("backend='fla' needs fla-core and triton: pip install 'openk3[gpu]'")
    return backend


def kda_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
               beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
               initial_state: torch.Tensor, lower_bound: float | None = SAFE_LOWER_BOUND,
               scale: float | None = None, use_qk_l2norm: bool = True, output_states: bool = True,
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over a verification segment of T positions per sequence, from ``initial_state``,
    which is not modified. Inference only.

    Args:
        q, k, v, f, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm: as ``kda``'s
            (``f`` the raw decay logits ``[B, T, H, K]`` or ``[B, T, H*K]``).
        initial_state: ``[B, H, K, V]``, the state before the segment (read as fp32).
        output_states: keep the state after every position (the snapshot strategy); False
            for the recompute strategy, which keeps none.
        backend: ``"fla"`` runs fla-core's ``fused_recurrent_kda`` kernel, ``"torch"`` the
            reference ``kda_verify_ref``, ``"auto"`` fla for CUDA inputs when it imports.

    Returns:
        o ``[B, T, H, V]`` in v.dtype; the per-position states ``[B, T, H, K, V]`` fp32
        (``[:, t]`` after position t) or None.

    Example::

        >>> B, T, H, K = 2, 4, 3, 16
        >>> q, k, v, f = (torch.randn(B, T, H, K) for _ in range(4))
        >>> o, states = kda_verify(q, k, v, f, torch.rand(B, T, H), torch.zeros(H),
        ...                        torch.zeros(H * K), initial_state=torch.zeros(B, H, K, K))
        >>> o.shape, states.shape
        (torch.Size([2, 4, 3, 16]), torch.Size([2, 4, 3, 16, 16]))
    """
    _validate_kda_inputs(q, k, v, f, beta, A_log, dt_bias, lower_bound, initial_state, backend,
                         q.shape[0])
    _refuse_grad("kda_verify", q=q, k=k, v=v, f=f, beta=beta, A_log=A_log, dt_bias=dt_bias,
                 initial_state=initial_state)
    B, T, H, K = q.shape
    f = f.reshape(B, T, H, K)
    if _pick_backend(backend, q) == "fla":
        return _verify_fla(q, k, v, f, beta, A_log, dt_bias, lower_bound, scale, initial_state,
                           use_qk_l2norm, output_states)
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    if output_states:
        return kda_verify_ref(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    o, _ = kda_recurrent_ref(q, k, v, g, beta, scale, initial_state=initial_state,
                             use_qk_l2norm=use_qk_l2norm)
    return o, None


def rollback_snapshot_(pool: torch.Tensor, slots: torch.Tensor, states: torch.Tensor,
                       num_kept: torch.Tensor) -> None:
    """Snapshot strategy, after sampling: ``pool[slots[b]] = states[b, num_kept[b] - 1]``.

    Args:
        pool: ``[n, H, K, V]`` fp32, one KDA layer's state slots (``KDAPool.recurrent[layer]``).
        slots: ``[B]`` the sequences' slots in ``pool``.
        states: ``[B, T, H, K, V]`` fp32 from ``kda_verify(..., output_states=True)``.
        num_kept: ``[B]`` positions kept of each segment, 1..T.

    Example::

        >>> states, pool = torch.randn(2, 4, 3, 8, 8), torch.zeros(5, 3, 8, 8)
        >>> rollback_snapshot_(pool, torch.tensor([3, 0]), states, torch.tensor([4, 1]))
        >>> torch.equal(pool[3], states[0, 3]), torch.equal(pool[0], states[1, 0])
        (True, True)
    """
    if states.dim() != 5 or states.dtype != torch.float32:
        raise ValueError(f"`states` must be fp32 [B, T, H, K, V], got {states.dtype} "
                         f"{list(states.shape)}")
    B, T, H, K, V = states.shape
    _check_pool(pool, slots, B, H, K, V)
    if states.device != pool.device:
        raise ValueError(f"`states` is on {states.device}, pool on {pool.device}")
    n = _check_num_kept(num_kept, B, T, states.device)
    pool.index_copy_(0, slots, states[torch.arange(B, device=states.device), n - 1])


def rollback_recompute_(pool: torch.Tensor, slots: torch.Tensor, num_kept: torch.Tensor,
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                        beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                        lower_bound: float | None = SAFE_LOWER_BOUND, scale: float | None = None,
                        use_qk_l2norm: bool = True, backend: str = "auto") -> None:
    """Recompute strategy, after sampling: ``pool[slots[b]]`` holds ``S_0`` (the verify forward
    wrote no state); replace it by the state after the first ``num_kept[b]`` positions.

    The whole segment runs again with positions ``t >= num_kept[b]`` masked by ``beta = 0`` and
    ``g = 0``: such a step leaves the state unchanged exactly, so the final state is
    ``S_{n_b}`` while shapes stay ``[B, T]``.

    Args:
        pool, slots, num_kept: as ``rollback_snapshot_``'s.
        q, k, v, f, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, backend: the
            segment's inputs and options, as given to ``kda_verify``.

    Example::

        >>> B, T, H, K = 2, 4, 3, 16
        >>> x = [torch.randn(B, T, H, K) for _ in range(4)] + [torch.rand(B, T, H)]
        >>> gate = (torch.zeros(H), torch.zeros(H * K))
        >>> pool, slots = torch.randn(3, H, K, K), torch.tensor([2, 0])
        >>> _, states = kda_verify(*x, *gate, initial_state=pool[slots])
        >>> rollback_recompute_(pool, slots, torch.tensor([3, 1]), *x, *gate)
        >>> torch.equal(pool[2], states[0, 2]), torch.equal(pool[0], states[1, 0])
        (True, True)
    """
    _validate_kda_inputs(q, k, v, f, beta, A_log, dt_bias, lower_bound, None, backend,
                         q.shape[0])
    B, T, H, K = q.shape
    _check_pool(pool, slots, B, H, K, v.shape[-1])
    if pool.device != q.device:
        raise ValueError(f"`pool` is on {pool.device}, q on {q.device}")
    S0 = pool.index_select(0, slots)                                 # [B, H, K, V]
    _refuse_grad("rollback_recompute_", q=q, k=k, v=v, f=f, beta=beta, A_log=A_log,
                 dt_bias=dt_bias, pool=pool)
    n = _check_num_kept(num_kept, B, T, q.device)
    kept_BT = torch.arange(T, device=q.device) < n[:, None]          # [B, T]
    g = kda_gate(f.reshape(B, T, H, K), A_log, dt_bias, lower_bound)
    g = torch.where(kept_BT[..., None, None], g, 0.0)
    beta = torch.where(kept_BT[..., None], beta.float(), 0.0)
    if _pick_backend(backend, q) == "fla":
        S = _recompute_fla(q, k, v, g, beta, S0, scale, use_qk_l2norm)
    else:
        _, S = kda_recurrent_ref(q, k, v, g, beta, scale, initial_state=S0,
                                 output_final_state=True, use_qk_l2norm=use_qk_l2norm)
    pool.index_copy_(0, slots, S)


@compile_disabled("fla-core's Triton KDA kernels run as they are")
def _verify_fla(q, k, v, f, beta, A_log, dt_bias, lower_bound, scale, initial_state,
                use_qk_l2norm, output_states):
    """``kda_verify`` on ``fused_recurrent_kda``; arguments validated, f ``[B, T, H, K]``."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd

    B, T, H, K = q.shape
    V = v.shape[-1]
    gate_args = {"A_log": a_log_heads(A_log, H).contiguous(), "dt_bias": dt_bias.reshape(H * K),
                 "use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": use_qk_l2norm,
                 "lower_bound": lower_bound}
    if not output_states:
        o, _ = fused_recurrent_kda(q, k, v, f, beta, scale=scale,
                                   initial_state=initial_state.float(), **gate_args)
        return o, None
    # The public ``fused_recurrent_kda`` returns only the final state. Its forward has a
    # continuous-batching mode (the layout vLLM's speculative decoding uses): with
    # ``ssm_state_indices`` [N, T] it reads sequence n's initial state from row indices[n, 0]
    # of a state table and writes the state after token t to row indices[n, t]. Rows
    # n * T + t of ``states`` are those rows, and row n * T is seeded with S_0.
    states = torch.empty(B, T, H, K, V, device=q.device, dtype=torch.float32)
    states[:, 0] = initial_state
    indices = torch.arange(B * T, device=q.device, dtype=torch.int32).view(B, T)
    with torch.cuda.device(q.device):  # what the public wrapper's input_guard does
        o, _ = fused_recurrent_kda_fwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=f.contiguous(),
            beta=beta.contiguous(), scale=scale, initial_state=states.view(B * T, H, K, V),
            inplace_final_state=True, ssm_state_indices=indices, **gate_args)
    return o, states


@compile_disabled("fla-core's Triton KDA kernels run as they are")
def _recompute_fla(q, k, v, g, beta, initial_state, scale, use_qk_l2norm):
    """The final state of ``fused_recurrent_kda`` on an already-computed (masked) log decay g."""
    from fla.ops.kda import fused_recurrent_kda

    _, S = fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    return S


def conv_state_rollback_ref(conv_state: torch.Tensor, x: torch.Tensor,
                            num_kept: torch.Tensor) -> torch.Tensor:
    """The reference of ``conv_state_rollback``: one sequence at a time, by slicing.
    Arguments and result as ``conv_state_rollback``'s (unchecked)."""
    outs = []
    for b, n in enumerate(num_kept.tolist()):
        window_CE = torch.cat([conv_state[b].to(x.dtype), x[b, :n].T], dim=-1)  # [C, W-1+n]
        outs.append(window_CE[:, n:])
    return torch.stack(outs)


def conv_state_rollback(conv_state: torch.Tensor, x: torch.Tensor,
                        num_kept: torch.Tensor) -> torch.Tensor:
    """The short convolution's state after the first ``num_kept[b]`` positions of a segment.

    The conv state is the last W-1 inputs (``openk3.ops.conv``). With the window
    ``E_b = [conv_state[b] | x[b]^T]`` ``[C, W-1+T]``, the state after n_b kept positions is
    ``E_b[:, n_b : n_b + W-1]``: it reaches into the old state when ``n_b < W-1``. One gather,
    no host sync. Write it back with ``pool.index_copy_(0, slots, state)``.

    Args:
        conv_state: ``[B, C, W-1]``, the state before the segment.
        x: ``[B, T, C]``, the segment's convolution inputs (q|k|v before the convolution).
        num_kept: ``[B]`` positions kept of each segment, 1..T.

    Returns:
        ``[B, C, W-1]`` in x.dtype, as ``causal_conv1d`` returns its state.

    Example::

        >>> state, x = torch.zeros(2, 6, 3), torch.randn(2, 5, 6)
        >>> new = conv_state_rollback(state, x, torch.tensor([5, 1]))
        >>> torch.equal(new[0], x[0, 2:5].T), torch.equal(new[1][:, -1], x[1, 0])
        (True, True)
    """
    if x.dim() != 3:
        raise ValueError(f"`x` must be [B, T, C], got {list(x.shape)}")
    B, T, C = x.shape
    if conv_state.dim() != 3 or conv_state.shape[:2] != (B, C) or conv_state.device != x.device:
        raise ValueError(f"`conv_state` must be [B, C, W-1] = [{B}, {C}, W-1] on {x.device}, got "
                         f"{list(conv_state.shape)} on {conv_state.device}")
    n = _check_num_kept(num_kept, B, T, x.device)
    W1 = conv_state.shape[-1]
    window_BCE = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
    cols_BW = n[:, None] + torch.arange(W1, device=x.device)                    # [B, W-1]
    return window_BCE.gather(2, cols_BW[:, None, :].expand(B, C, W1))
