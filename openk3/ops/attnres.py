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
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from openk3.ops.fast import compile_disabled, importable, needs_grad, use_fast_path
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
    if fast and out_norm_weight is not None and not needs_grad(*sources, query, norm_weight, out_norm_weight):
        return _attn_res_agg_fla(sources, query, norm_weight, eps, out_norm_weight)
    agg = (_attn_res_agg_fla if fast else attn_res_agg_ref)(sources, query, norm_weight, eps)
    return agg if out_norm_weight is None else rms_norm(agg, out_norm_weight, eps)
