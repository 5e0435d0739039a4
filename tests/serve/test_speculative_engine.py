"""Speculative decoding in the engine, on the debug model on CPU: greedy outputs equal plain
decoding's (with a draft that always agrees, and with one that mostly does not), the KDA state
after rollback, seeded sampling independent of the batch, stop strings / max_tokens / eos in an
emitted run, prefix caching, aborts, stats and configuration errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openk3 import build_model, preset
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _model(seed: int):
    torch.manual_seed(seed)
    m = build_model(preset("debug"), seed=seed).eval()
    with torch.no_grad():  # non-uniform AttnRes mixing, so every source matters
        for name, p in m.named_parameters():
            if name.endswith("_res.proj.weight"):
                p.normal_(0, 0.5)
    return m


@pytest.fixture(scope="module")
def model():
    return _model(0)


@pytest.fixture(scope="module")
def other():
    """A different random model: its drafts are mostly rejected."""
    return _model(1)


def make_engine(model, draft=None, **kw) -> LLMEngine:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=64, physical_block_size=32, hash_block_size=8,
               kda_checkpoint_interval=16, max_model_len=256, cuda_graphs=False)
    return LLMEngine(model, ByteTokenizer(), EngineConfig(**{**cfg, **kw}), eos_token_ids=(), draft_model=draft)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [tokens(i, n) for i, n in enumerate((5, 23, 9, 1))]


def assert_free(eng: LLMEngine) -> None:
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_free_state_slots == bm.num_state_slots
    assert not eng.requests and not eng.scheduler.has_unfinished() and not bm.pending_checkpoints


@pytest.fixture(scope="module")
def plain(model):
    return [o.token_ids for o in make_engine(model).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("K", [1, 3, 5])
def test_greedy_self_draft_accepts_everything(model, plain, K):
    eng = make_engine(model, model, num_speculative_tokens=K)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == plain
    s = eng.stats
    assert s.spec_verifications > 0 and s.spec_accepted_tokens == s.spec_draft_tokens
    # k < K only where max_tokens or a checkpoint boundary leaves less room
    assert s.spec_draft_tokens <= K * s.spec_verifications
    assert_free(eng)


@pytest.mark.parametrize("K", [1, 3, 5])
def test_greedy_rejecting_draft(model, other, plain, K):
    eng = make_engine(model, other, num_speculative_tokens=K)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == plain
    assert eng.stats.spec_accepted_tokens < eng.stats.spec_draft_tokens  # rollbacks happened
    assert_free(eng)
