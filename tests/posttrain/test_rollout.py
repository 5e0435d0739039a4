"""Rollouts from the serving engine: weights synchronised in place (the engine then answers as
a fresh engine over the new weights, prefix cache emptied), and the log-probability returned
with each sampled token is the policy's own (what the trainer recomputes)."""

from __future__ import annotations

import pytest
import torch

from openk3 import build_model
from openk3.posttrain.objective import completion_logprobs
from openk3.posttrain.rollout import RolloutEngine
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer

from .conftest import tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 12]]  # share a prefix-cached block


def _engine(policy, device="cpu", dtype=torch.float32, **kw):
    return RolloutEngine(policy, ByteTokenizer(), torch.device(device), dtype, max_num_seqs=4, max_model_len=64,
                         physical_block_size=16, hash_block_size=4, kda_checkpoint_interval=8, **kw)


def _perturbed(model, seed):
    new = build_model(model.cfg, device=model.lm_head.weight.device, seed=seed)
    return new


def _check_sync(device, dtype, **kw):
    torch.manual_seed(0)
    policy = build_model(tiny_config(kda=True), device=device, seed=1)
    rollouts = _engine(policy, device, dtype, enable_prefix_caching=True, **kw)
    eng = rollouts.engine
    before = [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS]  # the second hits the first's prefix
    assert eng.snapshot_stats().prefix_hits > 0
    policy2 = _perturbed(policy, seed=2)
    with torch.no_grad():
        policy.load_state_dict(policy2.state_dict())  # "the trainer's update"
    rollouts.sync(policy)
    assert eng.snapshot_stats().prefix_queries == 0  # the prefix cache was emptied
    after = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    fresh = [o.token_ids for o in _engine(policy2, device, dtype, **kw).engine.generate(PROMPTS, GREEDY)]
    assert after == fresh
    assert after != before


def test_sync_serves_new_weights_and_flushes_prefix_cache():
    _check_sync("cpu", torch.float32, cuda_graphs=False)


def test_resumed_trajectory_prefills_in_one_pass():
    """The rollout engine's prefix cache is off: a long resubmitted prefix is one prefill pass
    (with the cache on, its chunks end at every KDA checkpoint boundary and the prompt's last
    hash boundary)."""
    policy = build_model(tiny_config(kda=True), seed=1)
    prefix = [3 + i % 11 for i in range(37)]
    steps = {}
    for caching in (False, True):
        rollouts = _engine(policy, cuda_graphs=False, enable_prefix_caching=caching)
        rollouts.submit(0, prefix, 1)
        while rollouts.has_unfinished():
            rollouts.step()
        steps[caching] = rollouts.engine.stats.num_steps
    assert _engine(policy).engine.config.enable_prefix_caching is False
    assert steps == {False: 1, True: 6}  # with the cache: chunks end at 8, 16, 24, 32, 36 and 37


def test_sync_refused_while_running():
    policy = build_model(tiny_config(), seed=1)
    rollouts = _engine(policy, cuda_graphs=False)
    rollouts.submit(0, [3, 4, 5], 4)
    with pytest.raises(RuntimeError, match="requests are running"):
        rollouts.sync(policy)
    rollouts.abort_all()
    rollouts.sync(policy)


def test_rollout_logprobs_are_the_policys():
    torch.manual_seed(0)
    policy = build_model(tiny_config(kda=True), seed=1)
    rollouts = _engine(policy, cuda_graphs=False, enable_prefix_caching=False)
    prompts = {0: [3, 4, 5], 1: [6, 7, 8, 9, 10]}
    for key, ids in prompts.items():
        rollouts.submit(key, ids, 5, stop=("\n",))
    got = {k: ([], []) for k in prompts}
    while rollouts.has_unfinished():
        for piece in rollouts.step():
            got[piece.key][0].extend(piece.token_ids)
            got[piece.key][1].extend(piece.logprobs)
    keys = list(prompts)
    with torch.no_grad():
        want, _ = completion_logprobs(policy, [prompts[k] for k in keys], [got[k][0] for k in keys])
    for i, k in enumerate(keys):
        assert len(got[k][0]) == len(got[k][1]) > 0
        torch.testing.assert_close(torch.tensor(got[k][1]), want[i, :len(got[k][0])].double(),
                                   atol=1e-4, rtol=1e-4, check_dtype=False)


@pytest.mark.gpu
def test_sync_with_cuda_graphs_gpu():
    """bf16 and CUDA graphs: graphs captured before the sync replay with the new weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_sync("cuda", torch.bfloat16, cuda_graphs=True)
