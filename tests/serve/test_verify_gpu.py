"""The speculative decoding passes on CUDA (bf16: fla kernels, the paged MLA kernel) as CUDA
graphs against the same passes run eagerly: the target's verify step and its commit (with a
padding row in the graph's batch, and without), and the drafting loops of both drafters (the
separate draft model's decode graphs, the EAGLE-3 draft's chain-step graphs). The end-to-end
checks under graphs are ``test_engine_gpu.py`` and ``test_eagle_engine_gpu.py``. Run on the
device: ``pytest -m gpu tests/serve/test_verify_gpu.py``."""

from __future__ import annotations

import copy

import pytest
import torch

from openk3 import build_model, preset
from openk3.model.draft import DraftConfig, Eagle3Draft
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer
from tests.serve.test_verify import K, decoding

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 9, 200, 17, 3000, 41, 8] * 9, [11, 12], list(range(400, 530)), [77] * 40]
DRAFTS = torch.tensor([[100, 2000, 33], [9, -1, -1], [1, 2, -1], [5, 6, 7]])
KS, NUM_KEPT = [3, 1, 2, 3], [2, 1, 3, 4]


def cuda_model():
    torch.manual_seed(0)
    model = build_model(preset("debug"), device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():  # peaked next-token distributions: a wrong context moves the logits
        model.lm_head.weight.mul_(10)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("n", [3, 4])  # 3 rows: the graph of 4 pads one row
def test_captured_verify_and_commit_equal_eager(n):
    runner, seqs = decoding(cuda_model(), PROMPTS[:n], cuda_graphs=True, physical_block_size=64,
                            hash_block_size=16, max_model_len=256)
    tensors = [*runner.kda_state.tensors(), *runner.mla_cache.values()]
    start = [t.clone() for t in tensors]
    results = {}
    for graphs in (True, False):
        for t, s in zip(tensors, start):
            t.copy_(s)
        runner.verifier.graphs.enabled = graphs
        with torch.inference_mode():
            hidden, _ = runner.verifier.forward(seqs, KS[:n], DRAFTS[:n].cuda())
            hidden = hidden.clone()
            runner.verifier.commit(NUM_KEPT[:n])
        results[graphs] = hidden, [t.clone() for t in tensors]
    assert list(runner.verifier.graphs) == [4]
    (h_graph, t_graph), (h_eager, t_eager) = results[True], results[False]
    for b, k in enumerate(KS[:n]):  # the padded positions' outputs are never read
        assert rel_err(h_graph[b, :k + 1], h_eager[b, :k + 1]) < 2e-2
    slots = [s.state_slot for s in seqs]
    for a, e in zip(t_graph[:4], t_eager[:4]):  # KDA states of the rows (the scratch slot: anything)
        assert rel_err(a[:, slots], e[:, slots]) < 2e-2
    bs = runner.block_size
    for a, e in zip(t_graph[4:], t_eager[4:]):  # MLA latents of every kept position
        rows = [s.block_table[p // bs] * bs + p % bs for s, kept in zip(seqs, NUM_KEPT)
                for p in range(s.num_tokens - 1 + kept)]
        assert rel_err(a[rows], e[rows]) < 2e-2


def engine(model, draft) -> LLMEngine:
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, physical_block_size=64, hash_block_size=16,
                          kda_checkpoint_interval=64, max_model_len=512, num_speculative_tokens=K)
    return LLMEngine(model, ByteTokenizer(), config, eos_token_ids=(), draft_model=draft)


@pytest.mark.parametrize("kind", ["eagle", "model"])
def test_captured_drafting_equals_eager(kind):
    """Every proposal of a run (greedy) made twice from the same state, under CUDA graphs and
    eagerly: the same draft tokens (a random draft: near-ties are rare)."""
    model = cuda_model()
    if kind == "eagle":
        with torch.device("cuda"):
            draft = Eagle3Draft(DraftConfig.for_target(model.cfg))
        draft.init_weights(1)
    else:
        draft = copy.deepcopy(model)
        with torch.no_grad():
            draft.lm_head.weight.add_(torch.randn_like(draft.lm_head.weight) * draft.lm_head.weight.std() * 0.3)
    eng = engine(model, draft)
    drafter, propose, compared = eng.drafter, eng.drafter.propose, []
    graphs = drafter.graphs if kind == "eagle" else drafter.runner._graphs
    states = [] if kind == "eagle" else drafter.runner.kda_state.tensors()

    def twice(out, params, generators):
        saved = [t.clone() for t in states]
        got = propose(out, params, generators)
        if got is not None and all(s.request_id in out.num_draft_tokens for s, _ in out.scheduled):
            for t, s in zip(states, saved):  # the separate draft model's loop wrote its states
                t.copy_(s)
            graphs.enabled = False
            try:
                eager = propose(out, params, generators)
            finally:
                graphs.enabled = True
            compared.append((got[0] == eager[0]).float().mean().item())
        return got

    drafter.propose = twice
    prompts = [torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (7, 33, 150, 64)]
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert len(graphs) >= 1 and len(compared) >= 5, (list(graphs), len(compared))
    assert sum(compared) / len(compared) > 0.97, compared
