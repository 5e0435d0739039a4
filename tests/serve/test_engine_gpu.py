"""The serving engine on CUDA (fla kernels, varlen prefill, CUDA-graph decode) against the
model's own full-sequence forward. Run on the device: ``pytest -m gpu tests/serve``.

bf16 (the routed experts' grouped matmul, which CUDA graphs need, is bf16-only), so greedy
continuations of a random model may legitimately differ between paths after a near-tie.
The check is therefore teacher-forced: whatever tokens the engine chose, the log-probability it
reports for each must match a fresh full-sequence forward over prompt + chosen tokens."""

from __future__ import annotations

import pytest
import torch

from openk3 import build_model, preset
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("graphs", [True, False])
def test_engine_logprobs_match_full_forward(graphs):
    torch.manual_seed(0)
    model = build_model(preset("debug"), device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():  # peaked next-token distributions: a wrong context moves log-probs
        model.lm_head.weight.mul_(10)  # by whole units (a flat random model would hide it)
    prompts = [torch.randint(3, 4000, (n,)).tolist() for n in (7, 33, 150, 64, 1)]
    eng = LLMEngine(model, ByteTokenizer(), EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=96, physical_block_size=64, hash_block_size=16,
        kda_checkpoint_interval=64, max_model_len=1024, cuda_graphs=graphs), eos_token_ids=())
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=1))
    assert bool(eng.runner._graphs) == graphs
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    errs = []
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p + o.token_ids[:-1]], device="cuda")
        with torch.inference_mode():
            logp = torch.log_softmax(model(ids).logits[0, len(p) - 1:].float(), dim=-1)
        want = logp.gather(1, torch.tensor(o.token_ids, device="cuda")[:, None])[:, 0]
        got = torch.tensor([lp.logprob for lp in o.logprobs], device="cuda")
        errs.append((got - want).abs())
    errs = torch.cat(errs)
    # bf16 paths that differ in kernels and batching; a wrong state or context costs > 1
    assert errs.mean() < 0.1 and errs.max() < 0.5, (errs.mean().item(), errs.max().item())
