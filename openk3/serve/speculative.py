"""Exact speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318): verify K draft tokens against the target in one step, keeping the output
distribution exactly that of sampling from the target token by token.

For one sequence with draft tokens d_1..d_K drawn from the draft's distributions q_1..q_K and
the target's distributions p_1..p_{K+1} (all after the engine's temperature / top-k / top-p
processing, ``sampling_probs``):

    for i = 1..K:   accept d_i with probability  min(1, p_i(d_i) / q_i(d_i))
                    (q_i(d_i) = 0: reject; the draft could not have proposed it)
    first rejection at i:  emit t ~ norm(max(0, p_i - q_i))   (all zero: t ~ p_i), stop
    all K accepted:        emit the bonus token t ~ p_{K+1}

so a step emits ``num_accepted + 1`` tokens: the accepted prefix and one more. Greedy requests
(temperature 0) accept while d_i == argmax p_i and then emit argmax p of the next position,
which is plain greedy decoding token for token. ``docs/speculative.md`` derives why the
sampled tokens follow p exactly.

* ``speculative_sample_ref``: one sequence, a loop over its draft tokens; the reference.
* ``speculative_sample``: a batch ``[B, K]`` with per-row draft lengths, vectorised over rows
  and vocabulary (no host synchronisation, no loop over positions).
* ``greedy_verify``: ``speculative_sample`` of a batch whose every request is greedy, from the
  target's logits alone: no probabilities (the draft's and the target's would be one-hot), no
  random draws; ~10 kernels where the general path launches ~45 (the engine's verify step at
  batch 1 ran ~84 launches outside its graphs, docs/benchmarks.md, thirty-first session).

Randomness follows ``sampler.py``: a row draws its K acceptance uniforms and then one Exp(1)
noise vector over the vocabulary, and picks the emitted token by the exponential race
``argmax(w / noise)`` (exact sampling from ``w / sum(w)``; ``w`` need not be normalised). A
seeded request's own generator makes exactly these draws for its row, ``K`` being that
request's own draft length, so its tokens do not depend on the batch. With K = 0 the draws and
the token are those of ``sampler.sample``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from openk3.serve.sampler import (
    SamplingParams,
    filtered_logprobs,
    filters,
    host_to_device,
)


def acceptance_prob(p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)), and 0 where q(d) = 0 (a token the draft could not have sampled).

    p_d, q_d: [...] probabilities of the proposed tokens under target and draft. A draft token
    is accepted when a uniform u in [0, 1) is below this."""
    return torch.where(q_d > 0, p_d / q_d, 0.0).clamp(max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) [..., V], unnormalised: what is sampled after a rejection. Where it is all
    zero (p == q up to rounding, so a rejection had probability ~0) p itself is returned."""
    r = (p - q).clamp(min=0.0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [B, P, V] -> fp32 probabilities [B, P, V] of the distributions each request
    samples from at every position: ``sampler.filtered_logprobs`` (temperature, top-k, top-p)
    with the row's settings, exponentiated. The target's p are these of its logits (P = K+1);
    the draft's q are the distributions its tokens were actually drawn from (the draft can
    sample through this function too). A greedy batch is one-hot at the argmax, the token
    ``sampler.sample`` picks (the first one on an exact tie), without the filtering's sort."""
    if logits.dim() != 3 or len(params) != logits.shape[0]:
        raise ValueError(f"sampling_probs: `logits` must be [B, P, V] with B = len(params) = "
                         f"{len(params)}, got {list(logits.shape)}")
    B, P, V = logits.shape
    if all(p.temperature == 0 for p in params):
        return torch.zeros(B, P, V, device=logits.device).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    settings = host_to_device([[p.temperature, p.top_p, p.top_k] for p in params],
                              logits.device).repeat_interleave(P, dim=0)  # [B*P, 3]
    temperature, top_p, top_k = settings.unbind(1)
    logp = filtered_logprobs(logits.reshape(B * P, V), temperature, top_k.long(), top_p, filters(params))
    return logp.exp().view(B, P, V)


def speculative_sample_ref(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                           target_probs: torch.Tensor, greedy: bool,
                           generator: torch.Generator | None) -> tuple[int, list[int]]:
    """One sequence: draft_tokens [K] int64, draft_probs [K, V], target_probs [K+1, V].

    Returns (number of accepted draft tokens, the emitted tokens: the accepted ones and then
    the correction or bonus token). ``generator`` (None: the global RNG) gives the K uniforms
    and then the Exp(1) noise [V] of the final token's exponential race."""
    K, V = draft_tokens.shape[0], target_probs.shape[-1]
    u = torch.rand(K, generator=generator, device=target_probs.device)
    noise = torch.empty(V, device=target_probs.device).exponential_(generator=generator)
    emitted = []
    for i in range(K):
        d = int(draft_tokens[i])
        if greedy:
            ok = d == int(target_probs[i].argmax())
        else:
            ok = bool(u[i] < acceptance_prob(target_probs[i, d], draft_probs[i, d]))
        if not ok:
            if greedy:
                return i, emitted + [int(target_probs[i].argmax())]
            w = residual(target_probs[i], draft_probs[i])
            return i, emitted + [int((w / noise).argmax())]
        emitted.append(d)
    bonus = target_probs[K].argmax() if greedy else (target_probs[K] / noise).argmax()
    return K, emitted + [int(bonus)]


def _check_drafts(draft_tokens: torch.Tensor, num_draft) -> tuple[int, int]:
    """(B, K) of ``draft_tokens`` [B, K] int64, with ``num_draft`` (None or B lengths in [0, K])."""
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(f"`draft_tokens` must be an int64 [B, K] tensor, got {draft_tokens.dtype} "
                         f"{list(draft_tokens.shape)}")
    B, K = draft_tokens.shape
    if num_draft is not None and (len(num_draft) != B or not all(0 <= k <= K for k in num_draft)):
        raise ValueError(f"`num_draft` must hold B = {B} lengths in [0, {K}], got {list(num_draft)}")
    return B, K


def _validate(draft_tokens, draft_probs, target_probs, num_draft, params, generators) -> None:
    B, K = _check_drafts(draft_tokens, num_draft)
    if target_probs.dim() != 3 or target_probs.shape[:2] != (B, K + 1) or not target_probs.is_floating_point():
        raise ValueError(f"`target_probs` must be a floating [B, K+1, V] tensor with B = {B}, "
                         f"K = {K}, got {target_probs.dtype} {list(target_probs.shape)}")
    V = target_probs.shape[2]
    if draft_probs.shape != (B, K, V) or draft_probs.dtype != target_probs.dtype:
        raise ValueError(f"`draft_probs` must be a {target_probs.dtype} [B, K, V] = {[B, K, V]} "
                         f"tensor, got {draft_probs.dtype} {list(draft_probs.shape)}")
    for name, t in (("draft_tokens", draft_tokens), ("draft_probs", draft_probs)):
        if t.device != target_probs.device:
            raise ValueError(f"`{name}` is on {t.device}, target_probs on {target_probs.device}")
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} rows but {len(params)} `params` and {len(generators)} `generators`")


def speculative_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                       target_probs: torch.Tensor, num_draft: Sequence[int] | None,
                       params: Sequence[SamplingParams],
                       generators: Sequence[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of drafts.

    draft_tokens [B, K] int64; draft_probs [B, K, V] (the distributions the draft tokens were
    sampled from); target_probs [B, K+1, V] (``sampling_probs(target_logits, params)``);
    num_draft: row b's draft length k_b <= K (host ints, None: all K; positions >= k_b are
    padding of any value); ``params[b]`` (temperature 0: greedy) and ``generators[b]`` (None:
    the global RNG) as in ``sampler.sample``.

    Returns (num_accepted [B] int64, tokens [B, K+1] int64): row b emits
    ``tokens[b, :num_accepted[b] + 1]``, the rest is -1.

    >>> p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])   # target, K+1 = 2 positions
    >>> q = torch.tensor([[[0.5, 0.5, 0.0]]])                    # the draft is the target here
    >>> n, tokens = speculative_sample(torch.tensor([[1]]), q, p, None, [SamplingParams()], [None])
    >>> n.tolist(), tokens.tolist()                               # accepted, then the bonus
    ([1], [[1, 2]])
    """
    _validate(draft_tokens, draft_probs, target_probs, num_draft, params, generators)
    B, K = draft_tokens.shape
    V, dev = target_probs.shape[2], target_probs.device
    # the draws of speculative_sample_ref, row by row: K uniforms, then Exp(1) noise [V]
    u = torch.empty(B, K, device=dev)
    noise = torch.empty(B, V, device=dev)
    if B > 1 and all(g is generators[0] for g in generators):  # one RNG for the whole batch
        u.uniform_(generator=generators[0])
        noise.exponential_(generator=generators[0])
    else:
        u.uniform_()
        noise.exponential_()
        for row, g in enumerate(generators):
            if g is not None:  # a request's own generator draws for its own k_b only
                u[row, :K if num_draft is None else num_draft[row]].uniform_(generator=g)
                noise[row].exponential_(generator=g)
    k_b = torch.full((B,), K, device=dev) if num_draft is None else host_to_device(list(num_draft), dev)
    greedy = host_to_device([p.temperature == 0 for p in params], dev)

    drafted = torch.arange(K, device=dev) < k_b[:, None]                            # [B, K]
    d = torch.where(drafted, draft_tokens, 0)  # padding may be -1; it is rejected below
    p_draft = target_probs[:, :K]                                                   # [B, K, V]
    p_d = p_draft.gather(-1, d[..., None])[..., 0]                                  # [B, K]
    q_d = draft_probs.gather(-1, d[..., None])[..., 0]
    ok = torch.where(greedy[:, None], d == p_draft.argmax(-1), u < acceptance_prob(p_d, q_d))
    ok &= drafted
    num_accepted = ok.long().cumprod(-1).sum(-1)                                    # [B]

    rows = torch.arange(B, device=dev)
    p_next = target_probs[rows, num_accepted]                                       # [B, V]
    w = p_next
    if K > 0:  # a rejected row samples the residual of its rejecting position
        q_next = draft_probs[rows, num_accepted.clamp(max=K - 1)]
        w = torch.where((num_accepted < k_b)[:, None], residual(p_next, q_next), p_next)
    last = torch.where(greedy, p_next.argmax(-1), (w / noise).argmax(-1))           # [B]

    pos = torch.arange(K + 1, device=dev)
    padded = torch.cat([d, d.new_full((B, 1), -1)], dim=1)                          # [B, K+1]
    tokens = torch.where(pos < num_accepted[:, None], padded,
                         torch.where(pos == num_accepted[:, None], last[:, None], -1))
    return num_accepted, tokens


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  num_draft: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``speculative_sample`` for a batch of greedy requests: draft_tokens [B, K] int64,
    target_logits [B, K+1, V] (the verify pass's), num_draft as there. Row b accepts its drafts
    while each equals the target's argmax (the first index on a tie, as ``sampler.sample``) and
    then emits the argmax of the next position. Returns (num_accepted [B], tokens [B, K+1]) as
    ``speculative_sample`` does.

    >>> logits = torch.tensor([[[0., 2., 1.], [3., 0., 0.], [0., 0., 5.]]])  # argmax 1, 0, 2
    >>> n, tokens = greedy_verify(torch.tensor([[1, 2]]), logits, None)    # 1 right, 2 wrong
    >>> n.tolist(), tokens.tolist()
    ([1], [[1, 0, -1]])
    """
    B, K = _check_drafts(draft_tokens, num_draft)
    if target_logits.dim() != 3 or target_logits.shape[:2] != (B, K + 1):
        raise ValueError(f"`target_logits` must be [B, K+1, V] with B = {B}, K = {K}, got "
                         f"{list(target_logits.shape)}")
    dev = draft_tokens.device
    best = target_logits.argmax(-1)                                                 # [B, K+1]
    ok = draft_tokens == best[:, :K]
    if num_draft is not None and any(k < K for k in num_draft):
        ok &= torch.arange(K, device=dev) < host_to_device(list(num_draft), dev)[:, None]
    num_accepted = ok.long().cumprod(-1).sum(-1)                                    # [B]
    # an accepted draft is the target's argmax, and so is the token after the accepted ones
    tokens = torch.where(torch.arange(K + 1, device=dev) <= num_accepted[:, None], best, -1)
    return num_accepted, tokens
