"""Kimi Delta Attention (KDA) numerics (K3_SPEC §1.2).

Per head, with an fp32 state ``S`` of shape ``[K, V]``:

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

``kda_recurrent_ref`` is the per-token ground truth, ``kda_chunk_ref`` the chunkwise
(WY / UT-transform) form used for training and prefill on CPU, ``kda_decode_step`` one
token of decode, ``causal_conv1d`` the short convolution in front of q, k, v, and ``kda``
the dispatcher that runs fla-core's Triton kernels on GPU and the chunkwise reference
elsewhere.

Shapes: q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g (log decay, fp32) ``[B, T, H, K]``;
beta (already sigmoided) ``[B, T, H]``; state ``[B, H, K, V]`` fp32. All internal math is
fp32; outputs are cast to ``v.dtype`` and final states stay fp32.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from openk3.ops.fast import use_fast_path

# The spec's lower bound: with g >= -5 a 16-token chunk keeps its cumulative log-decay in
# (-80, 0], which is what lets the dense (bounded) intra-chunk path divide by the decay.
SAFE_LOWER_BOUND = -5.0
# exp(85) ~ 8e36 sits below fp32's max (~3.4e38, exp(88.7)) with room for the sum over K
# of unit-norm key products; beyond it 1 / cumulative decay would overflow.
_MAX_RECIPROCAL_LOG_DECAY = 85.0
_L2NORM_EPS = 1e-6
_TORCH_CHUNK_SIZE = 16


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, as the K3 kernels do (not F.normalize)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2NORM_EPS)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, scale: float | None,
                use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q (normalised and scaled) and k (normalised); q, k: [..., K]."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q * scale, k


def _heads_of(A_log: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A_log as a [H] vector: either exactly H elements (any shape, e.g. Kimi Linear's
    [1, 1, H, 1]) or the K3 checkpoint's zero-padded 1-D vector, of which the first H count."""
    if A_log.numel() == num_heads:
        return A_log.reshape(num_heads)
    if A_log.dim() == 1 and A_log.numel() > num_heads:
        return A_log[:num_heads]
    raise ValueError(f"`A_log` has shape {list(A_log.shape)}: expected {num_heads} elements "
                     f"or a zero-padded 1-D tensor longer than {num_heads}")


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float | None = SAFE_LOWER_BOUND, *,
             num_heads: int | None = None) -> torch.Tensor:
    """Per-channel log decay g from the raw decay logits.

    Args:
        f: raw decay logits ``[B, T, H, K]``, or ``[B, T, H*K]`` together with ``num_heads``.
        A_log: one scalar per head: ``H`` elements in any shape, or a zero-padded 1-D tensor
            longer than ``H`` (the K3 checkpoint pads it to 128); only the first ``H`` are used.
        dt_bias: ``[H*K]`` per-channel bias.
        lower_bound: K3's bounded gate ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))``,
            so ``g`` is in ``[lower_bound, 0]`` (closed once sigmoid rounds); ``None`` selects Kimi Linear's unbounded
            ``g = -exp(A_log[h]) * softplus(f + dt_bias)``.
        num_heads: ``H``; needed only for a 3-D ``f``, since a padded ``A_log`` cannot tell it.

    Returns:
        g: ``[B, T, H, K]`` fp32.
    """
    if f.dim() == 3:
        if num_heads is None or f.shape[-1] % num_heads:
            raise ValueError(f"`f` of shape {list(f.shape)} is [B, T, H*K]: pass num_heads dividing "
                             f"{f.shape[-1]}, got num_heads={num_heads}")
        f = f.unflatten(-1, (num_heads, -1))
    elif f.dim() != 4:
        raise ValueError(f"`f` must be [B, T, H, K] or [B, T, H*K], got {list(f.shape)}")
    H, K = f.shape[-2:]
    if dt_bias.numel() != H * K:
        raise ValueError(f"`dt_bias` has {dt_bias.numel()} elements, expected H*K = {H * K}")
    a_H1 = _heads_of(A_log, H).float().exp()[:, None]        # [H, 1]
    x = f.float() + dt_bias.float().reshape(H, K)            # [B, T, H, K]
    if lower_bound is None:
        return -a_H1 * F.softplus(x)
    return lower_bound * torch.sigmoid(a_H1 * x)


def _delta_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token on prepared fp32 inputs. S: [B, H, K, V]; q, k, g: [B, H, K]; v: [B, H, V];
    beta: [B, H]. Returns (o [B, H, V], S [B, H, K, V]); out of place so autograd sees every step."""
    S = S * g.exp()[..., None]                                  # Diag(alpha_t) S_{t-1}
    v_err = v - torch.einsum("bhk,bhkv->bhv", k, S)             # what the state mispredicts for k_t
    S = S + torch.einsum("bhk,bhv->bhkv", k, beta[..., None] * v_err)
    return torch.einsum("bhk,bhkv->bhv", q, S), S


def kda_recurrent_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, scale: float | None = None,
                      initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                      use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token KDA loop: the ground truth every other path is tested against.

    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log decay; beta: ``[B, T, H]``;
    initial_state: ``[B, H, K, V]``. Returns o ``[B, T, H, V]`` in v.dtype and, when
    ``output_final_state``, the final state ``[B, H, K, V]`` fp32 (else None).
    """
    B, T, H, K = q.shape
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm)
    vf, g, beta = v.float(), g.float(), beta.float()
    S = (q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None
         else initial_state.float())
    outs = []
    for t in range(T):
        o_t, S = _delta_step(S, q[:, t], k[:, t], vf[:, t], g[:, t], beta[:, t])
        outs.append(o_t)
    return torch.stack(outs, dim=1).to(v.dtype), (S if output_final_state else None)


def _to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, ...] with T a multiple of chunk_size -> [B, H, N, C, ...]."""
    B, T, H = x.shape[:3]
    x = x.reshape(B, T // chunk_size, chunk_size, H, *x.shape[3:])
    return x.movedim(3, 1)


def kda_chunk_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, scale: float | None = None,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                  use_qk_l2norm: bool = True, chunk_size: int = 16,
                  bounded_gate: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA in plain PyTorch: the same result as ``kda_recurrent_ref``, with a Python
    loop over chunks only.

    Within a chunk, with Gamma_r = exp(cumulative log-decay up to position r), the state
    corrections delta satisfy the unit-lower-triangular system (I + A) delta = beta (v - (Gamma k) S_0),
    A[r, s] = beta_r sum_c k_rc k_sc Gamma_rc / Gamma_sc for s < r. Solving it once per chunk
    for all chunks at once (the UT transform) gives delta = U - W S_0 (the WY representation),
    so the sequential part is two matmuls per chunk.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log decay;
            beta: ``[B, T, H]``; initial_state: ``[B, H, K, V]``. Any T (the tail is padded).
        bounded_gate: g >= -5 (K3's gate), so the intra-chunk products are dense matmuls of
            ``k * Gamma`` / ``q * Gamma`` with ``k / Gamma``. Raises ValueError when the
            cumulative log-decay of a chunk would overflow fp32 on that path. With False
            (Kimi Linear's unbounded softplus gate) the decays are formed pairwise as
            exp(G_r - G_s) for r >= s only: always finite, C times more memory.

    Returns:
        o ``[B, T, H, V]`` in v.dtype; final state ``[B, H, K, V]`` fp32 or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm)
    vf, g, beta = v.float(), g.float(), beta.float()
    # Padded positions have k = 0 and beta = 0 (no state update) and g = 0 (no decay),
    # so the final state is unchanged by them; their outputs are dropped.
    pad = -T % C
    q, k, vf, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, vf, g))
    beta = F.pad(beta, (0, 0, 0, pad))
    q, k, vf, g, beta = (_to_chunks(x, C) for x in (q, k, vf, g, beta))  # [B, H, N, C, ...]
    N = q.shape[2]

    G = g.cumsum(-2)                                          # [B, H, N, C, K] log Gamma
    decay = G.exp()                                           # Gamma, in (0, 1]
    q_dec = q * decay                                         # reads S_0 through the decay
    if bounded_gate:
        # Checking the cumulative decay itself (not chunk_size * min(g)) is the exact condition
        # for exp(-G) below to stay finite; with g >= -5 and C = 16 it always holds.
        min_log_decay = G.min().item()
        if min_log_decay < -_MAX_RECIPROCAL_LOG_DECAY:
            raise ValueError(
                f"bounded_gate=True but the cumulative log-decay in a chunk of {C} reaches "
                f"{min_log_decay:.1f} < -{_MAX_RECIPROCAL_LOG_DECAY:.0f}: 1/decay would overflow "
                f"fp32. Use g >= {-_MAX_RECIPROCAL_LOG_DECAY / C:.2f}, a smaller chunk_size, "
                f"or bounded_gate=False")
        k_inv = k * (-G).exp()                                # k_s / Gamma_s, <= e^85 * |k|
        A_kk = (k * decay) @ k_inv.transpose(-1, -2)          # [B, H, N, C, C]
        A_qk = q_dec @ k_inv.transpose(-1, -2)                # [B, H, N, C, C]
    else:
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # [B, H, N, C(r), C(s), K]: exp(G_r - G_s), masked before exp so r < s never overflows
        pair_decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(
            ~causal[:, :, None], float("-inf")).exp()
        A_kk = torch.einsum("...rc,...sc,...rsc->...rs", k, k, pair_decay)
        A_qk = torch.einsum("...rc,...sc,...rsc->...rs", q, k, pair_decay)
    A_kk = A_kk.tril(-1) * beta[..., :, None]                 # strictly lower: s < r
    A_qk = A_qk.tril()                                        # o_r sees delta_s for s <= r

    eye = torch.eye(C, dtype=A_kk.dtype, device=A_kk.device)
    L = eye + A_kk                                            # unit lower triangular
    U = torch.linalg.solve_triangular(L, beta[..., None] * vf, upper=False,
                                      unitriangular=True)     # [B, H, N, C, V]
    W = torch.linalg.solve_triangular(L, beta[..., None] * k * decay, upper=False,
                                      unitriangular=True)     # [B, H, N, C, K]
    G_last = G[..., -1:, :]                                   # [B, H, N, 1, K]
    k_to_end = k * (G_last - G).exp()                         # decay from s to chunk end, <= 1

    S = vf.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outs = []
    for n in range(N):
        delta = U[:, :, n] - W[:, :, n] @ S                   # [B, H, C, V]
        outs.append(q_dec[:, :, n] @ S + A_qk[:, :, n] @ delta)
        S = S * G_last[:, :, n].exp().transpose(-1, -2) + k_to_end[:, :, n].transpose(-1, -2) @ delta
    o = torch.stack(outs, dim=2)                              # [B, H, N, C, V]
    o = o.movedim(1, 3).reshape(B, N * C, H, V)[:, :T]
    return o.to(v.dtype), (S if output_final_state else None)


def kda_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, state: torch.Tensor, scale: float | None = None,
                    use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token. q, k: ``[B, H, K]``; v: ``[B, H, V]``; g: ``[B, H, K]`` log decay;
    beta: ``[B, H]``; state: ``[B, H, K, V]``. Returns (o ``[B, H, V]`` in v.dtype,
    new state ``[B, H, K, V]`` fp32); ``state`` itself is not modified."""
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm)
    o, S = _delta_step(state.float(), q, k, v.float(), g.float(), beta.float())
    return o.to(v.dtype), S


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None,
                  cu_seqlens: torch.Tensor | None = None,
                  cu_seqlens_cpu: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution followed by SiLU, in x.dtype (KDA's short conv on q, k, v).

    Args:
        x: ``[B, T, C]``.
        weight: ``[C, 1, W]`` (checkpoint layout, e.g. ``q_conv1d.weight`` ``[H*128, 1, 4]``).
        conv_state: ``[B, C, W-1]``, the W-1 inputs before ``x`` (zeros when None).
        cu_seqlens: packed variable-length input: ``x`` is ``[1, sum T_i, C]`` holding N
            sequences at ``[cu_seqlens[i], cu_seqlens[i+1])``; conv_state is then ``[N, C, W-1]``.
        cu_seqlens_cpu: the same offsets on the host, if the caller has them (saves a
            device-to-host read).

    Returns:
        y ``[B, T, C]`` and the new conv_state ``[B, C, W-1]`` (``[N, C, W-1]`` with
        cu_seqlens): the last W-1 inputs, reaching into the old state when T < W-1.
    """
    if cu_seqlens is not None:
        bounds = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
        if x.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs packed input [1, T, C], got {list(x.shape)}")
        states = [None] * (len(bounds) - 1) if conv_state is None else conv_state.unbind(0)
        ys, finals = zip(*(causal_conv1d(x[:, a:b], weight, None if st is None else st[None])
                           for a, b, st in zip(bounds[:-1], bounds[1:], states)))
        return torch.cat(ys, dim=1), torch.cat(finals)
    B, T, C = x.shape
    if weight.dim() != 3 or weight.shape[:2] != (C, 1):
        raise ValueError(f"`weight` must be [C, 1, W] with C = {C}, got {list(weight.shape)}")
    W = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(B, C, W - 1)
    elif conv_state.shape != (B, C, W - 1):
        raise ValueError(f"`conv_state` must be [B, C, W-1] = {[B, C, W - 1]}, "
                         f"got {list(conv_state.shape)}")
    x_BCL = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
    y_BCT = F.conv1d(x_BCL, weight.to(x.dtype), groups=C)
    return F.silu(y_BCT).transpose(1, 2), x_BCL[..., x_BCL.shape[-1] - (W - 1):]


@functools.cache
def fla_available() -> bool:
    """Whether fla-core's KDA kernels import (needs triton; the import takes ~10 s, once)."""
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return False
    return True


def _validate_kda_inputs(q, k, v, f, beta, A_log, dt_bias, lower_bound, initial_state, backend,
                         num_seqs):
    if backend not in ("auto", "torch", "fla"):
        raise ValueError(f"`backend` must be 'auto', 'torch' or 'fla', got {backend!r}")
    if q.dim() != 4:
        raise ValueError(f"`q` must be [B, T, H, K], got {list(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"`k` must match q's shape {list(q.shape)}, got {list(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"`v` must be [B, T, H, V] = {[B, T, H]} + [V], got {list(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point):
        raise ValueError(f"`q`, `k`, `v` must share one floating dtype, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if f.shape not in ((B, T, H, K), (B, T, H * K)):
        raise ValueError(f"`f` must be [B, T, H, K] = {[B, T, H, K]} or [B, T, H*K], "
                         f"got {list(f.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"`beta` must be [B, T, H] = {[B, T, H]}, got {list(beta.shape)}")
    _heads_of(A_log, H)
    if dt_bias.numel() != H * K:
        raise ValueError(f"`dt_bias` must have H*K = {H * K} elements, got {list(dt_bias.shape)}")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"`lower_bound` must be negative (or None), got {lower_bound}")
    V = v.shape[-1]
    if initial_state is not None and initial_state.shape != (num_seqs, H, K, V):
        raise ValueError(f"`initial_state` must be [N, H, K, V] = {[num_seqs, H, K, V]}, "
                         f"got {list(initial_state.shape)}")
    tensors = {"q": q, "k": k, "v": v, "f": f, "beta": beta, "A_log": A_log, "dt_bias": dt_bias}
    if initial_state is not None:
        tensors["initial_state"] = initial_state
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"`{name}` is on {t.device}, q on {q.device}")


def _kda_fla(q, k, v, f, beta, A_log, dt_bias, lower_bound, scale, initial_state,
             output_final_state, use_qk_l2norm, cu_seqlens=None, cu_seqlens_cpu=None):
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    B, T, H, K = q.shape
    gate_args = dict(
        A_log=_heads_of(A_log, H),                    # [H]: the kernels index A_log[h]
        dt_bias=dt_bias.reshape(H * K),               # [H*K]: the kernels index dt_bias[h*K + c]
        use_gate_in_kernel=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        lower_bound=lower_bound,
    )
    if initial_state is not None:
        initial_state = initial_state.float()         # chunk_kda asserts an fp32 state
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (q, k, v, f, beta, A_log, dt_bias, initial_state))
    # fused_recurrent_kda is forward-only (no autograd), so training steps of T == 1 go
    # through chunk_kda.
    if T == 1 and not needs_grad and cu_seqlens is None:
        return fused_recurrent_kda(q, k, v, f, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, **gate_args)
    return chunk_kda(q, k, v, f, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     cu_seqlens_cpu=cu_seqlens_cpu,
                     # fla's dense tensor-core path exists only for bounds in [-5, 0)
                     safe_gate=lower_bound is not None and lower_bound >= SAFE_LOWER_BOUND,
                     **gate_args)


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
        beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
        lower_bound: float | None = SAFE_LOWER_BOUND, scale: float | None = None,
        initial_state: torch.Tensor | None = None, output_final_state: bool = False,
        use_qk_l2norm: bool = True, cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention with the decay gate fused in: the one entry point layers call.

    Args:
        q, k: ``[B, T, H, K]`` (after the short conv; L2-normalised here when ``use_qk_l2norm``).
        v: ``[B, T, H, V]``; q, k and v share one dtype.
        f: raw decay logits ``[B, T, H, K]`` or ``[B, T, H*K]`` (output of ``f_b_proj``).
        beta: ``[B, T, H]``, already sigmoided.
        A_log, dt_bias, lower_bound: the gate, see ``kda_gate``.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[B, H, K, V]``, any float dtype (used as fp32).
        cu_seqlens: packed variable-length batch (serving prefill): inputs are ``[1, sum T_i, ...]``
            holding N sequences at ``[cu_seqlens[i], cu_seqlens[i+1])``; initial and final
            states are ``[N, H, K, V]``. fla runs it as one kernel; the reference loops.
        cu_seqlens_cpu: the same offsets on the host, if the caller has them: fla then reads
            the sequence lengths without waiting for the GPU.
        backend: ``"fla"`` runs fla-core's Triton kernels (``chunk_kda``; ``fused_recurrent_kda``
            for a T == 1 step without autograd), ``"torch"`` the chunkwise reference,
            ``"auto"`` picks fla for CUDA inputs when it imports (unless ``OPENK3_REFERENCE=1``).

    Returns:
        o ``[B, T, H, V]`` in v.dtype; final state ``[B, H, K, V]`` fp32, or None unless
        ``output_final_state``.

    Example::

        >>> B, T, H, K = 1, 10, 2, 16
        >>> q, k, v, f = (torch.randn(B, T, H, K) for _ in range(4))
        >>> beta = torch.rand(B, T, H)
        >>> o, S = kda(q, k, v, f, beta, torch.zeros(128), torch.zeros(H * K),
        ...            output_final_state=True, backend="torch")
        >>> o.shape, S.shape
        (torch.Size([1, 10, 2, 16]), torch.Size([1, 2, 16, 16]))
    """
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs packed inputs [1, T, H, K], got q {list(q.shape)}")
    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    _validate_kda_inputs(q, k, v, f, beta, A_log, dt_bias, lower_bound, initial_state, backend,
                         num_seqs)
    B, T, H, K = q.shape
    f = f.reshape(B, T, H, K)
    if backend == "auto":
        backend = "fla" if use_fast_path(q) and fla_available() else "torch"
    if cu_seqlens is not None and backend == "torch":
        bounds = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
        outs = [kda(*(t[:, a:b] for t in (q, k, v, f, beta)), A_log, dt_bias,
                    lower_bound=lower_bound, scale=scale, use_qk_l2norm=use_qk_l2norm,
                    initial_state=None if initial_state is None else initial_state[i:i + 1],
                    output_final_state=output_final_state, backend="torch")
                for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
        o = torch.cat([o for o, _ in outs], dim=1)
        return o, (torch.cat([S for _, S in outs]) if output_final_state else None)
    if backend == "fla":
        if not q.is_cuda:
            raise ValueError(f"backend='fla' needs CUDA tensors, got q on {q.device}")
        if not fla_available():
            raise ValueError("backend='fla' needs fla-core and triton: pip install 'openk3[gpu]'")
        return _kda_fla(q, k, v, f, beta, A_log, dt_bias, lower_bound, scale, initial_state,
                        output_final_state, use_qk_l2norm, cu_seqlens, cu_seqlens_cpu)

    g = kda_gate(f, A_log, dt_bias, lower_bound)
    if T == 1 and initial_state is not None:
        o, S = kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], initial_state,
                               scale=scale, use_qk_l2norm=use_qk_l2norm)
        return o[:, None], (S if output_final_state else None)
    # The dense path is exact only while 16 * |lower_bound| <= 80; wider bounds fall back
    # to pairwise decays, like fla's safe_gate above.
    bounded = lower_bound is not None and lower_bound >= SAFE_LOWER_BOUND
    return kda_chunk_ref(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                         chunk_size=_TORCH_CHUNK_SIZE, bounded_gate=bounded)
