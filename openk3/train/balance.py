"""Router load balancing: Quantile Balancing (K3_SPEC §1.6) and the two baselines.

The router (``openk3.model.moe.Router``) picks the top-k of ``s + b`` per token, where ``s`` [N, E]
are fp32 sigmoid scores and ``b`` [E] is the ``e_score_correction_bias`` buffer; the bias only
changes *which* experts are chosen, never the weights. Balancing means choosing ``b`` so that every
expert receives about ``q = N*k/E`` of the N*k (token, slot) pairs of a batch.

- ``qb_update_exact``: Quantile Balancing on one process (the exact per-expert quantile).
- ``qb_update_histogram``: the same with a fixed histogram of margins and one all-reduce, for data
  parallelism; error at most one bin.
- ``sign_update``: DeepSeek-V3's sign step ``b_j -= gamma * sign(load_j - mean load)``.
- ``switch_aux_loss``: the Switch Transformer auxiliary loss (differentiable, no bias).
- ``Balancer``: applies one of these to every MoE router of a model, from the routing its
  forward hooks collect.

All router math here runs in fp32 and is vectorised over tokens and experts. See
``docs/balancing.md`` for the derivation and measurements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from openk3.model.moe import Router
from openk3.ops.router import kth_largest

METHODS = ("qb", "sign", "aux", "none")
DEFAULT_NUM_BINS = 1024
DEFAULT_MIN_BIN_WIDTH = 1e-6  # ~8 fp32 ulps of a score near 1: finer bins would only bin rounding


def _dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_reduce_sum_(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM across ``group`` when torch.distributed is initialised, else a no-op."""
    if _dist_active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _check_routing(scores: torch.Tensor, bias: torch.Tensor, k: int, batched: bool = False) -> None:
    """``batched``: scores [..., N, E] and bias [..., E], routers side by side."""
    if scores.dim() != 2 and not (batched and scores.dim() > 2):
        raise ValueError(f"scores must be [N, E]{' or [..., N, E]' if batched else ''}, "
                         f"got shape {tuple(scores.shape)}")
    N, E = scores.shape[-2:]
    if bias.shape != (*scores.shape[:-2], E):
        raise ValueError(f"bias must be {[*scores.shape[:-2], E]}, got shape {tuple(bias.shape)}")
    if not 1 <= k < E:
        raise ValueError(f"top_k must be in 1..E-1={E - 1} (QB routes k+1 experts), got {k}")
    if N == 0:
        raise ValueError("scores has no tokens")


def target_load(num_tokens: int, k: int, num_experts: int) -> int:
    """q = floor(N*k/E): the per-expert load QB aims for.

    Flooring keeps ``q + 1 <= N`` (so the (q+1)-th largest margin exists) and an integer rank
    for the quantile; it is below the mean load ``N*k/E`` by less than one pair per expert.
    """
    return (num_tokens * k) // num_experts


def qb_margins(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Margins of every (token, expert) pair against the token's (k+1)-th biased score.

    scores: [N, E] sigmoid scores; bias: [E] (or [..., N, E] and [..., E]: routers side by
    side). Returns r [N, E] (or [..., N, E]) fp32 with
    ``r_ij = s_ij + b_j - a_i``, ``a_i`` = the (k+1)-th largest of ``s_i + b``.
    Expert j is among token i's top-k exactly when ``r_ij > 0`` (barring ties), and the runner-up
    (the (k+1)-th) has ``r_ij = 0``: one threshold per token that separates chosen from not chosen.
    A token with a NaN score has NaN margins on the CPU and -inf ones on CUDA (its threshold is
    +inf there: ``openk3.ops.router.kth_largest``).

    >>> s = torch.tensor([[0.9, 0.5, 0.2]]); qb_margins(s, torch.zeros(3), k=1)
    tensor([[ 0.4000,  0.0000, -0.3000]])
    """
    _check_routing(scores, bias, k, batched=True)
    biased = scores.float() + bias.float().unsqueeze(-2)  # [..., N, E]
    a = kth_largest(biased, k + 1)  # [..., N]: one Triton kernel on CUDA
    return biased - a.unsqueeze(-1)


def qb_update_exact(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """One Quantile Balancing step on a single process. Returns the new bias [E] fp32 (mean 0).

    scores: [N, E] sigmoid scores of the batch just routed with ``bias`` [E]; k: experts per token.
    Routers side by side (scores [L, N, E], bias [L, E]) are updated at once: one kernel per op
    for all of them (``Balancer.update``).

    With the margins ``r`` of ``qb_margins``, expert j's load on this batch is ``#{i: r_ij > 0}``.
    Let ``t_j`` be the (q+1)-th largest of ``r_:j`` over tokens (q = ``target_load``). Shifting
    the bias to ``b_j - t_j`` shifts column j of the margins by ``-t_j``, and exactly q entries
    (the q largest, barring ties) stay positive: with the per-token thresholds ``a_i`` held fixed,
    every expert's load on this batch becomes q. The thresholds do move once all biases change
    together (a token whose chosen experts all got cheaper now needs to beat a higher runner-up),
    so re-routing the batch gives loads close to q rather than exactly q. Repeated on one batch
    the step is a fixed-point iteration whose fixed points (``t`` equal for all experts) are
    balanced up to ties; in training it is applied once and the *next* batch, drawn from nearly
    the same distribution, is routed with the new bias. The current batch is never re-routed: its
    forward pass has already happened. Finally the mean over experts is removed: adding a
    constant to every bias changes no top-k choice, and centring keeps ``b`` from drifting.

    Unlike the sign step there is no step size: the correction is measured, not guessed.
    """
    r = qb_margins(scores, bias, k)  # [..., N, E]
    N, E = r.shape[-2:]
    q = target_load(N, k, E)
    # the (q+1)-th largest [..., E], along contiguous rows (one expert's tokens) rather than down
    # the strided token dimension (benchmarks/qb_speed.py); one Triton kernel on CUDA (torch's
    # kthvalue of `small`'s 23 x 64 rows of 16,384 took 0.61 ms of the step)
    t = kth_largest(r.transpose(-1, -2).contiguous(), q + 1)
    new = bias.float() - t
    return new - new.mean(-1, keepdim=True)


def margin_bin_edges(bias: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS,
                     margin_range: tuple[float, float] | None = None,
                     min_width: float = DEFAULT_MIN_BIN_WIDTH) -> torch.Tensor:
    """Edges [B+1] fp32 of the margin histogram, shared by all experts and all ranks.

    Default (``margin_range=None``): symmetric about 0 and log-spaced, ``0, ±min_width * rho^m``,
    reaching ``±R`` with ``R = 1 + (max b - min b)``, which provably contains every margin: ``s``
    is in (0, 1), so ``s_ij + b_j`` is in ``(b_j, 1 + b_j)`` and the runner-up ``a_i`` in
    ``(c, 1 + c)`` with c the (k+1)-th largest bias; hence ``|r_ij| < 1 + |b_j - c| <= R``. The
    bins are finest at 0 because that is where the quantile lives once the router is nearly
    balanced (expert j's load is ``#{r_:j > 0}``, so ``t_j ~ 0`` means load ~ q): a bin there is
    ``min_width`` wide, and a bin at ``|t|`` is a fixed fraction ``rho - 1`` of ``|t|``
    (rho - 1 = 2.8% for 1024 bins), so the estimate is as good relative to the correction as it is
    needed. R follows the bias as it drifts; every rank computes the same edges from the same bias.

    ``margin_range=(lo, hi)``: B uniform bins of width ``(hi - lo) / B``; margins outside fall in
    the under/overflow bins and the quantile clamps to ``lo``/``hi`` (a bounded bias step).
    """
    if margin_range is not None:
        lo, hi = (float(v) for v in margin_range)
        if not hi > lo or num_bins < 1:
            raise ValueError(f"need margin_range lo < hi and num_bins >= 1, got {margin_range}, {num_bins}")
        return torch.linspace(lo, hi, num_bins + 1, device=bias.device)
    if num_bins < 4 or num_bins % 2:
        raise ValueError(f"num_bins must be even and >= 4 for log-spaced bins, got {num_bins}")
    bias = bias.float()
    R = 1.0 + (bias.max() - bias.min())
    # positive edges min_width * rho^m, m = 0..B/2-1, the last one exactly R (geometric spacing)
    frac = torch.linspace(0.0, 1.0, num_bins // 2, device=bias.device)
    pos = min_width * (R / min_width) ** frac  # [B/2]
    return torch.cat([-pos.flip(0), pos.new_zeros(1), pos])


def qb_histogram(scores: torch.Tensor, bias: torch.Tensor, k: int, edges: torch.Tensor) -> torch.Tensor:
    """Bin this rank's margins per expert: counts [E, B+2] int64 for edges [B+1].

    Bin 0 counts margins below ``edges[0]``, bin m (1..B) covers ``[edges[m-1], edges[m])``, bin
    B+1 counts margins at or above ``edges[B]``; out-of-range margins are thus counted, so the
    quantile's rank stays right. Every margin lands in exactly one bin: each row sums to N.
    """
    _check_routing(scores, bias, k)
    r = qb_margins(scores, bias, k)  # [N, E]
    E, B2 = r.shape[1], edges.numel() + 1
    pos = torch.bucketize(r, edges.to(r.dtype), right=True)  # [N, E] in 0..B+1
    pos += torch.arange(E, device=r.device) * B2  # a separate run of bins per expert
    return torch.bincount(pos.view(-1), minlength=E * B2).view(E, B2)


def histogram_quantile(counts: torch.Tensor, edges: torch.Tensor, k: int) -> torch.Tensor:
    """QB's quantile from global margin counts [E, B+2]: t_hat [E] fp32, an upper bin edge.

    q = floor(N*k/E) with N read off the counts (every row sums to the global N, so no second
    collective). Scans each row from the top (a reversed cumsum) for the bin holding the (q+1)-th
    largest margin t and returns that bin's *upper* edge: ``t <= t_hat <= t + (that bin's width)``.
    Erring upward lowers the bias slightly, so with the batch's thresholds fixed an expert keeps
    at most q pairs: the estimate never overloads. Underflow returns ``edges[0]``, overflow clamps
    to ``edges[-1]``. No host synchronisation.
    """
    E, B2 = counts.shape
    q = counts[0].sum() * k // E  # 0-dim tensor
    tail = counts.flip(-1).cumsum(-1).flip(-1)  # tail[j, m] = #margins of expert j in bins >= m
    m = (tail >= q + 1).sum(-1) - 1  # the highest bin whose tail still holds q+1 margins, [E]
    return edges.float()[m.clamp(max=B2 - 2)]


def qb_bias_from_histogram(counts: torch.Tensor, bias: torch.Tensor, edges: torch.Tensor, k: int) -> torch.Tensor:
    """New bias [E] (mean 0) from global margin counts [E, B+2]: ``b - t_hat``, centred."""
    new = bias.float() - histogram_quantile(counts, edges, k)
    return new - new.mean()


def qb_update_histogram(scores: torch.Tensor, bias: torch.Tensor, k: int, num_bins: int = DEFAULT_NUM_BINS,
                        margin_range: tuple[float, float] | None = None, group=None) -> torch.Tensor:
    """Quantile Balancing across data-parallel ranks with ONE all-reduce. Returns the new bias [E].

    scores: [N_rank, E] this rank's sigmoid scores; bias: [E], identical on every rank (it is
    replicated and every rank applies the same update). Each rank bins its margins into
    E x (B+2) int64 counts (``qb_histogram``, edges from ``margin_bin_edges``), one SUM
    all-reduce over ``group`` (when torch.distributed is initialised) makes the global histogram,
    and the quantile is read off it (``histogram_quantile``). The result equals the
    single-process histogram of the whole batch exactly, and the exact QB quantile within one
    bin: ``t <= t_hat <= t + max(1e-6, 0.028 |t|)`` with the default 1024 log-spaced bins,
    ``t <= t_hat <= t + (hi - lo) / B`` for a uniform ``margin_range`` (clamped outside it).
    """
    edges = margin_bin_edges(bias, num_bins, margin_range)
    counts = _all_reduce_sum_(qb_histogram(scores, bias, k, edges), group)
    return qb_bias_from_histogram(counts, bias, edges, k)


def expert_loads(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Number of (token, slot) pairs routed to each expert: [N, k] -> [E] int64. A scatter-add,
    not ``bincount``, which reads the largest id on the host (a CUDA graph cannot capture it)."""
    idx = topk_idx.reshape(-1).long()
    loads = torch.zeros(num_experts, dtype=torch.long, device=idx.device)
    return loads.scatter_add_(0, idx, torch.ones_like(idx))


def sign_update(topk_idx: torch.Tensor, bias: torch.Tensor, num_experts: int, gamma: float = 1e-3,
                group=None) -> torch.Tensor:
    """DeepSeek-V3 bias step: ``b_j - gamma * sign(load_j - mean load)``. Returns the new bias [E].

    topk_idx: [N, k] this rank's routing; the loads [E] are summed over ``group`` with one
    all-reduce when torch.distributed is initialised.
    """
    loads = _all_reduce_sum_(expert_loads(topk_idx, num_experts), group).float()
    return bias.float() - gamma * torch.sign(loads - loads.mean())


def switch_aux_loss(scores: torch.Tensor, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer balancing loss ``E * sum_j f_j * P_j`` (scalar, differentiable in scores).

    scores: [N, E] router scores (with graph); topk_idx: [N, k]. ``f_j``: fraction of the N*k
    routed (token, slot) pairs that went to expert j (not differentiable); ``P_j``: mean over tokens
    of the normalised probability ``s_ij / sum_j s_ij``. Equals 1 for perfectly uniform routing,
    larger when load and probability mass concentrate on the same experts.
    """
    f = expert_loads(topk_idx, num_experts).float() / topk_idx.numel()  # [E]
    s = scores.float()
    P = (s / s.sum(-1, keepdim=True)).mean(0)  # [E]
    return num_experts * (f * P).sum()


def load_max_over_mean(topk_idx: torch.Tensor, num_experts: int) -> float:
    """Balance of one routing [N, k]: the largest expert load over the mean load (1 = perfect)."""
    loads = expert_loads(topk_idx, num_experts).float()
    return (loads.max() / loads.mean()).item()


# scores updated at once by the exact QB step: it holds ~5 fp32 copies of them (stack, biased
# scores, margins, their transpose, kthvalue's workspace), 2^26 elements ~1.3 GB at the peak
QB_BATCH_NUMEL = 1 << 26


def _batches(scores: list[torch.Tensor]) -> list[list[int]]:
    """Indices of consecutive routers with one shape and device, at most QB_BATCH_NUMEL score
    elements a batch (at least one router): each batch is one ``qb_update_exact`` call."""
    batches: list[list[int]] = []
    for i, s in enumerate(scores):
        last = batches[-1] if batches else None
        if (last is not None and (s.shape, s.device) == (scores[last[0]].shape, scores[last[0]].device)
                and (len(last) + 1) * s.numel() <= QB_BATCH_NUMEL):
            last.append(i)
        else:
            batches.append([i])
    return batches


class Balancer:
    """Balances every MoE router of a model from the routing its forward hooks collect.

    method: ``"qb"`` (Quantile Balancing: the exact quantile on one process, the histogram
    estimator when torch.distributed is initialised with world size > 1), ``"sign"`` (DeepSeek-V3
    sign step, ``gamma``), ``"aux"`` (Switch auxiliary loss, which the trainer scales by its
    coefficient and adds to the loss) or ``"none"`` (statistics only).

    ``attach(model)`` registers a forward hook on every ``Router`` of ``model``. Each router
    forward in training mode replaces that router's routing (scores [N, E] fp32, topk_idx [N, k]);
    eval-mode forwards collect nothing. So after a training forward there is exactly one routing
    per router, that forward's. ``aux_loss`` reads the scores with their autograd graph (kept for
    ``"aux"`` only); ``update`` reads them detached and writes each router's
    ``e_score_correction_bias`` in place; ``stats`` reads the chosen experts. ``detach`` removes
    the hooks. ``update`` is a collective when distributed (one all-reduce for all layers): call
    it on every rank.
    """

    def __init__(self, method: str, num_experts: int, top_k: int, *, num_bins: int = DEFAULT_NUM_BINS,
                 margin_range: tuple[float, float] | None = None, gamma: float = 1e-3, group=None):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if not 1 <= top_k < num_experts:
            raise ValueError(f"top_k must be in 1..num_experts-1, got {top_k} (num_experts={num_experts})")
        self.method, self.num_experts, self.top_k = method, num_experts, top_k
        self.num_bins, self.margin_range, self.gamma = num_bins, margin_range, gamma
        self.group = group
        self._routers: list[Router] = []
        self._routing: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._hooks: list = []

    def attach(self, model: nn.Module) -> Balancer:
        """Hook every ``Router`` in ``model`` (in module order); returns self."""
        if self._hooks:
            raise ValueError("this Balancer is already attached to a model; call detach() first")
        routers = [m for m in model.modules() if isinstance(m, Router)]
        if not routers:
            raise ValueError("the model has no MoE router (openk3.model.moe.Router) to balance")
        for r in routers:
            if (r.cfg.num_experts, r.cfg.num_experts_per_token) != (self.num_experts, self.top_k):
                raise ValueError(f"a router has num_experts={r.cfg.num_experts}, top_k="
                                 f"{r.cfg.num_experts_per_token}; this Balancer was built for "
                                 f"num_experts={self.num_experts}, top_k={self.top_k}")
        if self.method == "qb" and any(r.cfg.num_expert_group > 1 for r in routers):
            raise ValueError("Quantile Balancing assumes ungrouped routing (num_expert_group=1, as in K3)")
        self._routers, self._routing = routers, [None] * len(routers)
        self._hooks = [r.register_forward_hook(self._collector(i)) for i, r in enumerate(routers)]
        return self

    def detach(self) -> None:
        """Remove the hooks: later forwards collect nothing (the last routing stays readable)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _collector(self, i: int):
        keep_graph = self.method == "aux"  # only the aux loss differentiates through the scores

        def hook(router, _inputs, output):
            if router.training:
                scores, topk_idx, _ = output  # [N, E] fp32, [N, k]
                self._routing[i] = (scores if keep_graph else scores.detach(), topk_idx)
        return hook

    def _collected(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not self._routers:
            raise ValueError("the Balancer is not attached to a model: call attach(model) first")
        if any(r is None for r in self._routing):
            raise ValueError("an MoE router has no routing recorded: run a forward in training mode first")
        return self._routing

    @torch.no_grad()
    def update(self) -> None:
        """Update every router's bias in place from its collected routing (no-op for aux/none)."""
        if self.method in ("aux", "none"):
            return
        routings = self._collected()  # detached fp32 scores: only "aux" keeps the graph
        biases = [r.e_score_correction_bias for r in self._routers]
        E, k = self.num_experts, self.top_k
        if self.method == "sign":
            loads = torch.stack([expert_loads(idx, E) for _, idx in routings])  # [L, E]
            loads = _all_reduce_sum_(loads, self.group).float()
            new = [b.float() - self.gamma * torch.sign(ld - ld.mean()) for b, ld in zip(biases, loads)]
        elif _dist_active() and dist.get_world_size(self.group) > 1:
            edges = [margin_bin_edges(b, self.num_bins, self.margin_range) for b in biases]
            counts = torch.stack([qb_histogram(s, b, k, e) for (s, _), b, e in zip(routings, biases, edges)])
            counts = _all_reduce_sum_(counts, self.group)  # [L, E, B+2]: one collective for all layers
            new = [qb_bias_from_histogram(c, b, e, k) for c, b, e in zip(counts, biases, edges)]
        else:  # routers side by side, as many at once as QB_BATCH_NUMEL allows
            scores, new = [s for s, _ in routings], []
            for chunk in _batches(scores):
                new += qb_update_exact(torch.stack([scores[i] for i in chunk]),
                                       torch.stack([biases[i] for i in chunk]), k).unbind()
        for b, nb in zip(biases, new):
            b.copy_(nb)

    def aux_loss(self) -> torch.Tensor:
        """Sum over routers of ``switch_aux_loss`` (unscaled) for method "aux", else a zero scalar
        (on the routing's device once a forward has run)."""
        if self.method != "aux":
            scores = next((r[0] for r in self._routing if r is not None), None)
            return torch.zeros((), device=None if scores is None else scores.device)
        return torch.stack([switch_aux_loss(s, idx, self.num_experts) for s, idx in self._collected()]).sum()

    @torch.no_grad()
    def stats(self) -> list[float]:
        """Max/mean expert load of each router's last routing (this rank's tokens; no collective)."""
        return [load_max_over_mean(idx, self.num_experts) for _, idx in self._collected()]
