"""The fixed-shape verify step (``openk3/serve/verify.py``) on the ``debug`` model in fp32 on CPU,
against the model's own forward from scratch (the reference): the logits of every verified
position, rows with fewer drafts than K (padded positions), a padding row of the scratch slot,
and the rollback after rejections (``commit``: the KDA recurrent and convolution states, and
the MLA latents, of the kept positions only). The engine-level checks of the same path (greedy
outputs equal plain decoding's with rejections) are ``test_speculative_engine.py`` and
``test_eagle_engine.py``; ``test_verify_gpu.py`` replays the CUDA graphs against this eager path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.spec_bench import HostCounts
from openk3 import build_model, preset
from openk3.model.draft import DraftConfig, Eagle3Draft
from openk3.serve.block_manager import BlockManager, BlockTableUpdate
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.model_runner import ModelRunner
from openk3.serve.sampler import SamplingParams
from openk3.serve.scheduler import Scheduler, SchedulerOutput
from openk3.serve.sequence import Sequence
from openk3.tokenizer import ByteTokenizer

K = 3
PROMPTS = [[5, 9, 200, 17, 3000, 41, 8], [11, 12], [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410]]
CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, physical_block_size=8, hash_block_size=8,
                      kda_checkpoint_interval=64, max_model_len=64, cuda_graphs=False,
                      enable_prefix_caching=False)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(preset("debug"), seed=0).eval()
    with torch.no_grad():  # non-uniform AttnRes mixing and a peaked head: every input matters
        for name, p in m.named_parameters():
            if name.endswith("_res.proj.weight"):
                p.normal_(0, 0.5)
        m.lm_head.weight.mul_(4)
    return m


def decoding(model, prompts=PROMPTS, **overrides):
    """A runner (K drafts) whose sequences have prefilled ``prompts`` and sampled one token
    (token 7): n tokens each, n - 1 computed, blocks for K more positions."""
    config = dataclasses.replace(CONFIG, **overrides)
    runner = ModelRunner(model, dataclasses.replace(config, num_speculative_tokens=K))
    bm = BlockManager(config, runner.num_blocks, num_state_slots=config.max_num_seqs)
    scheduler = Scheduler(config, bm, runner.max_model_len)  # plans no drafts: K = 0 there
    seqs = [Sequence(f"r{i}", p, max_tokens=16) for i, p in enumerate(prompts)]
    for s in seqs:
        scheduler.add_request(s)
    with torch.inference_mode():
        runner.execute(scheduler.step())
    scheduler.postprocess([s.request_id for s in seqs], [[7]] * len(seqs))
    for s in seqs:
        bm.append_slot(s, K)  # blocks for the verified positions, as the scheduler plans them
    with torch.inference_mode():
        runner.update_block_tables(scheduler_updates(seqs))
    return runner, seqs


def scheduler_updates(seqs) -> SchedulerOutput:
    """A scheduler output whose only instructions are the sequences' whole block tables."""
    return SchedulerOutput(block_table_updates=[BlockTableUpdate(s.state_slot, 0, tuple(s.block_table)) for s in seqs])


@pytest.fixture(scope="module")
def prefilled(model):
    return decoding(model)


@pytest.fixture
def runner_and_seqs(prefilled):
    """The prefilled runner and sequences; its caches are restored after the test."""
    runner, seqs = prefilled
    saved = [t.clone() for t in [*runner.kda_state.tensors(), *runner.mla_cache.values()]]
    yield runner, seqs
    for t, s in zip([*runner.kda_state.tensors(), *runner.mla_cache.values()], saved):
        t.copy_(s)


DRAFTS = torch.tensor([[100, 2000, 33], [9, -1, -1], [1, 2, -1]])  # k = 3, 1, 2: padded positions
KS = [3, 1, 2]


_REFERENCES: dict[tuple[int, ...], tuple] = {}


def reference(model, ids: list[int]):
    """Logits [T, V] and the generate path's cache after feeding ``ids`` from scratch."""
    if tuple(ids) not in _REFERENCES:
        cache = model.new_cache()
        with torch.inference_mode():
            _REFERENCES[tuple(ids)] = model(torch.tensor([ids]), cache).logits[0].float(), cache
    return _REFERENCES[tuple(ids)]


def kda_states(runner, slot: int) -> list[torch.Tensor]:
    return [t[:, slot].clone() for t in runner.kda_state.tensors()]


def test_verify_logits_equal_the_reference_and_leave_the_states(model, runner_and_seqs):
    runner, seqs = runner_and_seqs
    before = [kda_states(runner, s.state_slot) for s in seqs]
    with torch.inference_mode():
        hidden, features = runner.verifier.forward(seqs, KS, DRAFTS)
        logits = model.lm_head(hidden).float()
    assert logits.shape == (3, K + 1, model.cfg.vocab_size) and features is None
    for b, (s, k) in enumerate(zip(seqs, KS)):
        want, _ = reference(model, s.token_ids + DRAFTS[b, :k].tolist())
        n = s.num_tokens
        torch.testing.assert_close(logits[b, :k + 1], want[n - 1:n + k], atol=1e-4, rtol=1e-4)
        for x, y in zip(kda_states(runner, s.state_slot), before[b]):
            assert torch.equal(x, y)  # nothing written before the commit


@pytest.mark.parametrize("num_kept", [[1, 1, 1], [2, 2, 3], [4, 1, 2]])
def test_commit_leaves_the_states_of_the_kept_positions(model, runner_and_seqs, num_kept):
    """All rejected (only the last token kept), partial, all accepted: KDA states (recurrent and
    conv) and the MLA latents of every kept position are those of feeding the kept tokens."""
    runner, seqs = runner_and_seqs
    with torch.inference_mode():
        runner.verifier.forward(seqs, KS, DRAFTS)
        runner.verifier.commit(num_kept)
    for b, (s, kept) in enumerate(zip(seqs, num_kept)):
        ids = s.token_ids + DRAFTS[b, :kept - 1].tolist()
        _, cache = reference(model, ids)
        for i, layer in enumerate(cache.layers):
            if i in runner.mla_cache:
                bs = runner.block_size
                rows = [s.block_table[t // bs] * bs + t % bs for t in range(len(ids))]
                want = torch.cat([layer.latent[0], layer.k_rope[0]], dim=-1)
                torch.testing.assert_close(runner.mla_cache[i][rows], want, atol=1e-5, rtol=1e-5)
            else:
                k = runner.kda_index[i]
                got = [t[k, s.state_slot] for t in runner.kda_state.tensors()]
                # fp32 states after several recurrent steps: matmuls sum in a thread-count
                # dependent order (1.2e-5 apart with OMP_NUM_THREADS=1, under 1e-5 with 2)
                for x, y in zip(got, (layer.recurrent[0], layer.conv_qkv[0]), strict=True):
                    torch.testing.assert_close(x, y.to(x.dtype), atol=3e-5, rtol=1e-5)


def test_a_padding_row_changes_nothing(runner_and_seqs):
    """The rows a CUDA graph pads its batch with (the scratch slot, no drafts): the real rows'
    outputs and states are those without it, and it writes only the scratch block."""
    runner, seqs = runner_and_seqs
    start = [t.clone() for t in [*runner.kda_state.tensors(), *runner.mla_cache.values()]]
    results = []
    for padded in (False, True):
        for t, s in zip([*runner.kda_state.tensors(), *runner.mla_cache.values()], start):
            t.copy_(s)
        rows = [[s.state_slot for s in seqs], [s.num_tokens - 1 for s in seqs], KS, [s.token_ids[-1] for s in seqs]]
        drafts = DRAFTS
        if padded:
            rows = [r + [v] for r, v in zip(rows, (runner.scratch_slot, 0, 0, 0))]
            drafts = torch.cat([DRAFTS, torch.zeros(1, K, dtype=torch.long)])
        with torch.inference_mode():
            step = runner.verifier
            hidden, _, segments = step._forward(torch.tensor(rows), drafts, runner.max_blocks_per_seq)
            step._rollback(segments, torch.tensor(rows[0]), torch.tensor([2, 1, 3] + [1] * padded))
        scratch = slice(runner.scratch_block * runner.block_size, None)
        results.append((hidden[:3], [kda_states(runner, s.state_slot) for s in seqs],
                        {i: c[:scratch.start].clone() for i, c in runner.mla_cache.items()}))
    (h0, s0, c0), (h1, s1, c1) = results
    # the padding row changes the GEMMs' shapes, hence their fp32 summation order: the real rows
    # agree to rounding (2e-6 apart with OMP_NUM_THREADS=1); a wrong write would differ by O(1)
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1, h0, **tol)
    for a, b in zip(s0, s1):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, **tol)
    for i in c0:  # a write of the padding row outside the scratch block would differ by O(1)
        torch.testing.assert_close(c1[i], c0[i], **tol)


def test_commit_without_forward_is_refused(runner_and_seqs):
    runner, seqs = runner_and_seqs
    with pytest.raises(RuntimeError, match="commit without a forward"):
        runner.verifier.commit([1])
    with pytest.raises(ValueError, match=r"`drafts` must be \[1, K=3\]"):
        runner.verifier.forward(seqs[:1], [1], torch.zeros(1, 2, dtype=torch.long))


@pytest.mark.parametrize("kind", ["eagle", "model"])
def test_a_verify_step_reads_the_device_once(model, kind):
    """A step in which every sequence verifies drafts (greedy, no log-probs): the drafting loop,
    the verify pass, speculative sampling and the rollbacks read the device once (the accepted
    counts, tokens and drafts, in one copy) and copy nothing to it synchronously."""
    draft = model
    if kind == "eagle":
        draft = Eagle3Draft(DraftConfig.for_target(model.cfg))
        draft.init_weights(1)
    config = dataclasses.replace(CONFIG, num_speculative_tokens=K, max_num_batched_tokens=64)
    eng = LLMEngine(model, ByteTokenizer(), config, eos_token_ids=(), draft_model=draft)
    for p in PROMPTS[:2]:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=14))
    counts = HostCounts()  # the benchmark's counter (benchmarks/spec_bench.py --profile)
    steps = 0
    with counts.patched():
        while eng.has_unfinished():
            steady = not eng.scheduler.waiting and all(not s.is_prefill for s in eng.scheduler.running)
            counts.reads, counts.blocking_uploads, verified = [], 0, eng.stats.spec_verifications
            eng.step()
            if steady and eng.stats.spec_verifications - verified == len(PROMPTS[:2]):
                assert counts.reads == ["tolist"] and counts.blocking_uploads == 0, (
                    counts.reads, counts.blocking_uploads)
                steps += 1
    assert steps >= 2
