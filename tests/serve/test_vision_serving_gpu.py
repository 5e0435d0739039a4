"""Images through the serving engine on CUDA (bf16: the tower's FlashAttention varlen path, packed
prefill chunks cutting through placeholder runs, CUDA-graph decode) against the model's own
full-sequence forward with the same images. Run on the device: ``pytest -m gpu tests/serve``.

Teacher-forced, as ``test_engine_gpu.py``: whatever tokens the engine chose, the log-probability
it reports for each must match a fresh forward over prompt + chosen tokens with the images; the
same forward without the images must disagree (so the check sees the image features)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from openk3 import build_model, preset
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import VisibleTokenizer
from openk3.vision.preprocess import pack_images

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PAD = 300


def noise(seed: int, width: int, height: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=g) * 255).byte().numpy())


def errors(model, ids: torch.Tensor, out, got: torch.Tensor, images) -> torch.Tensor:
    """|got - the full forward's log-probs of ``out``'s tokens| over ``ids`` [1, T]."""
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids, images=images).logits[0, len(out.prompt_token_ids) - 1:].float(), dim=-1)
    return (got - logp.gather(1, torch.tensor(out.token_ids, device=ids.device)[:, None])[:, 0]).abs()


def logprob_errors(device: str, dtype: torch.dtype, graphs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """|engine log-prob - full forward log-prob| of every generated token, with the images in
    the forward and without them."""
    cfg = preset("debug-vl")
    cfg = cfg.replace(vocab_size=384, vision_config=dataclasses.replace(cfg.vision_config,
                                                                        media_placeholder_token_id=PAD))
    model = build_model(cfg, device=device, dtype=dtype, seed=0).eval()
    with torch.no_grad():  # peaked distributions and a strong image signal
        model.lm_head.weight.mul_(10)
        model.mm_projector.post_norm.weight.mul_(4)
    eng = LLMEngine(model, VisibleTokenizer(), EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=16, physical_block_size=64, hash_block_size=16,
        kda_checkpoint_interval=64, max_model_len=512, cuda_graphs=graphs), eos_token_ids=())
    requests = [([noise(1, 224, 168)], "what is this?"), ([], "text only"),
                ([noise(2, 84, 84), noise(3, 112, 56)], "compare them"), ([noise(4, 56, 56)], "x")]
    outs = eng.generate([{"prompt": p, "images": ims} if ims else p for ims, p in requests],
                        SamplingParams(temperature=0, max_tokens=16, logprobs=1))
    assert bool(eng.runner._graphs) == graphs and eng.runner.num_images_encoded == 4
    with_images, without = [], []
    for (ims, _), o in zip(requests, outs):
        ids = torch.tensor([o.prompt_token_ids + o.token_ids[:-1]], device=device)
        got = torch.tensor([lp.logprob for lp in o.logprobs], device=device)
        images = pack_images(ims, cfg.vision_config).to(device) if ims else None
        with_images.append(errors(model, ids, o, got, images))
        if ims:  # the placeholders embedded as plain tokens
            without.append(errors(model, ids, o, got, None))
    return torch.cat(with_images), torch.cat(without)


@pytest.mark.parametrize("graphs", [True, False])
def test_engine_with_images_matches_full_forward(graphs):
    errs, blind = logprob_errors("cuda", torch.bfloat16, graphs)
    # bf16 paths that differ in kernels and batching; a wrong context costs > 1
    assert errs.mean() < 0.1 and errs.max() < 0.5, (errs.mean().item(), errs.max().item())
    assert blind.mean() > 1.0, blind.mean().item()  # the check depends on the image features
