"""Sampling: temperature, top-k, top-p, per-request seeds, and log-probabilities.

Batched over requests with per-row settings. A seeded request draws its randomness from its own
generator (the exponential-race form of sampling: ``argmax(p / q)`` with ``q ~ Exp(1)`` per token),
so its tokens do not depend on which other requests share the batch. Draws made inside a CUDA
graph, where a request's generator cannot go, use counter-based uniforms instead
(``counter_uniforms``: a hash of the request's seed, its position and the draw's index, computed
on the host) and the inverse CDF (``inverse_cdf_sample``): the EAGLE draft's sampled chain. Stop strings, stop token
ids and max_tokens are the engine's business: they look at the text and counts, not at logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_TOP_K = 2**31 - 1  # a top_k beyond the vocabulary keeps every token
MIN_TEMPERATURE = 1e-6  # a smaller positive temperature samples as this one: fp32 logits divided by
# less overflow to inf (and NaN probabilities); at 1e-6 a row is its argmax but for near-ties


class InvalidRequest(ValueError):
    """A request the engine refuses; ``param`` names the offending request parameter (the
    server answers HTTP 400 with it, in OpenAI's error format)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI-style names). ``temperature == 0`` is greedy;
    ``top_k == 0`` and ``top_p == 1`` disable those filters; ``logprobs`` = how many top
    alternatives to return besides the chosen token's (None: none); ``prompt_logprobs`` the same
    for every prompt token after the first (each given the tokens before it; None: none).
    ``max_tokens == 0`` generates nothing (with ``prompt_logprobs``: scoring a text)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        checks = (
            ("temperature", 0 <= self.temperature <= 100, "must be in [0, 100]"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", 0 <= self.top_k <= MAX_TOP_K, f"must be in [0, {MAX_TOP_K}] (0 disables it)"),
            ("max_tokens", self.max_tokens >= 0, "must be >= 0"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "must be in [0, 20]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("seed", self.seed is None or -2**63 <= self.seed < 2**63, "must fit in 64 bits"),
        )
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequest(name, f"{getattr(self, name)!r} {why}")


def host_to_device(data: list, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data)`` on ``device`` without waiting for the device: built in pinned host
    memory and copied asynchronously. (``torch.tensor(data, device="cuda")`` copies from pageable
    memory, which waits until every kernel queued before it has run: a host round trip.)"""
    device = torch.device(device)
    return torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def filters(params) -> bool:
    """Whether any sampled (temperature > 0) row of ``params`` truncates its distribution (top-k
    or top-p): only then does ``filtered_logprobs`` need its sort over the vocabulary."""
    return any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params)


def filtered_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, filtering: bool = True) -> torch.Tensor:
    """logits [B, V]; temperature, top_p [B] float; top_k [B] int (0 = off).

    Returns fp32 log-probabilities [B, V] of the distribution each row samples from (tempered,
    filtered, renormalised; -inf outside the kept set). Greedy rows (temperature 0) keep their
    argmax only. ``filtering`` False (no row truncates: ``filters(params)``, known on the host)
    skips the sort over the vocabulary that top-k / top-p need: the tempered softmax itself."""
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature.clamp(min=MIN_TEMPERATURE)).unsqueeze(-1)
    if not filtering:
        one_hot = torch.full_like(scaled, float("-inf")).scatter_(-1, scaled.argmax(-1, keepdim=True), 0.0)
        return torch.where(greedy[:, None], one_hot, torch.log_softmax(scaled, dim=-1))
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    rank = torch.arange(V, device=logits.device)
    k = torch.where((top_k > 0) & ~greedy, top_k, torch.where(greedy, 1, V)).clamp(max=V)
    drop = rank[None, :] >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(-1) - probs) > top_p[:, None]  # keep the smallest set reaching top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    out = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    return torch.log_softmax(out, dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           distribution: bool = False) -> tuple[torch.Tensor, ...]:
    """Choose one token per row. Returns (token ids [B], their log-probabilities [B] under the
    filtered distribution) and, with ``distribution``, that distribution's probabilities [B, V]
    fp32 (one-hot for greedy rows): what a draft's tokens were drawn from. ``generators[i]`` (or
    None: the global RNG) drives row i."""
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"sample: {logits.shape[0]} rows but {len(params)} params and "
                         f"{len(generators)} generators")
    dev = logits.device
    if all(p.temperature == 0 for p in params):  # greedy batch: no filtering, no noise
        tokens = logits.argmax(-1)
        picked = torch.zeros(tokens.shape, device=dev)  # the filtered distribution is one-hot
        if not distribution:
            return tokens, picked
        return tokens, picked, torch.zeros(logits.shape, device=dev).scatter_(-1, tokens[:, None], 1.0)
    settings = host_to_device([[p.temperature, p.top_p, p.top_k] for p in params], dev)  # one copy
    temperature, top_p, top_k = settings.unbind(1)
    logp = filtered_logprobs(logits, temperature, top_k.long(), top_p, filters(params))
    # Exp(1) noise: unseeded rows (or a generator all rows share) take one draw; a seeded
    # request's own generator then fills only its row, so its tokens do not depend on the batch
    shared = generators[0] if all(g is generators[0] for g in generators) else None
    noise = torch.empty_like(logp).exponential_(generator=shared)
    if shared is None:
        for row, g in enumerate(generators):
            if g is not None:
                noise[row].exponential_(generator=g)
    probs = logp.exp()
    tokens = (probs / noise).argmax(-1)  # exponential race: exact sampling from exp(logp)
    tokens = torch.where(temperature == 0, logp.argmax(-1), tokens)
    picked = logp.gather(-1, tokens[:, None])[:, 0]
    return (tokens, picked, probs) if distribution else (tokens, picked)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [B, V], tokens [B] -> [B, 1 + 2k] float64: per row the model's log-probability of
    its token, then the ``k`` best log-probabilities and their token ids (exact in float64), so
    one host copy brings back every row's log-probs."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(k, dim=-1)
    return torch.cat([t.double() for t in (logp.gather(-1, tokens[:, None]), top.values, top.indices)], dim=1)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Steele, Lea and Flood 2014) on uint64 arrays: a bijection
    whose outputs pass BigCrush for consecutive inputs (numpy's uint64 arithmetic wraps)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def counter_uniforms(seeds: list[int], counters: list[int], n: int) -> np.ndarray:
    """Row b's ``n`` uniform draws for key (``seeds[b]``, ``counters[b]``) as int64 numerators of
    ``2**-53`` in ``[0, 2**53)`` [len(seeds), n]: draw j is a hash of (seed, counter, j), so a
    request's draws depend on its own key only, and a new counter (its position) gives new,
    independent draws. Seeds are any 64-bit ints (negative ones wrap); counters >= 0."""
    with np.errstate(over="ignore"):
        seed = np.array([s % 2**64 for s in seeds], dtype=np.uint64)[:, None]
        counter = np.array(counters, dtype=np.uint64)[:, None]
        h = _splitmix64(_splitmix64(_splitmix64(seed) ^ counter) ^ np.arange(n, dtype=np.uint64)[None])
    return (h >> np.uint64(11)).astype(np.int64)


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] (any non-negative weights; fp32) from the uniform
    ``u`` [B] in [0, 1) (fp64): the first token whose cumulative weight exceeds ``u`` times the
    row's total, the cumulative sums in fp64 (so the draw follows ``probs`` to fp64 rounding, not
    fp32's ~1e-7 per token of a 65K-token vocabulary). A token of weight 0 is never drawn."""
    cdf = probs.double().cumsum(-1)
    x = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)
