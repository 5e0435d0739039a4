"""KDA's short convolution (K3_SPEC §1.2): a depthwise causal conv1d followed by SiLU.

    y[t, c] = silu(sum_j weight[c, 0, j] * x[t - (W-1) + j, c]),   j = 0 .. W-1

where positions before a sequence's start read its conv state: the W-1 inputs that came
before it, oldest first (zeros when there is none). The convolution is depthwise, so one call
over concatenated channels (q|k|v, with weights and states concatenated along C) gives the same
result as one call per part.

* ``causal_conv1d_ref``: plain PyTorch, the reference. Packed variable-length input is
  gathered by index arithmetic: no Python work per sequence.
* ``causal_conv1d``: the entry point layers call. On CUDA, without a state or ``cu_seqlens``
  (training: one sequence per batch row), openk3's Triton kernels (``conv_triton.py``): a
  forward, and a backward that recomputes the pre-activation and writes dx and per-block shares
  of dweight in one pass (fla's forward and backward took ~235 us of GPU time per `small` call,
  ~6x the bytes they move; these ~165: issue P7, ``benchmarks/conv_speed.py``). Without
  autograd, with a state or ``cu_seqlens`` (the serving prefill), openk3's varlen kernels
  (``conv_varlen_*``: fla's took ~5x the floor's time at 32K tokens, issue P8). Otherwise
  fla-core's Triton kernels: ``causal_conv1d`` (variable length, initial and final state,
  autograd) and, for one decode token without autograd, ``causal_conv1d_update``. ``torch.compile`` calls both as they are (a graph break around
  them) instead of tracing them.
* ``causal_conv1d_update_``: one decode token per row whose states live in a pool (the serving
  engine's state slots): reads and writes the pool rows in place. Reference: gather, the
  reference above, scatter; on CUDA one Triton kernel (``conv_triton.py``).
* ``causal_conv1d_pooled``: T tokens per row after the states of pool rows, which are read and
  not written (the serving engine's speculative verify step). Reference: gather, the reference
  above; on CUDA one Triton kernel.

fla's state is ``[N, C, W]``, one column wider than ours: its column 0 holds the input W steps
back, which no output reads (the forward kernel loads columns 1.. only and the update kernel
shifts column 0 out), and its columns 1.. are ours. The fast path pads a zero column in front
and drops it from the result.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from openk3.ops.fast import compile_disabled, importable, needs_grad, use_fast_path


def _validate(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
              cu_seqlens: torch.Tensor | None) -> None:
    if x.dim() != 3:
        raise ValueError(f"`x` must be [B, T, C], got {list(x.shape)}")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs packed input [1, T, C], got {list(x.shape)}")
    B, T, C = x.shape
    if weight.dim() != 3 or weight.shape[:2] != (C, 1):
        raise ValueError(f"`weight` must be [C, 1, W] with C = {C}, got {list(weight.shape)}")
    W = weight.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if conv_state is not None and conv_state.shape != (N, C, W - 1):
        layout = "[B, C, W-1]" if cu_seqlens is None else "[N, C, W-1] (N sequences)"
        raise ValueError(f"`conv_state` must be {layout} = {[N, C, W - 1]}, "
                         f"got {list(conv_state.shape)}")
    for name, t in (("weight", weight), ("conv_state", conv_state), ("cu_seqlens", cu_seqlens)):
        if t is not None and t.device != x.device:
            raise ValueError(f"`{name}` is on {t.device}, x on {x.device}")


def _conv_packed(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                 cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference on N sequences packed in x [1, T, C] (cu_seqlens ending at T); returns y
    [1, T, C], state [N, C, W-1]."""
    T, C = x.shape[1:]
    W = weight.shape[-1]
    N = cu_seqlens.numel() - 1
    cu = cu_seqlens.long()
    lengths = cu.diff()                                              # [N]
    state = x.new_zeros(N, C, W - 1) if conv_state is None else conv_state.to(x.dtype)
    # Each sequence reads as its W-1 state inputs followed by its tokens; in these "extended"
    # positions e, e < W-1 is a state row and e >= W-1 a token. src: all state rows, all tokens.
    src = torch.cat([state.transpose(1, 2).reshape(N * (W - 1), C), x[0]])  # [N*(W-1) + T, C]

    def rows(seq: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Rows of ``src`` holding extended positions e of sequences seq (broadcast)."""
        return torch.where(e < W - 1, seq * (W - 1) + e, N * (W - 1) + cu[seq] + e - (W - 1))

    taps = torch.arange(W, device=x.device)
    seq = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=T)  # [T]
    pos = torch.arange(T, device=x.device) - cu[seq]                 # position in its sequence
    windows_TWC = src[rows(seq[:, None], pos[:, None] + taps)]       # e = pos + j, j = 0 .. W-1
    y = F.silu((windows_TWC.float() * weight[:, 0].T.float()).sum(1))  # [T, C]
    # the new state is the last W-1 extended positions: e = length .. length + W-2
    final_NWC = src[rows(torch.arange(N, device=x.device)[:, None], lengths[:, None] + taps[:-1])]
    return y.to(x.dtype)[None], final_NWC.transpose(1, 2)


def _conv_torch(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if cu_seqlens is not None:
        T, T_all = int(cu_seqlens[-1]), x.shape[1]  # positions past the offsets' end: a CUDA
        if T < T_all:  # graph's padding, zeros here (a host read: serving only, never compiled)
            y, state = _conv_packed(x[:, :T], weight, conv_state, cu_seqlens)
            return F.pad(y, (0, 0, 0, T_all - T)), state
        return _conv_packed(x, weight, conv_state, cu_seqlens)
    B, T, C = x.shape
    # a batch of B rows is B packed sequences of T tokens each
    y, final = _conv_packed(x.reshape(1, B * T, C), weight, conv_state,
                            torch.arange(B + 1, device=x.device) * T)
    return y.reshape(B, T, C), final


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor,
                      conv_state: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution then SiLU in plain PyTorch: math in fp32, y in x.dtype.

    Arguments and results as ``causal_conv1d``'s.

    Example::

        >>> x, weight = torch.randn(1, 5, 6), torch.randn(6, 1, 4)
        >>> y, state = causal_conv1d_ref(x, weight, cu_seqlens=torch.tensor([0, 2, 5]))
        >>> y.shape, state.shape
        (torch.Size([1, 5, 6]), torch.Size([2, 6, 3]))
    """
    _validate(x, weight, conv_state, cu_seqlens)
    return _conv_torch(x, weight, conv_state, cu_seqlens)


_FLA_CONV = "fla.modules.causal_conv1d"
_CONV_TRITON = "openk3.ops.conv_triton"
# (positions, channels, warps) per program of the training kernels (``conv_triton.py``): the
# forward's tiles and the walking backward's blocks, chosen by ``benchmarks/conv_speed.py`` on one
# H200 at `small`'s shape (docs/benchmarks.md)
FWD_BLOCKS = (16, 128, 2)
BWD_BLOCKS = (16, 128, 1)
TRITON_WIDTH = 4  # the taps the backward kernel is written for (K3's linear_conv_kernel_size)


def _conv_launch(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor | None = None):
    """The forward (dy None: y) or backward (dx, dweight) Triton kernel over x [B, T, C]."""
    import triton

    from openk3.ops.conv_triton import conv_bwd_walk_kernel, conv_fwd_kernel

    B, T, C = x.shape
    W = weight.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = weight.reshape(C, W).contiguous()
    if dy is None:
        bt, bc, warps = FWD_BLOCKS
        y = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
        conv_fwd_kernel[(triton.cdiv(T, bt), triton.cdiv(C, bc), B)](
            x, w, y, T, C, x.stride(0), x.stride(1), W=W, BLOCK_T=bt, BLOCK_C=bc, num_warps=warps)
        return y
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    bt, bc, warps = BWD_BLOCKS
    programs = triton.cdiv(T, bt)
    dx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    dw = torch.empty(B * programs, W, C, device=x.device, dtype=torch.float32)
    conv_bwd_walk_kernel[(programs, triton.cdiv(C, bc), B)](
        x, w, dy, dx, dw, T, C, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
        BLOCK_T=bt, BLOCK_C=bc, num_warps=warps)
    return dx, dw.sum(0).T.reshape(C, 1, W).to(weight.dtype)


class _ConvTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _conv_launch(x, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx, dw = _conv_launch(x, weight, dy)
        return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None)


@compile_disabled("openk3's Triton conv kernels run as they are")
def _conv_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _ConvTriton.apply(x, weight)


VARLEN_BLOCKS = (16, 128, 4)  # (positions, channels, warps) per program of the varlen forward


@compile_disabled("openk3's Triton conv kernels run as they are")
def _conv_varlen_triton(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                        cu_seqlens: torch.Tensor | None, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference with a state or packed sequences (the serving prefill): ``conv_varlen_*`` kernels.
    y is [parts, B, T, C / parts] (``causal_conv1d``'s ``parts``)."""
    import triton

    from openk3.ops.conv_triton import conv_varlen_fwd_kernel, conv_varlen_state_kernel

    B, T, C = x.shape
    W = weight.shape[-1]
    if cu_seqlens is None:  # B rows of T tokens: B packed sequences
        cu_seqlens = torch.arange(B + 1, device=x.device) * T
    rows = x.reshape(B * T, C)  # a view for the usual layouts (the projection's columns)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    N = cu_seqlens.numel() - 1
    cu = cu_seqlens.to(torch.int32)
    # each position's sequence; positions past cu[-1] (a CUDA graph's padding: cu_seqlens padded
    # with empty sequences) go to the last, reading only memory that exists
    seq = torch.searchsorted(cu[1:], torch.arange(B * T, device=x.device, dtype=torch.int32),
                             right=True).clamp_(max=N - 1).to(torch.int32)
    state = None if conv_state is None else conv_state.to(x.dtype).contiguous()  # as the reference rounds it
    w = weight.reshape(C, W).contiguous()
    y = torch.empty(parts, B * T, C // parts, device=x.device, dtype=x.dtype)
    bt, bc, warps = VARLEN_BLOCKS
    conv_varlen_fwd_kernel[(triton.cdiv(B * T, bt), triton.cdiv(C, bc))](
        rows, w, y, state, seq, cu, B * T, C, rows.stride(0), CP=C // parts, HAS_STATE=state is not None,
        W=W, BLOCK_T=bt, BLOCK_C=bc, ROW_ALIGN=math.gcd(rows.stride(0), 16), num_warps=warps)
    new = torch.empty(N, C, W - 1, device=x.device, dtype=x.dtype)
    conv_varlen_state_kernel[(N, triton.cdiv(C, 1024))](
        rows, state, new, cu, C, rows.stride(0), HAS_STATE=state is not None, W=W, BLOCK_C=1024)
    return y.view(parts, B, T, C // parts), new


@compile_disabled("fla-core's Triton conv kernels run as they are")
def _conv_fla(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
              cu_seqlens: torch.Tensor | None,
              cu_seqlens_cpu: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv
    from fla.modules.causal_conv1d import causal_conv1d_update

    B, T, C = x.shape
    W = weight.shape[-1]
    weight_CW = weight[:, 0]                                         # fla's layout: [C, W]
    state = None if conv_state is None else F.pad(conv_state.to(x.dtype), (1, 0))  # [N, C, W]
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, conv_state))
    # The update kernel has no backward, so a training step of one token takes the full kernel.
    if T == 1 and cu_seqlens is None and not needs_grad:
        if state is None:
            state = x.new_zeros(B, C, W)
        y, state = causal_conv1d_update(x, state, weight=weight_CW, activation="silu")  # in place
    else:
        y, state = fla_conv(x, weight_CW, initial_state=state, output_final_state=True,
                            activation="silu", cu_seqlens=cu_seqlens,
                            cu_seqlens_cpu=cu_seqlens_cpu)
    return y, state[..., 1:]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None,
                  cu_seqlens: torch.Tensor | None = None,
                  cu_seqlens_cpu: torch.Tensor | None = None, *, parts: int = 1,
                  backend: str = "auto") -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
    """Depthwise causal convolution followed by SiLU, y in x.dtype (KDA's short conv on q, k, v).

    Args:
        x: ``[B, T, C]``; C may be several tensors' channels side by side (q|k|v).
        weight: ``[C, 1, W]`` (checkpoint layout, e.g. ``q_conv1d.weight`` ``[H*128, 1, 4]``).
        conv_state: ``[B, C, W-1]``, the W-1 inputs before ``x`` (zeros when None).
        cu_seqlens: packed variable-length input: ``x`` is ``[1, sum T_i, C]`` holding N
            sequences at ``[cu_seqlens[i], cu_seqlens[i+1])``; conv_state is then ``[N, C, W-1]``.
        cu_seqlens_cpu: the same offsets on the host, if the caller has them: fla then reads
            the sequence lengths without waiting for the GPU.
        parts: x's channels are this many tensors side by side (q|k|v: 3); y is then a tuple of
            them, ``[B, T, C / parts]`` each (contiguous from openk3's varlen kernel, which
            writes them apart: fla's KDA copied the three column slices, ~80 us each per `small`
            layer at 32K tokens; views of one y otherwise).
        backend: ``"fla"`` runs fla-core's Triton kernels, ``"triton"`` openk3's (training's
            case: no state, no cu_seqlens, 4 taps; or, without autograd, a state or
            cu_seqlens: the serving prefill), ``"torch"`` the reference; ``"auto"`` picks
            openk3's for such CUDA inputs, else fla when it imports (unless
            ``OPENK3_REFERENCE=1``).

    Returns:
        y ``[B, T, C]`` (``parts`` tensors with ``parts``) and the new conv_state ``[B, C, W-1]``
        (``[N, C, W-1]`` with cu_seqlens) in x.dtype: the last W-1 inputs, reaching into the old
        state when T < W-1.

    Example::

        >>> x, weight, state = torch.randn(2, 7, 6), torch.randn(6, 1, 4), torch.zeros(2, 6, 3)
        >>> y, state = causal_conv1d(x, weight, state)
        >>> y.shape, state.shape, torch.equal(state, x[:, -3:].transpose(1, 2))
        (torch.Size([2, 7, 6]), torch.Size([2, 6, 3]), True)
    """
    if backend not in ("auto", "torch", "fla", "triton"):
        raise ValueError(f"`backend` must be 'auto', 'torch', 'fla' or 'triton', got {backend!r}")
    _validate(x, weight, conv_state, cu_seqlens)
    if parts < 1 or x.shape[-1] % parts:
        raise ValueError(f"`parts` must divide the {x.shape[-1]} channels, got {parts}")
    varlen = conv_state is not None or cu_seqlens is not None
    grad = needs_grad(x, weight, conv_state)
    if backend == "auto":
        one_step = x.shape[1] == 1 and cu_seqlens is None  # fla's update kernel: one launch
        if (use_fast_path(x) and importable(_CONV_TRITON)
                and (not grad and not one_step if varlen else weight.shape[-1] == TRITON_WIDTH)):
            backend = "triton"
        else:
            backend = "fla" if use_fast_path(x) and importable(_FLA_CONV) else "torch"
    if backend == "triton":
        if varlen and grad:
            raise ValueError("backend='triton' with `conv_state` or `cu_seqlens` has no backward (the "
                             "serving prefill's case); use 'fla' or 'auto'")
        if not varlen and weight.shape[-1] != TRITON_WIDTH:
            raise ValueError(f"backend='triton' is written for {TRITON_WIDTH} taps, `weight` has "
                             f"{weight.shape[-1]}; use 'fla' or 'auto'")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' needs CUDA tensors, got x on {x.device}")
        if varlen:
            y, state = _conv_varlen_triton(x, weight, conv_state, cu_seqlens, parts)
            return (tuple(y) if parts > 1 else y[0]), state
        y = _conv_triton(x, weight)
        # the state after x: its last W-1 inputs (zeros in front of a shorter x), copied: a view
        # would keep all of x (a layer's whole projection output) alive as long as the state
        state = x[:, max(x.shape[1] - (TRITON_WIDTH - 1), 0):].transpose(1, 2).contiguous()
        if x.shape[1] < TRITON_WIDTH - 1:
            state = F.pad(state, (TRITON_WIDTH - 1 - x.shape[1], 0))
        return _split(y, parts), state
    if backend == "fla":
        if not x.is_cuda:
            raise ValueError(f"backend='fla' needs CUDA tensors, got x on {x.device}")
        if not importable(_FLA_CONV):
            raise ValueError("backend='fla' needs fla-core and triton: pip install 'openk3[gpu]'")
        y, state = _conv_fla(x, weight, conv_state, cu_seqlens, cu_seqlens_cpu)
        return _split(y, parts), state
    y, state = _conv_torch(x, weight, conv_state, cu_seqlens)
    return _split(y, parts), state


def _split(y: torch.Tensor, parts: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return y.split(y.shape[-1] // parts, dim=-1) if parts > 1 else y


def _pooled_backend(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                    parts: int, backend: str) -> str:
    """The backend of a call on pool rows (``causal_conv1d_update_``, ``causal_conv1d_pooled``),
    after checking the arguments: x ``[B, ..., C]`` (its rank checked by the caller)."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"`backend` must be 'auto', 'torch' or 'triton', got {backend!r}")
    B, C = x.shape[0], x.shape[-1]
    if weight.dim() != 3 or weight.shape[:2] != (C, 1) or weight.shape[-1] < 2:
        raise ValueError(f"`weight` must be [C, 1, W] with C = {C} and W >= 2, got {list(weight.shape)}")
    W = weight.shape[-1]
    if pool.dim() != 3 or pool.shape[1:] != (C, W - 1) or not pool.is_contiguous():
        raise ValueError(f"`pool` must be a contiguous [n, C, W-1] = [n, {C}, {W - 1}], got "
                         f"{list(pool.shape)}{'' if pool.is_contiguous() else ' (not contiguous)'}")
    if slots.shape != (B,) or slots.dtype.is_floating_point:
        raise ValueError(f"`slots` must be [B] = [{B}] integers, got {slots.dtype} {list(slots.shape)}")
    if parts < 1 or C % parts:
        raise ValueError(f"`parts` must divide the {C} channels, got {parts}")
    for name, t in (("weight", weight), ("pool", pool), ("slots", slots)):
        if t.device != x.device:
            raise ValueError(f"`{name}` is on {t.device}, x on {x.device}")
    if backend == "auto":
        return "triton" if use_fast_path(x) else "torch"
    return backend


def causal_conv1d_update_(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                          slots: torch.Tensor, *, parts: int = 1, backend: str = "auto") -> torch.Tensor:
    """One token per row through the convolution, its state read from and written back to rows
    ``slots`` of ``pool`` in place (the serving decode step: no gather or scatter around it).

    Args:
        x: ``[B, C]``, the token's inputs (C may be q|k|v side by side); a row stride is fine.
        weight: ``[C, 1, W]``, W >= 2.
        pool: ``[n, C, W-1]`` contiguous states (the W-1 inputs before each row's token, oldest
            first); rows ``slots[b]`` are read, then replaced by the state after the token.
        slots: ``[B]`` integer rows of ``pool``, distinct (a repeated slot is a race, as in an
            ``index_copy_``: only a scratch row may repeat).
        parts: the channels are this many tensors side by side (q|k|v: 3), each returned
            contiguous.
        backend: ``"triton"`` (CUDA), ``"torch"`` the reference, ``"auto"`` Triton on CUDA
            (unless ``OPENK3_REFERENCE=1``).

    Returns:
        y ``[parts, B, C / parts]`` in x.dtype: ``silu`` of the convolution, as ``causal_conv1d``
        gives for T = 1, part by part (``y[i]`` holds channels ``i*C/parts ..``).

    Example::

        >>> x, weight, pool = torch.randn(2, 6), torch.randn(6, 1, 4), torch.randn(5, 6, 3)
        >>> want, new = causal_conv1d_ref(x[:, None], weight, pool[[4, 1]])
        >>> q, k, v = causal_conv1d_update_(x, weight, pool, torch.tensor([4, 1]), parts=3)
        >>> torch.equal(torch.cat([q, k, v], -1), want[:, 0]), torch.equal(pool[[4, 1]], new)
        (True, True)
    """
    if x.dim() != 2:
        raise ValueError(f"`x` must be [B, C], got {list(x.shape)}")
    B, C = x.shape
    if _pooled_backend(x, weight, pool, slots, parts, backend) == "triton":
        return _conv_update_triton(x, weight, pool, slots, parts)
    y, state = causal_conv1d_ref(x[:, None], weight, pool.index_select(0, slots))
    pool.index_copy_(0, slots, state.to(pool.dtype))
    return y[:, 0].view(B, parts, C // parts).transpose(0, 1).contiguous()


@compile_disabled("a Triton kernel that updates the pool in place")
def _conv_update_triton(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                        slots: torch.Tensor, parts: int = 1) -> torch.Tensor:
    from openk3.ops.conv_triton import conv_update_kernel

    B, C = x.shape
    W = weight.shape[-1]
    if x.stride(-1) != 1:
        raise ValueError("`x` needs a contiguous last dimension")
    y = torch.empty(parts, B, C // parts, device=x.device, dtype=x.dtype)
    block = 1024
    conv_update_kernel[(B, -(-C // block))](x, weight.reshape(C, W).contiguous(), pool, slots.contiguous(), y,
                                           B, C, C // parts, x.stride(0), pool.stride(0), W=W, BLOCK_C=block)
    return y


def causal_conv1d_pooled(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, *,
                         parts: int = 1, backend: str = "auto") -> torch.Tensor:
    """T tokens per row through the convolution after the states in rows ``slots`` of ``pool``,
    which are read and not written (the speculative verify step, whose rollback writes the state
    once it knows how many tokens stay: ``openk3.ops.kda.conv_state_rollback``).

    Args:
        x: ``[B, T, C]``, the tokens' inputs (C may be q|k|v side by side); row strides are fine.
        weight: ``[C, 1, W]``, W >= 2.
        pool: ``[n, C, W-1]`` contiguous states (the W-1 inputs before each row's first token).
        slots: ``[B]`` integer rows of ``pool`` (repeats allowed: nothing is written).
        parts: the channels are this many tensors side by side, each returned contiguous.
        backend: ``"triton"`` (CUDA), ``"torch"`` the reference, ``"auto"`` Triton on CUDA
            (unless ``OPENK3_REFERENCE=1``).

    Returns:
        y ``[parts, B, T, C / parts]`` in x.dtype: what ``causal_conv1d`` gives from the gathered
        states, part by part.

    Example::

        >>> x, weight, pool = torch.randn(2, 5, 6), torch.randn(6, 1, 4), torch.randn(3, 6, 3)
        >>> want, _ = causal_conv1d_ref(x, weight, pool[[2, 0]])
        >>> y = causal_conv1d_pooled(x, weight, pool, torch.tensor([2, 0]), parts=3)
        >>> y.shape, torch.equal(torch.cat(tuple(y), -1), want)
        (torch.Size([3, 2, 5, 2]), True)
    """
    if x.dim() != 3:
        raise ValueError(f"`x` must be [B, T, C], got {list(x.shape)}")
    B, T, C = x.shape
    if _pooled_backend(x, weight, pool, slots, parts, backend) == "triton":
        return _conv_pooled_triton(x, weight, pool, slots, parts)
    y, _ = causal_conv1d_ref(x, weight, pool.index_select(0, slots))
    return y.view(B, T, parts, C // parts).permute(2, 0, 1, 3).contiguous()


@compile_disabled("a Triton kernel that reads the pool in place")
def _conv_pooled_triton(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                        parts: int) -> torch.Tensor:
    from openk3.ops.conv_triton import conv_pooled_kernel

    B, T, C = x.shape
    W = weight.shape[-1]
    if x.stride(-1) != 1:
        raise ValueError("`x` needs a contiguous last dimension")
    y = torch.empty(parts, B, T, C // parts, device=x.device, dtype=x.dtype)
    block = 1024
    conv_pooled_kernel[(B * T, -(-C // block))](
        x, weight.reshape(C, W).contiguous(), pool, slots.contiguous(), y, B * T, T, C, C // parts, x.stride(0),
        x.stride(1), pool.stride(0), W=W, BLOCK_C=block)
    return y
