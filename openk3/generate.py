"""Small, exact generation: prefill, then one token at a time through the model cache.

This is the single-user path behind ``openk3 generate``; the batched serving engine is separate.
"""

from __future__ import annotations

from typing import Callable

import torch

from openk3.model.model import KimiForCausalLM
from openk3.serve.sampler import SamplingParams, sample
from openk3.vision.preprocess import PackedImages


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits: [B, V] -> token ids [B]. ``temperature == 0`` is greedy."""
    params = SamplingParams(temperature=temperature, top_p=top_p)
    return sample(logits, [params] * logits.shape[0], [generator] * logits.shape[0])[0]


@torch.no_grad()
def generate_batch(model: KimiForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                   eos_token_id: int | None = None,
                   on_token: Callable[[int, int], None] | None = None,
                   images: PackedImages | None = None) -> list[list[int]]:
    """Generate for equal-length prompts in one batch; returns the new tokens of each.

    ``images``: the prompts' images, whose features fill their placeholder tokens (prefill only).

    ``on_token(sequence_index, token_id)`` is called as tokens appear (streaming). A sequence
    stops at ``eos_token_id`` (which is included) or after ``max_new_tokens``.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("generate_batch: prompts must have equal lengths (use generate)")
    device = next(model.parameters()).device
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
    cache = model.new_cache()
    ids = torch.tensor(prompts, device=device)
    logits = model(ids, cache, logits_to_keep=1,
                   images=None if images is None else images.to(device)).logits[:, -1]
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_p, gen)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
                if on_token:
                    on_token(i, t)
                done[i] = t == eos_token_id
        if all(done) or len(out[0]) == max_new_tokens:
            break
        logits = model(nxt.unsqueeze(1), cache).logits[:, -1]
    return out


def generate(model: KimiForCausalLM, prompt: list[int], max_new_tokens: int, **kw) -> list[int]:
    """One sequence; keyword arguments as ``generate_batch``."""
    on_token = kw.pop("on_token", None)
    return generate_batch(model, [prompt], max_new_tokens,
                          on_token=(lambda _, t: on_token(t)) if on_token else None, **kw)[0]
