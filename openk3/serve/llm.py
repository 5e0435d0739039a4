"""``openk3.LLM``: offline batched generation through the serving engine.

    >>> llm = LLM(preset="debug", random_init=True, physical_block_size=64, hash_block_size=16,
    ...           kda_checkpoint_interval=64, max_model_len=512)
    >>> out = llm.generate(["def main():"], SamplingParams(temperature=0, max_tokens=8))
    >>> len(out[0].token_ids)
    8

With a vision tower (a K3 checkpoint, or ``preset="debug-vl"``), a prompt may carry images:
``{"prompt": "what is this?", "images": [PIL.Image | path | bytes, ...]}``. Each image's
block goes where the prompt holds its one ``media_placeholder_token_id`` (``<|media_pad|>``),
or, with none in the prompt, first (docs/vision.md, "Serving images").
"""

from __future__ import annotations

import torch

from openk3.runtime import load_model
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine, RequestOutput
from openk3.serve.sampler import SamplingParams


class LLM:
    """The model as ``openk3.runtime.load_model`` loads it; the other keyword arguments are
    ``EngineConfig`` fields (speculative decoding: ``draft=DIR, num_speculative_tokens=K``);
    ``experts="packed"`` keeps the routed experts MXFP4-packed."""

    def __init__(self, checkpoint: str | None = None, *, preset: str | None = None,
                 random_init: bool = False, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, seed: int = 0,
                 tokenizer: str | None = None, experts: str = "dequantize", **engine_config):
        model, tokenizer, name = load_model(checkpoint, preset, random_init, device, dtype, seed,
                                            tokenizer, experts)
        self.engine = LLMEngine(model, tokenizer, EngineConfig(**engine_config), model_name=name)

    def generate(self, prompts: str | dict | list[str] | list[list[int]] | list[dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or ``{"prompt": ..., "images": [...]}``);
        outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self.engine.generate(list(prompts), sampling_params)
