"""Speculative decoding in the engine, on the debug model on CPU: greedy outputs equal plain
decoding's (with a draft that always agrees, and with one that mostly does not), the KDA state
after rollback, seeded sampling independent of the batch, stop strings / max_tokens / eos in an
emitted run, prefix caching, aborts, stats and configuration errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from openk3 import LLM, build_model, preset, save_pretrained
from openk3.cli import main
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.metrics import ServerMetrics
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
    """A different random model: its greedy drafts are all rejected."""
    return _model(1)


@pytest.fixture(scope="module")
def noisy(model):
    """The target with noise on its output head: about half of its greedy drafts are accepted."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        w = m.lm_head.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * w.std() * 0.3)
    return m


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
@pytest.mark.parametrize("draft", ["other", "noisy"])
def test_greedy_rejecting_draft(request, model, plain, draft, K):
    eng = make_engine(model, request.getfixturevalue(draft), num_speculative_tokens=K)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == plain
    assert eng.stats.spec_accepted_tokens < eng.stats.spec_draft_tokens  # rollbacks happened
    assert_free(eng)


class TagTokenizer:
    """Every id decodes to ``<id>``: stop strings can be placed on, and across, tokens."""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.strip("<>").split("><")]

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def kda_state(runner, slot: int) -> list[torch.Tensor]:
    return [t[:, slot].clone() for t in runner.kda_state.tensors()]


def test_rollback_leaves_the_state_of_the_kept_tokens(model, noisy):
    """Mid-generation, after rejections, the target's and the draft's KDA states (recurrent and
    conv) of a sequence equal those of a plain prefill of its computed tokens."""
    eng = make_engine(model, noisy, num_speculative_tokens=3, enable_prefix_caching=False)
    eng.add_request(PROMPTS[1], dataclasses.replace(GREEDY, max_tokens=40))
    while eng.stats.spec_verifications < 6:
        eng.step()
    assert 0 < eng.stats.spec_accepted_tokens < eng.stats.spec_draft_tokens
    (seq,) = eng.scheduler.running
    assert seq.num_computed_tokens == seq.num_tokens - 1
    computed = seq.token_ids[:seq.num_computed_tokens]
    for runner, m in ((eng.runner, model), (eng.drafter.runner, noisy)):
        ref = make_engine(m, enable_prefix_caching=False)
        ref.add_request(computed, dataclasses.replace(GREEDY, max_tokens=2))
        ref.step()  # the whole prompt in one prefill pass
        (ref_seq,) = ref.scheduler.running
        for a, b in zip(kda_state(runner, seq.state_slot), kda_state(ref.runner, ref_seq.state_slot)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_independent_of_the_batch(model, noisy):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16)
    alone = make_engine(model, noisy, num_speculative_tokens=3).generate([PROMPTS[0]], params)[0]
    others = [SamplingParams(temperature=1.0, seed=11, max_tokens=12), SamplingParams(temperature=0.5, max_tokens=9),
              SamplingParams(temperature=0, max_tokens=14)]
    eng = make_engine(model, noisy, num_speculative_tokens=3)
    batch = eng.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[3]], [others[0], params, *others[1:]])
    assert batch[1].token_ids == alone.token_ids
    assert eng.stats.spec_accepted_tokens > 0
    assert_free(eng)


def test_a_prompt_chunk_ending_one_token_short_draws_the_same_tokens(model):
    """A chunk that ended at the prompt's last token but one (the batch's budget left it so, or a
    checkpoint boundary) made that token a speculating decode: the first tokens were drawn by
    speculative sampling instead of one plain sample, and a seeded request's tokens changed with
    its batch and with prefix caching."""
    prompt, params = tokens(1, 25), SamplingParams(temperature=1.0, seed=1234, max_tokens=6)
    kw = dict(num_speculative_tokens=2, max_num_batched_tokens=32, enable_prefix_caching=False)
    alone = make_engine(model, model, **kw).generate([prompt], params)[0].token_ids
    # an 8-token request first: the prompt's first chunk is 32 - 8 = 24 tokens, one short
    after = make_engine(model, model, **kw).generate([tokens(2, 8), prompt], [GREEDY, params])[1].token_ids
    assert after == alone
    short = prompt[:9]  # with a hash block of 8 the cached run's chunk ends at the boundary 8
    on, off = (make_engine(model, model, num_speculative_tokens=2, enable_prefix_caching=c)
               .generate([short], params)[0].token_ids for c in (True, False))
    assert on == off


def test_aborts_mid_speculation_leak_nothing(model, other):
    eng = make_engine(model, other, num_speculative_tokens=3)
    ids = [eng.add_request(p, dataclasses.replace(GREEDY, max_tokens=30)) for p in PROMPTS]
    while eng.stats.spec_verifications < 8:
        eng.step()
    assert eng.abort(ids[0]) and eng.abort(ids[2])
    for _ in range(3):
        eng.step()
    assert eng.abort(ids[1])
    while eng.has_unfinished():
        eng.step()
    assert_free(eng)


@pytest.mark.parametrize("max_tokens", [1, 2, 4, 7])
def test_max_tokens_in_a_run(model, plain, max_tokens):
    eng = make_engine(model, model, num_speculative_tokens=5)
    outs = eng.generate(PROMPTS, dataclasses.replace(GREEDY, max_tokens=max_tokens))
    assert [o.token_ids for o in outs] == [p[:max_tokens] for p in plain]
    assert all(o.finish_reason == "length" for o in outs)
    assert_free(eng)


def test_stop_strings_and_tokens_in_a_run(model, plain):
    """A self-draft emits up to K + 1 tokens per step; the outputs still stop where plain
    decoding stops: on a stop string within a token or across two, and on a stop token."""
    p0, p1, p2 = plain[0], plain[1], plain[2]
    params = [dataclasses.replace(GREEDY, stop=(f"<{p0[4]}>",)),
              dataclasses.replace(GREEDY, stop=(f"{p1[5]}><{p1[6]}",)),
              dataclasses.replace(GREEDY, stop_token_ids=(p2[3],))]
    prompts = PROMPTS[:3]

    def run(**kw):
        eng = LLMEngine(model, TagTokenizer(), EngineConfig(
            max_num_seqs=4, max_num_batched_tokens=64, physical_block_size=32, hash_block_size=8,
            kda_checkpoint_interval=16, max_model_len=256, cuda_graphs=False, **kw), eos_token_ids=(),
            draft_model=model if kw else None)
        outs = eng.generate(prompts, params)
        assert_free(eng)
        return [(o.token_ids, o.text, o.finish_reason) for o in outs]

    spec = run(num_speculative_tokens=5)
    assert spec == run()
    assert [len(ids) for ids, _, _ in spec] == [5, 7, 4] and all(f == "stop" for _, _, f in spec)


def test_prefix_caching_on_and_off(model, noisy):
    """Shared prefixes hit the cache (KDA checkpoints at multiples of 16 tokens); outputs equal
    plain decoding's either way, and no checkpoint is saved by a step that verifies drafts of
    the same sequence."""
    base = tokens(9, 37)
    prompts = [base + tokens(10 + i, 4 + i) for i in range(3)]
    params = dataclasses.replace(GREEDY, max_tokens=24)  # generation crosses checkpoint boundaries
    ref = [o.token_ids for o in make_engine(model).generate(prompts, params)]
    for caching in (True, False):
        eng = make_engine(model, noisy, num_speculative_tokens=3, enable_prefix_caching=caching)
        got = [eng.generate([p], params)[0].token_ids for p in prompts]  # in turn: later ones hit
        assert got == ref
        assert (eng.block_manager.stats.hits > 0) == caching
        assert_free(eng)


def test_checkpoint_saves_only_in_plain_steps(model, noisy):
    eng = make_engine(model, noisy, num_speculative_tokens=4)
    plans, step = [], eng.scheduler.step
    eng.scheduler.step = lambda: plans.append(step()) or plans[-1]  # record every plan
    eng.generate([tokens(3, 10)], dataclasses.replace(GREEDY, max_tokens=60))
    assert eng.stats.spec_verifications > 0
    for out in plans:
        speculating = {s.state_slot for s, _ in out.scheduled if s.request_id in out.num_draft_tokens}
        assert not any(save.state_slot in speculating for save in out.kda_saves)
    assert sum(len(out.kda_saves) for out in plans) >= 3  # at 16, 32, 48 (and 64) tokens
    assert_free(eng)


def test_stats_and_metrics(model, noisy):
    eng = make_engine(model, noisy, num_speculative_tokens=3)
    eng.generate(PROMPTS, GREEDY)
    s = eng.snapshot_stats()
    assert s.spec_verifications > 0 and 0 < s.spec_acceptance_rate < 1
    assert s.spec_mean_accepted_tokens == s.spec_accepted_tokens / s.spec_verifications
    text = ServerMetrics(eng.snapshot_stats).render().decode()
    assert f"openk3_spec_accepted_tokens_total {float(s.spec_accepted_tokens)}" in text
    assert "openk3_spec_acceptance_rate" in text and "openk3_spec_mean_accepted_tokens" in text


def test_configuration_errors(model):
    with pytest.raises(ValueError, match="num_speculative_tokens=-1"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="needs a draft model"):
        make_engine(model, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        make_engine(model, model)
    small = build_model(dataclasses.replace(preset("debug"), vocab_size=512))
    with pytest.raises(ValueError, match="vocab_size 512 differs"):
        make_engine(model, small, num_speculative_tokens=2)


def test_cli_generate_with_a_draft(tmp_path, capsys):
    """``openk3 generate --draft DIR --num-speculative-tokens K`` prints what plain greedy
    generation prints (the draft: a saved copy of the same random-init model, all accepted)."""
    save_pretrained(build_model(preset("debug"), seed=0), tmp_path / "draft")
    flags = ["generate", "--random-init", "--prompt", "hello", "--max-new-tokens", "8", "--temperature", "0",
             "--device", "cpu"]
    assert main(flags) == 0
    plain = capsys.readouterr()
    assert main(flags + ["--draft", str(tmp_path / "draft"), "--num-speculative-tokens", "3"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out and "draft acceptance 100%" in spec.err
    assert main(flags + ["--num-speculative-tokens", "3"]) == 2
    assert "needs --draft" in capsys.readouterr().err
    greedy = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM(preset="debug", random_init=True, device="cpu", max_model_len=64, physical_block_size=16,
              hash_block_size=8, kda_checkpoint_interval=16, draft=str(tmp_path / "draft"), num_speculative_tokens=2)
    want = LLM(preset="debug", random_init=True, device="cpu", max_model_len=64, physical_block_size=16,
               hash_block_size=8, kda_checkpoint_interval=16).generate("hi", greedy)[0].token_ids
    assert llm.generate("hi", greedy)[0].token_ids == want and llm.engine.stats.spec_acceptance_rate == 1
