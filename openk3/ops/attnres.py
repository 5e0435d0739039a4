"""Block Attention Residuals aggregation (K3_SPEC §1.7).

``agg(sources) = sum_i softmax_i(<RMSNorm(V_i), w * q>) V_i``

* ``sources`` V: the sealed block bank plus the live partial sum, each ``[B, T, D]``.
* ``query`` q: the layer's pseudo-query (``*_res_proj.weight[0]``), ``[D]``;
  ``norm_weight`` w: the key norm's weight (``*_res_norm.weight``), folded into the query.
* The key RMSNorm has no weight of its own and uses ``eps = rms_norm_eps``; keys, logits,
  softmax and the weighted sum are all fp32; the values are the *un-normalised* sources;
  the result is cast once to the sources' dtype.
Sources of mixed dtypes (a caller's fp32 tensor beside bf16 layer outputs; the model itself
casts the embedding into the bank once under autocast) are first cast to the autocast dtype, or
else to their promoted dtype.
With a zero query the softmax is uniform and ``agg`` is the mean of the sources.

Fast path (CUDA): fla-core's ``fused_attnres``, whose math is exactly this when called without
its fused output norm (checked in tests/ops/test_attnres.py against its naive reference and on
the device against the fused kernel). ``torch.compile`` calls it as it is (a graph break
around it) instead of tracing it.

``out_norm_weight``: the RMSNorm that follows every AttnRes read in the decoder (the layer's
``input_layernorm`` / ``post_attention_layernorm``, the model's final ``norm``), applied to the
result: ``rms_norm(agg, out_norm_weight, eps)`` (``openk3.ops.norm``: normalised in fp32, cast,
then weighted). Without autograd on CUDA fla's kernel applies it before its single cast (its
``output_rms_weight``: normalised and weighted in fp32, one rounding instead of two, and one
kernel instead of two per read); otherwise the two ops run one after the other.

Sealed bank entries (``seal``): a block's output is read by every later layer, twice, and autograd
would sum the reads' gradients for it one add kernel at a time (with the live sums' adds, 253
adds and 6.0 ms of `small`'s training step on an H200; 141 and 3.4 ms with sealing, eighteenth
session, docs/benchmarks.md). ``seal(t)`` returns t behind an identity node and
gives it an accumulator; a read with autograd then adds its gradient for each sealed source into
that accumulator (on CUDA inside its backward kernel, ``attnres_triton.py``) and returns none for
it, and the identity node's backward hands the sum on. Autograd runs that node only after every
read of the entry: a read that returns no gradient for an input still counts as its consumer. A
source that is not the sealed tensor itself (a copy, a cast) gets its gradient returned as usual.
The accumulator has the entry's dtype (bf16 in training), as autograd's own sum has. A gradient
asked of the sealed tensor itself (``torch.autograd.grad(..., inputs=[entry])``, a hook on it)
sees only its consumers that are not reads; the tensor it was sealed from gets the whole sum.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import torch

from openk3.ops.fast import compile_disabled, importable, launch_device, needs_grad, use_fast_path
from openk3.ops.norm import rms_norm


def attn_res_agg_ref(sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """sources: S tensors [..., D]; query, norm_weight: [D]. Returns [..., D] in sources' dtype."""
    v = torch.stack(tuple(sources)).float()  # [S, ..., D]
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    logits = (keys * (norm_weight.float() * query.float())).sum(-1)  # [S, ...]
    weights = torch.softmax(logits, dim=0)
    return (weights.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)


@compile_disabled("fla-core's Triton AttnRes kernel runs as it is")
def _attn_res_agg_fla(sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float, out_norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    from fla.ops.attnres import fused_attnres

    return fused_attnres(query, list(sources), norm_weight, output_rms_weight=out_norm_weight, rms_eps=eps)


# the backward kernel (attnres_triton.py): rows per program (its dqw leaves as N / BWD_ROWS
# partial sums [D], fp32), the most elements of one tile of sources, warps per program
BWD_ROWS = 8
BWD_TILE = 8192
BWD_WARPS = 4
_BANK_GRAD = "_openk3_bank_grad"  # the attribute of a sealed tensor holding its accumulator


class _BankGrad:
    """The summed gradient of one sealed bank entry, filled by its reads' backwards."""

    __slots__ = ("grad",)

    def __init__(self):
        self.grad: torch.Tensor | None = None


class _Seal(torch.autograd.Function):
    """Identity; its backward adds the accumulated reads' gradient to whatever else reached it."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, acc: _BankGrad) -> torch.Tensor:
        ctx.acc = acc
        ctx.set_materialize_grads(False)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor | None):
        acc, ctx.acc.grad = ctx.acc.grad, None
        if acc is None:
            return g, None
        return (acc if g is None else acc + g), None


def seal(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a sealed bank entry whose reads accumulate its gradient (module docstring); ``t``
    itself when autograd would not record it (inference)."""
    if not needs_grad(t):
        return t
    acc = _BankGrad()
    out = _Seal.apply(t, acc)
    setattr(out, _BANK_GRAD, acc)
    return out


class _AccumulatingRead(torch.autograd.Function):
    """``attn_res_agg_ref`` (or fla's forward kernel); the backward adds the gradients of the
    sources that have an accumulator (``accs[i]``) into it and returns None for them."""

    @staticmethod
    def forward(ctx, query, norm_weight, eps, fast, accs, *sources):
        ctx.eps, ctx.fast, ctx.accs = eps, fast, accs
        if not fast:
            ctx.save_for_backward(query, norm_weight, *sources)
            return attn_res_agg_ref(sources, query, norm_weight, eps)
        build_ptr_table, fused_attnres_fwd = _fla_forward()
        flat = [s.reshape(-1, s.shape[-1]).contiguous() for s in sources]
        o, _, rstd, logit, lse = fused_attnres_fwd(q=query, residuals=flat, res=build_ptr_table(flat),
                                                   w=norm_weight, ow=None, eps=eps, scale=1.0,
                                                   checkpoint_level=1)
        ctx.save_for_backward(query, norm_weight, rstd, logit, lse, *flat)
        return o.view(sources[0].shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        if ctx.fast:
            query, norm_weight, rstd, logit, lse, *sources = ctx.saved_tensors
            accumulate = [a is not None and a.grad is not None for a in ctx.accs]
            grads = [a.grad if add else torch.empty_like(s) for s, a, add in zip(sources, ctx.accs, accumulate)]
            dq, dw = _bwd_triton(g, query, norm_weight, rstd, logit, lse, sources, grads, accumulate)
            grads = [d.view(g.shape) for d in grads]
        else:
            query, norm_weight, *sources = ctx.saved_tensors
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (query, norm_weight, *sources)]
                out = attn_res_agg_ref(leaves[2:], leaves[0], leaves[1], ctx.eps)
                dq, dw, *grads = torch.autograd.grad(out, leaves, g)
            for i, a in enumerate(ctx.accs):
                if a is not None and a.grad is not None:
                    grads[i] = a.grad.add_(grads[i])
        for i, a in enumerate(ctx.accs):
            if a is not None:
                a.grad, grads[i] = grads[i], None
        return (dq, dw, None, None, None, *grads)


def _bwd_triton(g, query, norm_weight, rstd, logit, lse, sources, grads, accumulate):
    """Launch ``attnres_bwd_kernel``: fills ``grads`` (flat [N, D], added into where
    ``accumulate``); returns the query's and the norm weight's gradients."""
    import triton

    from openk3.ops.attnres_triton import attnres_bwd_kernel

    N, D = sources[0].shape
    partial = torch.empty(triton.cdiv(N, BWD_ROWS), D, device=g.device, dtype=torch.float32)
    acc_mask = sum(1 << i for i, a in enumerate(accumulate) if a)
    bd = triton.next_power_of_2(D)
    # all sources in one tile (read once) while it stays within BWD_TILE elements
    bl = max(1, min(triton.next_power_of_2(len(sources)), BWD_TILE // bd))
    with launch_device(g):
        attnres_bwd_kernel[(partial.shape[0],)](
            query, norm_weight, tuple(sources), tuple(grads), rstd, logit, lse,
            g.reshape(N, D).contiguous(), partial, N, D=D, BD=bd, L=len(sources), BL=bl,
            ACC=acc_mask, ROWS=BWD_ROWS, num_warps=BWD_WARPS)
    dqw = partial.sum(0)
    return (dqw * norm_weight.float()).to(query.dtype), (dqw * query.float()).to(norm_weight.dtype)


@functools.cache
def _fla_forward():
    """fla-core's forward kernel wrapper and pointer table (module-level functions of
    ``fla.ops.attnres.fused`` in fla-core 0.6.0, not its public API), or None where a later
    fla-core moved them: the sealed reads then give way to the plain ones, with a warning."""
    try:
        from fla.ops.attnres.fused import _build_ptr_table, fused_attnres_fwd
    except ImportError as e:
        warnings.warn(f"openk3: fla-core's AttnRes forward internals are missing ({e}); the bank's "
                      "gradients are summed by autograd (slower)", stacklevel=2)
        return None
    return _build_ptr_table, fused_attnres_fwd


@compile_disabled("a read of sealed bank entries accumulates their gradients in its backward")
def _sealed_read(sources, query, norm_weight, eps, fast) -> torch.Tensor | None:
    """The accumulating read when a source is sealed (``seal``), else None. An entry given twice
    accumulates through its first place only (the other's gradient is returned as usual)."""
    accs, seen = [], set()
    for s in sources:
        a = getattr(s, _BANK_GRAD, None)
        accs.append(None if id(a) in seen else a)
        seen.add(id(a))
    if all(a is None for a in accs) or fast and _fla_forward() is None:
        return None
    return _AccumulatingRead.apply(query, norm_weight, eps, fast, tuple(accs), *sources)


def attn_res_agg(sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, out_norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Aggregate ``S >= 1`` sources of equal shape ``[..., D]``; with ``out_norm_weight`` [D],
    RMSNorm the result with it (same ``eps``; see the module docstring)."""
    if not sources:
        raise ValueError("attn_res_agg: needs at least one source")
    D = sources[0].shape[-1]
    if any(s.shape != sources[0].shape for s in sources) or query.shape != (D,) or norm_weight.shape != (D,):
        raise ValueError(f"attn_res_agg: sources {[tuple(s.shape) for s in sources]} must share one "
                         f"shape [..., D]; query {tuple(query.shape)} and norm_weight "
                         f"{tuple(norm_weight.shape)} must be [D]")
    if out_norm_weight is not None and out_norm_weight.shape != (D,):
        raise ValueError(f"attn_res_agg: out_norm_weight {tuple(out_norm_weight.shape)} must be [D] = ({D},)")
    if len({s.dtype for s in sources}) > 1:
        dev = sources[0].device.type
        dtype = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                 else functools.reduce(torch.promote_types, (s.dtype for s in sources)))
        sources = [s.to(dtype) for s in sources]
    fast = use_fast_path(sources[0]) and importable("fla.ops.attnres")
    grad = needs_grad(*sources, query, norm_weight, out_norm_weight)
    if fast and out_norm_weight is not None and not grad:
        return _attn_res_agg_fla(sources, query, norm_weight, eps, out_norm_weight)
    agg = _sealed_read(sources, query, norm_weight, eps, fast) if grad else None
    if agg is None:
        agg = (_attn_res_agg_fla if fast else attn_res_agg_ref)(sources, query, norm_weight, eps)
    return agg if out_norm_weight is None else rms_norm(agg, out_norm_weight, eps)
