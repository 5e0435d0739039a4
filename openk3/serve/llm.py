"""``openk3.LLM``: offline batched generation through the serving engine.

    >>> llm = LLM(preset="debug", random_init=True, physical_block_size=64, hash_block_size=16,
    ...           kda_checkpoint_interval=64, max_model_len=512)
    >>> out = llm.generate(["def main():"], SamplingParams(temperature=0, max_tokens=8))
    >>> len(out[0].token_ids)
    8
"""

from __future__ import annotations

import torch

from openk3.serve.engine import EngineConfig, LLMEngine, RequestOutput
from openk3.serve.sampler import SamplingParams


def load_model(checkpoint: str | None = None, preset: str | None = None, random_init: bool = False,
               device: str | None = None, dtype: torch.dtype | None = None, seed: int = 0):
    """(model, tokenizer, name) for serving: a checkpoint directory, or a preset with random
    weights (``random_init=True``, byte tokenizer) for trying the engine without weights."""
    from openk3 import build_model, load_pretrained
    from openk3 import preset as get_preset
    from openk3.tokenizer import ByteTokenizer, load_tokenizer

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if (checkpoint is None) == (preset is None):
        raise ValueError("give exactly one of checkpoint (a directory) or preset (with random_init=True)")
    if checkpoint is not None:
        model = load_pretrained(checkpoint, dtype=dtype, device=device)
        return model.eval(), load_tokenizer(checkpoint), str(checkpoint).rstrip("/").split("/")[-1]
    if not random_init:
        raise ValueError(f"preset={preset!r} has no weights: pass random_init=True to serve random ones")
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    model = build_model(get_preset(preset), device=device, dtype=dtype, seed=seed).eval()
    return model, ByteTokenizer(), f"openk3-{preset}"


class LLM:
    """Keyword arguments other than the model's go to ``EngineConfig``."""

    def __init__(self, checkpoint: str | None = None, *, preset: str | None = None,
                 random_init: bool = False, device: str | None = None,
                 dtype: torch.dtype | None = None, seed: int = 0, **engine_config):
        model, tokenizer, name = load_model(checkpoint, preset, random_init, device, dtype, seed)
        self.engine = LLMEngine(model, tokenizer, EngineConfig(**engine_config), model_name=name)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self.engine.generate(list(prompts), sampling_params)
