"""The EAGLE-3 draft in the engine on CUDA (bf16: fla kernels, varlen attention, CUDA graphs of
the decode, verify and commit passes and of the draft's chain steps and observe passes): the
log-probability the engine reports for each output token against a fresh full-sequence forward
(teacher-forced, as ``test_engine_gpu.py``), and the echo draft's acceptance (``test_eagle_engine.echo_pair``), which drops if the draft reads the wrong
features or tokens; sampled drafting in its graph (counter-based uniforms) against the target's
joint distribution (``test_eagle_engine._pair_statistic``). Run on the device: ``pytest -m gpu tests/serve/test_eagle_engine_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from openk3 import build_model, preset
from openk3.model.draft import DraftConfig, Eagle3Draft
from openk3.model.model import _keep_fp32
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer
from tests.serve.test_eagle_engine import _chi2_crit, _draft, _model, _pair_statistic, echo_pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def make_engine(model, draft, K: int = 3) -> LLMEngine:
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=96, physical_block_size=64, hash_block_size=16,
                          kda_checkpoint_interval=64, max_model_len=1024, num_speculative_tokens=K)
    return LLMEngine(model, ByteTokenizer(), config, eos_token_ids=(), draft_model=draft)


def test_eagle_engine_logprobs_match_full_forward():
    torch.manual_seed(0)
    model = build_model(preset("debug"), device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():  # peaked next-token distributions: a wrong context moves log-probs
        model.lm_head.weight.mul_(10)
    with torch.device("cuda"):
        draft = Eagle3Draft(DraftConfig.for_target(model.cfg))
    draft.init_weights(1)
    eng = make_engine(model, draft)
    prompts = [torch.randint(3, 4000, (n,)).tolist() for n in (7, 33, 150, 64, 1)]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=1))
    assert eng.stats.spec_verifications > 0
    # the verify steps, the draft's greedy chains and its observe passes ran as CUDA graphs
    assert eng.runner.verifier.graphs and {kind for kind, _ in eng.drafter.graphs} == {"greedy", "observe"}
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


def test_echo_draft_is_accepted_on_cuda():
    target, draft = echo_pair()
    target = target.to("cuda", torch.bfloat16)
    _keep_fp32(target)  # router and KDA decay in fp32, as build_model leaves them
    eng = make_engine(target, draft.to("cuda"), K=5)
    prompts = [torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 40, 130, 9)]
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    s = eng.stats
    # every draft is the target's next token up to bf16 near-ties; a wrong offset accepts ~0
    assert s.spec_verifications > 0 and s.spec_acceptance_rate > 0.9, s


def test_sampled_chain_in_a_graph_follows_the_target():
    """Temperature 1 with graphs (bf16, the reference forward's too: their differences move
    probabilities by ~1%, far below what 800 draws resolve): the chains run as one graph per
    bucket ("sampled"), and 800 requests' first two tokens follow the target's joint distribution
    (chi-square at 1e-3, as on the CPU: ``test_eagle_engine.test_sampled_tokens_follow_the_target``)."""
    target = _model(4, vocab_size=5)
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
    draft = _draft(target, 5).to("cuda", torch.bfloat16)
    target = target.to("cuda", torch.bfloat16)
    _keep_fp32(target)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, physical_block_size=64, hash_block_size=16,
                          kda_checkpoint_interval=64, max_model_len=256, num_speculative_tokens=2)
    eng = LLMEngine(target, ByteTokenizer(), config, eos_token_ids=(), draft_model=draft)
    stat, df = _pair_statistic(eng, target, [1, 3, 0, 4, 2], 800)
    assert "sampled" in {kind for kind, _ in eng.drafter.graphs}
    assert eng.stats.spec_draft_tokens == 800 and 0.2 < eng.stats.spec_acceptance_rate < 0.9
    assert stat < _chi2_crit(df), f"chi2 = {stat:.1f} with {df} dof"


def test_speculative_graphs_captured_at_start_serve_as_those_captured_on_first_use():
    """``capture_graphs`` (``openk3 serve`` before it listens) captures the verify pass and the
    draft's chains (greedy, sampled, filtered) and update of every decode bucket too; greedy and
    seeded sampled requests then capture nothing more and generate what an engine capturing on
    first use generates."""
    torch.manual_seed(0)
    model = build_model(preset("debug"), device="cuda", dtype=torch.bfloat16).eval()
    with torch.device("cuda"):
        draft = Eagle3Draft(DraftConfig.for_target(model.cfg))
    draft.init_weights(1)
    prompts = [torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 33, 90)]
    params = [SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=1.0, seed=5, max_tokens=16),
              SamplingParams(temperature=0.8, top_p=0.9, seed=6, max_tokens=16)]
    expected = [o.token_ids for o in make_engine(model, draft).generate(prompts, params)]
    eng = make_engine(model, draft)
    decode = eng.runner.graph_sizes()[0]
    seen = []
    eng.capture_graphs(lambda kind, size: seen.append((kind, size)))
    assert {k for k in seen if k[0] in ("verify", "draft greedy", "draft sampled", "draft filtered", "draft observe")} \
        == {(kind, B) for B in decode for kind in ("verify", "draft greedy", "draft sampled", "draft filtered",
                                                   "draft observe")}
    captured = dict(eng.runner.verifier.graphs), dict(eng.drafter.graphs)
    assert set(captured[0]) == set(decode) and len(captured[1]) == 4 * len(decode)
    assert [o.token_ids for o in eng.generate(prompts, params)] == expected
    assert eng.stats.spec_verifications > 0
    assert (eng.runner.verifier.graphs, eng.drafter.graphs) == captured  # the same graph objects
