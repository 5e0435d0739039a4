"""Rewards, advantages and the policy losses of ``openk3 rl`` (docs/posttraining.md, "Objective").

Shapes: B trajectories (a step's groups, G consecutive rows per group), L the longest
completion; per-token tensors are ``[B, L]`` with ``mask`` true on real completion tokens.
``logp`` is the trainer's log-probability of each sampled token (differentiated), ``old_logp``
the behaviour policy's (recorded when the token was sampled, whatever policy version that was).
Every loss is returned as a *sum* (over tokens or sequences); the caller divides by the step's
total count, so gradient accumulation over micro-batches is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOGIT_ROWS = 4096  # completion positions turned into [rows, vocab] fp32 logits at a time


def length_rewards(lengths: list[int], correct: list[bool]) -> list[float]:
    """Kimi k1.5's length reward within one group: ``lam = 0.5 - (len - min) / (max - min)``
    for a correct answer, ``min(0, lam)`` for a wrong one (0 for all when every length is equal)."""
    lo, hi = min(lengths), max(lengths)
    if hi == lo:
        return [0.0] * len(lengths)
    lams = [0.5 - (n - lo) / (hi - lo) for n in lengths]
    return [lam if ok else min(0.0, lam) for lam, ok in zip(lams, correct)]


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool,
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards [B] (B = groups x G, members consecutive) -> r - mean_group(r), divided by the
    group's standard deviation (unbiased, + eps) when ``std_normalize``. A group whose rewards
    are all equal gets advantage 0."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.flatten()


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """Sum over tokens of ``-min(rho A, clip(rho, 1 - eps, 1 + eps) A)``, rho = pi / pi_behaviour.
    advantages [B, L] (a sequence's advantage repeated, plus any per-token reward)."""
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    return -(surrogate * mask).sum()


def k15_loss(logp: torch.Tensor, old_logp: torch.Tensor, centred_rewards: torch.Tensor,
             mask: torch.Tensor, tau: float) -> torch.Tensor:
    """Kimi k1.5: sum over sequences of ``(r - mean_group r - tau log(pi(y|x) / pi_old(y|x)))^2``,
    the sequence log-ratio being the sum of the per-token ones. centred_rewards [B]."""
    log_ratio = ((logp - old_logp) * mask).sum(dim=1)
    return ((centred_rewards - tau * log_ratio) ** 2).sum()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of Schulman's k3 estimate of KL(pi || pi_ref): ``exp(d) - d - 1`` with
    ``d = log pi_ref - log pi`` (non-negative, unbiased on samples of pi)."""
    d = ref_logp - logp
    return ((torch.exp(d) - d - 1) * mask).sum()


def _rows_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()  # [rows, V]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def completion_logprobs(model, prompts: list[list[int]], completions: list[list[int]],
                        pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | x, y_<t) of every completion token: (logp [B, L] fp32, mask [B, L] bool).

    One forward over the right-padded ``prompt + completion`` rows (the model is causal: padding
    after a row changes nothing before it). Logits exist only at completion positions, at most
    ``LOGIT_ROWS`` rows of ``[rows, vocab]`` at a time and recomputed in backward
    (checkpointed), so long completions with a large vocabulary fit."""
    device = model.lm_head.weight.device
    seqs = [p + c for p, c in zip(prompts, completions)]
    B, T, L = len(seqs), max(map(len, seqs)) - 1, max(map(len, completions))
    ids = torch.full((B, T + 1), pad_id, dtype=torch.long)
    sel_b, sel_t, out_j = [], [], []
    for b, (p, c) in enumerate(zip(prompts, completions)):
        ids[b, :len(p) + len(c)] = torch.tensor(p + c)
        sel_b += [b] * len(c)
        sel_t += range(len(p) - 1, len(p) - 1 + len(c))  # the position that predicts token j
        out_j += range(len(c))
    ids = ids.to(device)
    hidden = model.model(ids[:, :-1])  # [B, T, d]
    b_idx, t_idx = torch.tensor(sel_b, device=device), torch.tensor(sel_t, device=device)
    rows, targets = hidden[b_idx, t_idx], ids[b_idx, t_idx + 1]
    pieces = []
    for lo in range(0, rows.shape[0], LOGIT_ROWS):
        args = (rows[lo:lo + LOGIT_ROWS], model.lm_head.weight, targets[lo:lo + LOGIT_ROWS])
        pieces.append(checkpoint(_rows_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled()
                      else _rows_logprobs(*args))
    flat = torch.cat(pieces)
    logp = torch.zeros(B, L, device=device, dtype=flat.dtype)
    j_idx = torch.tensor(out_j, device=device)
    logp = logp.index_put((b_idx, j_idx), flat)
    mask = torch.zeros(B, L, dtype=torch.bool, device=device)
    mask[b_idx, j_idx] = True
    return logp, mask


def padded(rows: list[list[float]], length: int, device: torch.device) -> torch.Tensor:
    """Right-pad float rows with 0 to [len(rows), length] fp32."""
    out = torch.zeros(len(rows), length)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
    return out.to(device)
