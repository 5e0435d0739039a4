"""Routed experts for a few tokens, as GEMVs (K3_SPEC §1.4-1.5): the decode path of the MoE.

For every (token, slot) pair p with expert e_p = topk_idx[t, j] and weight w_p:

    h_p = act(W1[e_p] x_t, W3[e_p] x_t)            act: SiTU-GLU (K3) or SwiGLU (Kimi Linear), fp32
    y_t = sum_j w_p W2[e_p] h_p                    fp32, summed over the token's k pairs in order

Each pair reads its expert's weights by id: no sort of the pairs by expert, no per-expert
counts, no grouped matmul. At a handful of tokens that machinery is all launch overhead (the
sorted path runs some 18 kernels per layer); here it is three kernels (gate/up, down, the sum
over the k slots), with static shapes and no host synchronisation, so a CUDA graph captures them.

* ``moe_gemv_ref``: plain PyTorch (each pair's expert gathered, ``torch.bmm``), the reference.
* ``moe_gemv``: the entry point; Triton kernels (``openk3.ops.moe_kernels``) on CUDA.
* ``use_moe_gemv``: whether ``RoutedExperts`` takes this path (``GEMV_MAX_PAIRS``).

Inference only: no autograd (training keeps the grouped path).

Floor, bf16 weights at 4.3 TB/s: a pair reads 3 F D x 2 bytes (its expert's W1, W3, W2).

| layer (E, k, F, D) | per pair | 1 token | 32 tokens, per pair | 32 tokens, used experts once |
|---|---|---|---|---|
| ``small`` (64, 4, 256, 512) | 0.79 MB | 3.1 MB: 0.73 us | 101 MB: 23.4 us | ~55.9: 44 MB, 10.2 us |
| ``k3`` (896, 16, 3072, 3584) | 66.1 MB | 1.06 GB: 246 us | 33.8 GB: 7.87 ms | ~392.6: 25.9 GB, 6.03 ms |

(expected experts used under uniform routing: E (1 - (1 - k/E)^N).) At one token the k experts
are distinct, so the kernels' traffic is the floor. Pairs that share an expert read it again;
the kernels put the pairs on the fastest grid axis so that such reads run at about the same
time and can hit L2 (all 64 ``small`` experts, 50 MB, about fill the H200's). Where the repeated
reads cost more than the grouped path's fixed overhead is ``GEMV_MAX_PAIRS``.

Example::

    >>> E, F, D, N, k = 5, 48, 40, 3, 2
    >>> x = torch.randn(N, D)
    >>> w1, w3, w2 = torch.randn(E, F, D), torch.randn(E, F, D), torch.randn(E, D, F)
    >>> topk_idx, topk_weight = torch.rand(N, E).topk(k).indices, torch.rand(N, k)
    >>> y = moe_gemv(x, w1, w3, w2, topk_idx, topk_weight, hidden_act="situ",
    ...              situ_beta1=4.0, situ_beta2=25.0)
    >>> y.shape, y.dtype
    (torch.Size([3, 40]), torch.float32)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from openk3.ops.fast import needs_grad, use_fast_path
from openk3.ops.situ import situ_glu_ref, swiglu_ref

# The most (token, expert) pairs that take the GEMV path in RoutedExperts: above it the grouped
# path (group_pairs and the grouped Triton kernels: each used expert read once) wins.
# benchmarks/moe_decode_bench.py on one H200 (twenty-fifth session, docs/benchmarks.md), GEMVs
# against grouped: `small` 23.7 vs 32.9 us at 64 pairs, 38.1 vs 34.1 at 128, 95.1 vs 43.2 at
# 512; K3 331 vs 471 us at 16 pairs, 2.34 vs 1.94 ms at 128. (It was 512 while the grouped path
# was grouped_mm behind a sort: 92 vs 114 us at 512 pairs of `small`.) 64 pairs is 16 decode
# tokens of `small` (k = 4) and 4 of K3 (k = 16).
GEMV_MAX_PAIRS = 64
# The most pairs that ``group_pairs`` orders with its Triton kernels rather than a sort: as many
# as their tiles hold for 64 experts. benchmarks/moe_route_bench.py on the H200 (docs/benchmarks.md,
# twenty-fourth session): 10.3 against 36.3 us at 4,096 pairs, 19.5 against 60.6 at 65,536.
ROUTE_MAX_PAIRS = 65536
# The most pairs whose grouped experts run as openk3's Triton kernels (``moe_grouped_triton``:
# the GLU inside the gate/up kernel, no pointer-preparing launches) rather than ``grouped_mm``:
# they win at 16,384 pairs and lose at 65,536 (the same benchmark).
GROUPED_TRITON_MAX_PAIRS = 16384


def sort_pairs(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs of ``topk_idx`` [N, k] sorted by expert: ``order`` (flat pair
    indices, stable), each sorted pair's token, and the pairs per expert [num_experts] (a
    ``scatter_add_``, not ``bincount``: no host sync, so decode steps can be CUDA graphs)."""
    flat_idx = topk_idx.reshape(-1)
    # 16-bit keys: a radix sort passes over the key's bits (cub: 8 bits a pass), and expert ids
    # need far fewer than int64's 64 (the sort was 0.8 ms of a 1,024-token prefill of `small`)
    keys = flat_idx.to(torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32)
    order = keys.argsort(stable=True)
    counts = flat_idx.new_zeros(num_experts).scatter_add_(0, flat_idx, torch.ones_like(flat_idx))
    return order, order // topk_idx.shape[1], counts


def group_pairs(topk_idx: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sort_pairs``' expert order as the grouped experts read it: (``position`` [N k] the row
    of each flat (token, choice) pair, ``token_of_row`` [N k] each row's token, ``counts`` [E]
    the rows per expert, ``ends`` [E] int32 their running sums: ``grouped_mm``'s offsets).

    On CUDA, up to ``ROUTE_MAX_PAIRS`` pairs where the kernels' tiles fit (``route_fits``: up to
    65,536 pairs of 64 experts), two Triton kernels (``group_pairs_triton``: a histogram per
    block of pairs, then each pair's row from the histograms and its rank in its block) instead
    of some ten kernels around a radix sort (cast, sort, counts by ``scatter_add_``, the
    tokens, ``cumsum``, the inverse permutation: ~45 us of a 1,024-token pass's MoE layer).
    The same permutation, so the same results bit for bit. Only without autograd (serving):
    training's ``RoutedExperts`` is a compiled region (``openk3.parallel.compile``), which
    traces the sort."""
    P = topk_idx.numel()
    if use_fast_path(topk_idx) and not torch.is_grad_enabled() and P <= ROUTE_MAX_PAIRS and triton_available():
        from openk3.ops.moe_kernels import group_pairs_triton, route_fits

        if route_fits(P, num_experts):
            return group_pairs_triton(topk_idx, num_experts)
    order, token_of_row, counts = sort_pairs(topk_idx, num_experts)
    return inverse_order(order), token_of_row, counts, counts.cumsum(0).to(torch.int32)


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The position of each index in the permutation ``order``."""
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    return position


def combine_pairs(ys: torch.Tensor, order: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """``combine_rows`` of expert outputs ``ys`` [N * k, D] for the flat (token, choice) pairs in
    ``order`` (``ys[i]`` is flat pair ``order[i]``)."""
    return combine_rows(ys, inverse_order(order), topk_weight)


def combine_rows(ys: torch.Tensor, position: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """Each token's weighted sum ``sum_j w_j y_j``, fp32 [N, D], of the experts' outputs
    ``ys`` [N * k, D]: flat pair p = (token, choice) is row ``position[p]``; ``topk_weight`` [N, k].

    The rows go back to token order (a gather) and each token's k are summed in choice order: the
    same sum at every run. ``index_add_`` onto the tokens summed them with fp32 atomics in a
    different order from run to run (24 distinct results of 24 for k = 4 on the H200, eighteenth
    session: ``benchmarks/determinism.py ops``).

    Without autograd on CUDA one Triton kernel (``combine_pairs_triton``) gathers, weighs and
    sums in fp32 in the same order, reading ``ys`` once: the gather, cast, product and sum were
    ~0.4 ms of a 32K-token prefill's MoE layer (issue P8)."""
    N, k = topk_weight.shape
    if use_fast_path(ys) and triton_available() and not needs_grad(ys, topk_weight) and ys.stride(-1) == 1:
        from openk3.ops.moe_kernels import combine_pairs_triton

        return combine_pairs_triton(ys, position, topk_weight)
    return (ys[position].view(N, k, -1).float() * topk_weight.unsqueeze(-1)).sum(1)


@functools.cache
def triton_available() -> bool:
    """Whether the Triton kernels import (CPU installs have no triton)."""
    try:
        import openk3.ops.moe_kernels  # noqa: F401
    except ImportError:
        return False
    return True


def use_grouped_triton(num_pairs: int) -> bool:
    """Whether ``run_experts`` (no autograd, no QAT, bf16 on CUDA) takes openk3's grouped Triton
    kernels for ``num_pairs`` expert-sorted rows."""
    return num_pairs <= GROUPED_TRITON_MAX_PAIRS and triton_available()


def use_moe_gemv(x: torch.Tensor, num_pairs: int) -> bool:
    """Whether ``num_pairs`` (token, expert) pairs of ``x`` run as GEMVs (Triton on CUDA)."""
    return num_pairs <= GEMV_MAX_PAIRS and use_fast_path(x) and triton_available()


def _glu_fp32(gate: torch.Tensor, up: torch.Tensor, hidden_act: str, situ_beta1: float,
              situ_beta2: float) -> torch.Tensor:
    if hidden_act == "situ":
        return situ_glu_ref(gate.float(), up.float(), situ_beta1, situ_beta2)
    return swiglu_ref(gate.float(), up.float())


def moe_gemv_ref(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                 topk_idx: torch.Tensor, topk_weight: torch.Tensor, *, hidden_act: str,
                 situ_beta1: float, situ_beta2: float,
                 quant_inputs: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``moe_gemv`` in plain PyTorch, all math in fp32. It gathers every pair's expert weights
    ([N k, F, D] each): reference-sized inputs only. Arguments as ``moe_gemv``'s;
    ``quant_inputs`` (e.g. ``openk3.ops.mx.fake_quant_mxfp8_e4m3``) rounds x and the GLU output
    before the projections they enter."""
    quant = quant_inputs or (lambda t: t)
    N, k = topk_idx.shape
    experts = topk_idx.reshape(-1)                                    # [P], P = N k
    x_P = quant(x.float()).repeat_interleave(k, dim=0)[:, :, None]    # [P, D, 1]
    gate = torch.bmm(w1[experts].float(), x_P)[..., 0]                # [P, F]
    up = torch.bmm(w3[experts].float(), x_P)[..., 0]
    h = quant(_glu_fp32(gate, up, hidden_act, situ_beta1, situ_beta2))  # [P, F] fp32
    y_P = torch.bmm(w2[experts].float(), h[:, :, None])[..., 0]       # [P, D]
    return (y_P * topk_weight.reshape(-1, 1).float()).view(N, k, -1).sum(1)


def _validate(x, w1, w3, w2, topk_idx, topk_weight, hidden_act) -> None:
    if x.dim() != 2:
        raise ValueError(f"`x` must be [N, D], got {list(x.shape)}")
    N, D = x.shape
    if w1.dim() != 3 or w1.shape[2] != D:
        raise ValueError(f"`w1` must be [E, F, D] with D = {D}, got {list(w1.shape)}")
    E, F, _ = w1.shape
    if w3.shape != w1.shape or w3.stride() != w1.stride():
        raise ValueError(f"`w3` must be laid out like w1 {list(w1.shape)} (strides "
                         f"{w1.stride()}), got {list(w3.shape)} (strides {w3.stride()})")
    if w2.shape != (E, D, F):
        raise ValueError(f"`w2` must be [E, D, F] = {[E, D, F]}, got {list(w2.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != N:
        raise ValueError(f"`topk_idx` must be [N, k] with N = {N}, got {list(topk_idx.shape)}")
    if topk_idx.is_floating_point() or topk_idx.is_complex() or topk_idx.dtype == torch.bool:
        raise ValueError(f"`topk_idx` must hold integer expert ids, got {topk_idx.dtype}")
    if topk_weight.shape != topk_idx.shape:
        raise ValueError(f"`topk_weight` must be [N, k] = {list(topk_idx.shape)}, "
                         f"got {list(topk_weight.shape)}")
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2), ("topk_idx", topk_idx),
                    ("topk_weight", topk_weight)):
        if t.device != x.device:
            raise ValueError(f"`{name}` is on {t.device}, x on {x.device}")
    if hidden_act not in ("situ", "silu"):
        raise ValueError(f"`hidden_act` must be 'situ' or 'silu', got {hidden_act!r}")
    if needs_grad(x, w1, w3, w2, topk_weight):
        raise ValueError("moe_gemv has no backward: call it under torch.no_grad() (training "
                         "takes RoutedExperts' sorted path)")


def moe_gemv(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
             topk_idx: torch.Tensor, topk_weight: torch.Tensor, *, hidden_act: str,
             situ_beta1: float, situ_beta2: float, backend: str = "auto") -> torch.Tensor:
    """Routed experts of a few tokens, each (token, slot) pair reading its expert by id.

    Args:
        x: ``[N, D]`` token activations (any float dtype).
        w1, w3: ``[E, F, D]`` gate and up projections of the E experts (same layout).
        w2: ``[E, D, F]`` down projections.
        topk_idx: ``[N, k]`` integer expert ids, each in ``[0, E)``.
        topk_weight: ``[N, k]`` routing weights.
        hidden_act: ``"situ"`` (SiTU-GLU with ``situ_beta1``, ``situ_beta2``) or ``"silu"``
            (SwiGLU; the betas are unused).
        backend: ``"triton"`` runs the Triton kernels (CUDA), ``"torch"`` the reference,
            ``"auto"`` picks Triton for CUDA inputs when it imports (unless
            ``OPENK3_REFERENCE=1``).

    Returns:
        ``[N, D]`` fp32: ``sum_j topk_weight[t, j] E_{topk_idx[t, j]}(x_t)``. Weights are read
        in their dtype; products, the activation and all sums are fp32. Deterministic.

    No autograd: inputs that need gradients are refused.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"`backend` must be 'auto', 'torch' or 'triton', got {backend!r}")
    _validate(x, w1, w3, w2, topk_idx, topk_weight, hidden_act)
    act = dict(hidden_act=hidden_act, situ_beta1=situ_beta1, situ_beta2=situ_beta2)
    if backend == "auto":
        backend = "triton" if use_fast_path(x) and triton_available() else "torch"
    if backend == "torch":
        return moe_gemv_ref(x, w1, w3, w2, topk_idx, topk_weight, **act)
    if not x.is_cuda:
        raise ValueError(f"backend='triton' needs CUDA tensors, got x on {x.device}")
    if not triton_available():
        raise ValueError("backend='triton' needs triton (CUDA builds of torch install it)")
    from openk3.ops.moe_kernels import moe_gemv_triton

    return moe_gemv_triton(x, w1, w3, w2, topk_idx, topk_weight, **act)
