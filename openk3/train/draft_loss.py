"""Losses that train a speculative-decoding draft (the MTP head) toward the target.

Per row (token position) i, with p = softmax(target_logits_i) the target's distribution and
q = softmax(draft_logits_i) the draft's:

    alpha = sum_x min(p(x), q(x))          the probability that speculative sampling accepts
                                           the draft's token (Leviathan et al. 2023)
    KL    = sum_x p(x) (log p(x) - log q(x))              forward KL(p || q)
    TV    = 0.5 sum_x |p(x) - q(x)| = 1 - alpha           total variation
    LK_alpha  = -log alpha                                 negative log acceptance
    LK_lambda = lambda KL + (1 - lambda) TV,  lambda = exp(-eta * mean(alpha)), alpha detached

Each loss is the mean over the rows not ignored (0, not NaN, when all are), so a batch of
[B, T, V] logits is passed as [B*T, V]. Log-softmax runs in fp32 (float64 stays float64). The
target is detached: gradients reach only the draft.

The LK losses are from Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for
Speculative Decoding" (arXiv 2602.23881, sections 4.2 and 4.4). KL and alpha share their
optimum (q = p), but a small draft cannot reach it, and at a KL optimum the acceptance is not
maximal; TV = 1 - alpha targets acceptance itself, but its gradient vanishes when the overlap
is small (the state of a fresh draft over a large vocabulary). LK_alpha rescales the TV
gradient by 1 / alpha (d(-log alpha) = -d alpha / alpha), which keeps it usable from a cold
start. LK_lambda blends: lambda is near 1 (mostly KL, which trains fast from scratch) while the
acceptance is low and decays toward exp(-eta) as it rises; eta = 0 gives pure KL. The weight
is one detached number per call, from the mean acceptance of the rows in it, with eta = 3 by
default. Where this comes from: the paper's abstract and summaries describe the adaptive KL/TV
hybrid; the exact rule is taken from two implementations that cite the paper's sections 4.2
and 4.4, NVIDIA Model-Optimizer's ``masked_lk_lambda_loss`` (one detached blend weight per
call, decay rate ``eta``, default 3.0) and vLLM speculators' ``lk_hybrid``
(``lambda = exp(-3 * alpha)``). The paper's own section 4 text was not available here, so the
batch-mean (rather than per-row) alpha rests on the former's description.

``draft_losses_ref`` in ``tests/train/test_draft_loss.py`` is the row-by-row float64 reference.
"""

from __future__ import annotations

import torch

ALPHA_FLOOR = 1e-12  # log(alpha) is clamped here: alpha = 0 only when q is 0 on p's whole support
DEFAULT_ETA = 3.0    # LK_lambda's decay rate (the default of the implementations cited above)


def _validate(target_logits: torch.Tensor, draft_logits: torch.Tensor,
              ignore: torch.Tensor | None) -> None:
    if draft_logits.dim() != 2 or not draft_logits.is_floating_point() or draft_logits.shape[0] == 0:
        raise ValueError(f"`draft_logits` must be a floating [N, V] tensor with N > 0, got "
                         f"{draft_logits.dtype} {list(draft_logits.shape)}")
    if target_logits.shape != draft_logits.shape or not target_logits.is_floating_point():
        raise ValueError(f"`target_logits` must be a floating tensor of the draft's shape "
                         f"{list(draft_logits.shape)}, got {target_logits.dtype} {list(target_logits.shape)}")
    if ignore is not None and (ignore.shape != draft_logits.shape[:1] or ignore.dtype != torch.bool):
        raise ValueError(f"`ignore` must be a bool [N] tensor with N = {draft_logits.shape[0]}, got "
                         f"{ignore.dtype} {list(ignore.shape)}")
    for name, t in (("target_logits", target_logits), ("ignore", ignore)):
        if t is not None and t.device != draft_logits.device:
            raise ValueError(f"`{name}` is on {t.device}, draft_logits on {draft_logits.device}")


def _log_probs(target_logits, draft_logits, ignore):
    """fp32 (or float64) log p [N, V] (detached) and log q [N, V], after validation."""
    _validate(target_logits, draft_logits, ignore)
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    logp = torch.log_softmax(target_logits.detach().to(dtype), dim=-1)
    logq = torch.log_softmax(draft_logits.to(dtype), dim=-1)
    return logp, logq


def _mean(per_row: torch.Tensor, ignore: torch.Tensor | None) -> torch.Tensor:
    """Mean of per_row [N] over the rows not ignored; 0 when every row is."""
    if ignore is None:
        return per_row.mean()
    keep = ~ignore
    return torch.where(keep, per_row, 0.0).sum() / keep.sum().clamp_min(1)


def _kl_rows(logp, logq):
    # p log(p / q) with 0 log 0 = 0: a target filtered to -inf contributes nothing
    return torch.where(logp > float("-inf"), logp.exp() * (logp - logq), 0.0).sum(-1)


def _alpha_rows(logp, logq):
    return torch.minimum(logp.exp(), logq.exp()).sum(-1)


def _tv_rows(logp, logq):
    return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)


def acceptance_rate(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                    ignore: torch.Tensor | None = None) -> torch.Tensor:
    """Mean alpha = sum_x min(p, q) over the kept rows: the expected acceptance of one draft
    token under speculative sampling at temperature 1. A metric; no gradient."""
    with torch.no_grad():
        return _mean(_alpha_rows(*_log_probs(target_logits, draft_logits, ignore)), ignore)


def kl_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor,
            ignore: torch.Tensor | None = None) -> torch.Tensor:
    """Forward KL(p || q) = sum_x p (log p - log q), mean over the kept rows.

    target_logits, draft_logits [N, V]; ignore [N] bool (True: the row counts nothing)."""
    return _mean(_kl_rows(*_log_probs(target_logits, draft_logits, ignore)), ignore)


def tv_distance(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                ignore: torch.Tensor | None = None) -> torch.Tensor:
    """TV(p, q) = 0.5 sum_x |p - q| = 1 - alpha, mean over the kept rows.

    >>> t = torch.tensor([[0.0, 0.0]])
    >>> round(tv_distance(t, torch.tensor([[0.0, 2.0]])).item(), 4)   # 0.5 |0.5 - 0.1192| * 2
    0.3808
    """
    return _mean(_tv_rows(*_log_probs(target_logits, draft_logits, ignore)), ignore)


def lk_alpha_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                  ignore: torch.Tensor | None = None) -> torch.Tensor:
    """LK_alpha = -log alpha, alpha = sum_x min(p, q) clamped at ``ALPHA_FLOOR``; mean over the
    kept rows. Its gradient is TV's divided by alpha. 0 (up to the rounding of sum p) when q = p."""
    alpha = _alpha_rows(*_log_probs(target_logits, draft_logits, ignore))
    return _mean(-alpha.clamp_min(ALPHA_FLOOR).log(), ignore)


def lk_lambda_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                   ignore: torch.Tensor | None = None, eta: float = DEFAULT_ETA) -> torch.Tensor:
    """LK_lambda = lambda mean(KL) + (1 - lambda) mean(TV), lambda = exp(-eta * mean(alpha))
    with the mean acceptance of the kept rows detached (one weight per call; eta = 0: pure KL).

    >>> t = torch.tensor([[1.0, 0.0, -1.0]])
    >>> lk_lambda_loss(t, t).item()                                      # q = p: KL = TV = 0
    0.0
    """
    if eta < 0:
        raise ValueError(f"`eta` must be >= 0, got {eta}")
    logp, logq = _log_probs(target_logits, draft_logits, ignore)
    kl = _mean(_kl_rows(logp, logq), ignore)
    tv = _mean(_tv_rows(logp, logq), ignore)
    lam = torch.exp(-eta * _mean(_alpha_rows(logp, logq), ignore).detach())
    return lam * kl + (1 - lam) * tv
