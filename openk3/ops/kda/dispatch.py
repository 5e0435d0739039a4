"""``kda``: the one KDA entry point layers call. It validates its arguments, then runs
fla-core's kernels (``fla.py``) for CUDA inputs, or else the plain-PyTorch paths: the chunkwise
reference (``chunk.py``), the single-token step (``decode.py``), one sequence at a time for
packed variable-length input."""

from __future__ import annotations

import torch

from openk3.ops.fast import use_fast_path
from openk3.ops.kda.chunk import kda_chunk_ref
from openk3.ops.kda.decode import kda_decode_step
from openk3.ops.kda.fla import fla_available, kda_fla
from openk3.ops.kda.gate import SAFE_LOWER_BOUND, a_log_heads, kda_gate

_TORCH_CHUNK_SIZE = 16


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
    a_log_heads(A_log, H)
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


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
        beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
        lower_bound: float | None = SAFE_LOWER_BOUND, scale: float | None = None,
        initial_state: torch.Tensor | None = None, output_final_state: bool = False,
        use_qk_l2norm: bool = True, cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None, static_varlen: bool = False,
        backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
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
        static_varlen: the packed batch of a CUDA graph (the serving engine's graphed prefill):
            ``cu_seqlens`` may hold empty sequences and end before T (the positions after it are
            padding, their outputs undefined), and nothing reads it on the host (fla's
            ``use_graph`` mode; ``cu_seqlens_cpu`` is not used).
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
        bounds = (cu_seqlens if cu_seqlens_cpu is None or static_varlen else cu_seqlens_cpu).tolist()
        outs = []
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            S0 = None if initial_state is None else initial_state[i:i + 1]
            if a == b:  # an empty sequence (a graph's padding): its state passes through
                S = (q.new_zeros(1, H, K, v.shape[-1], dtype=torch.float32) if S0 is None else S0.float())
                outs.append((v[:, a:b], S if output_final_state else None))
                continue
            outs.append(kda(*(t[:, a:b] for t in (q, k, v, f, beta)), A_log, dt_bias,
                            lower_bound=lower_bound, scale=scale, use_qk_l2norm=use_qk_l2norm,
                            initial_state=S0, output_final_state=output_final_state, backend="torch"))
        o = torch.cat([o for o, _ in outs] + [torch.zeros_like(v[:, bounds[-1]:])], dim=1)  # + padding
        return o, (torch.cat([S for _, S in outs]) if output_final_state else None)
    if backend == "fla":
        if not q.is_cuda:
            raise ValueError(f"backend='fla' needs CUDA tensors, got q on {q.device}")
        if not fla_available():
            raise ValueError("backend='fla' needs fla-core and triton: pip install 'openk3[gpu]'")
        return kda_fla(q, k, v, f, beta, A_log, dt_bias, lower_bound, scale, initial_state,
                       output_final_state, use_qk_l2norm, cu_seqlens, cu_seqlens_cpu, static_varlen)

    g = kda_gate(f, A_log, dt_bias, lower_bound)
    if T == 1 and initial_state is not None:
        o, S = kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], initial_state,
                               scale=scale, use_qk_l2norm=use_qk_l2norm)
        return o[:, None], (S if output_final_state else None)
    # The dense path is exact only while 16 * |lower_bound| <= 80; wider bounds fall back
    # to pairwise decays, like fla's safe_gate (``fla.py``).
    bounded = lower_bound is not None and lower_bound >= SAFE_LOWER_BOUND
    return kda_chunk_ref(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                         chunk_size=_TORCH_CHUNK_SIZE, bounded_gate=bounded)
