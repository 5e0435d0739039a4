"""Serving with a million-token ``max_model_len`` (``docs/long_context.md``, "Serving at 1M
tokens"): a prompt of many prefill chunks against the model's full forward, the cache sized for
the whole context, and the errors of a context the cache or the GPU cannot hold."""

from __future__ import annotations

import pytest
import torch

from openk3 import build_model, preset
from openk3.ops.varlen_attention import varlen_causal_attention, varlen_causal_attention_ref
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.model_runner import ModelRunner
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer

MILLION = 1 << 20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(preset("debug")).eval()
    with torch.no_grad():  # peaked next-token distributions, so a wrong context changes tokens
        m.lm_head.weight.mul_(10)
    return m


def greedy_full_forward(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens, each from a fresh forward over the whole sequence (no cache), and
    their log-probabilities."""
    ids, logps = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            ids.append(int(logp.argmax()))
            logps.append(float(logp[ids[-1]]))
    return ids[len(prompt):], logps


def test_long_prompt_with_a_million_token_context_matches_full_forward(model):
    """A 1M-token ``max_model_len`` (block table and latent pool sized for it: 16,386 blocks of
    64) serving a 300-token prompt in 6 chunks of at most 64 tokens (two cut at a KDA checkpoint:
    128 and the prompt's last hash boundary, 288): the first tokens and their log-probabilities
    are the full forward's."""
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=MILLION + 64,
                          physical_block_size=64, hash_block_size=16, kda_checkpoint_interval=128,
                          cuda_graphs=False)
    eng = LLMEngine(model, ByteTokenizer(), config, eos_token_ids=())
    assert eng.max_model_len == MILLION + 64
    assert eng.runner.block_tables.shape == (2, (MILLION + 64) // 64 + 1)
    prompt = torch.randint(3, 4000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = []
    execute = eng.runner.execute
    eng.runner.execute = lambda out, *rest: steps.append(out.num_batched_tokens) or execute(out, *rest)
    out, = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=0))
    assert steps == [64, 64, 64, 64, 32, 12, 1, 1]
    want_ids, want_logps = greedy_full_forward(model, prompt, 3)
    assert out.token_ids == want_ids
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(want_logps, abs=1e-4)


@pytest.mark.parametrize("sizing, limit, fix", [
    ({"cache_memory_gb": 0.01}, "EngineConfig.cache_memory_gb=0.01", "raise cache_memory_gb to at least 0.25"),
    ({"num_blocks": 100}, "EngineConfig.num_blocks=100", "raise num_blocks to 1563"),
])
def test_max_model_len_larger_than_the_cache_names_the_field_and_the_memory(model, sizing, limit, fix):
    """debug in fp32: 2 MLA layers x 48 x 4 = 384 bytes per token; 100,000 tokens need 1,563
    blocks of 64, 36.63 MiB. The suggested setting then serves that context."""
    config = {"max_model_len": 100_000, "max_num_seqs": 1, "physical_block_size": 64, "hash_block_size": 16,
              "kda_checkpoint_interval": 64, "cuda_graphs": False}
    with pytest.raises(ValueError) as e:
        ModelRunner(model, EngineConfig(**config, **sizing))
    msg = str(e.value)
    assert msg.startswith("EngineConfig.max_model_len=100000: one sequence needs 1563 MLA blocks of 64 tokens, "
                          "36.63 MiB of latent cache (384 bytes per token)")
    assert limit in msg and fix in msg, msg
    key, _ = next(iter(sizing.items()))
    fixed = {"cache_memory_gb": 0.25} if key == "cache_memory_gb" else {"num_blocks": 1563}
    assert ModelRunner(model, EngineConfig(**config, **fixed)).max_model_len == 100_000


def test_without_max_model_len_the_context_is_what_the_cache_holds(model):
    """No ``max_model_len``: ``max_position_embeddings`` (8192), capped by the pool, silently."""
    runner = ModelRunner(model, EngineConfig(num_blocks=10, physical_block_size=64, hash_block_size=16,
                                             kda_checkpoint_interval=64, cuda_graphs=False))
    assert runner.max_model_len == 10 * 64 - 1


@pytest.mark.gpu
@needs_cuda
def test_a_cache_larger_than_free_gpu_memory_is_refused():
    model = build_model(preset("debug"), device="cuda", dtype=torch.bfloat16)
    free, _ = torch.cuda.mem_get_info()
    num_blocks = 2 * free // (6144 * 2 * 48 * 2)  # twice the free memory in bf16 latents
    with pytest.raises(ValueError, match=r"the MLA cache needs .* GiB but cuda:0 has .* GiB free: lower "
                                         r"EngineConfig.cache_memory_gb=8.0, num_blocks="):
        ModelRunner(model, EngineConfig(num_blocks=int(num_blocks)))


@pytest.mark.gpu
@needs_cuda
def test_prefill_attention_over_a_long_prefix_has_no_score_matrix():
    """The prefill's attention fast path (FlashAttention-2 varlen, bf16): 1,024 queries over
    262,144 keys, 8 heads 192 / 128 wide (small's MLA), allocate the zero-padded values (768 MiB)
    and the output, not the 8 GiB of fp32 scores [H, Tq, Tk]."""
    Tq, Tk, H = 1024, 262144, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(T, H, 192, device="cuda", dtype=torch.bfloat16, generator=g) for T in (Tq, Tk))
    v = torch.randn(Tk, H, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cu_q, cu_k = torch.tensor([0, Tq]), torch.tensor([0, Tk])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = varlen_causal_attention(q, k, v, cu_q.cuda(), cu_k.cuda(), cu_q, cu_k, 192 ** -0.5)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < Tk * H * 192 * 2 + 64 * 2**20
    ref = varlen_causal_attention_ref(q[-8:], k, v, torch.tensor([0, 8]), cu_k, 192 ** -0.5)
    err = ((out[-8:].float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 2e-2, err
