"""The EAGLE-3 draft in the engine (``openk3/serve/eagle.py``), on the debug model on CPU: greedy
outputs equal plain decoding's (a random draft, and an "echo" draft that is exact for a target
whose next token depends on the current token only, so every draft is accepted); every proposal
equals ``eagle_propose_ref`` recomputed from scratch, after rejections and after prefix-cache
hits; sampling at temperature 1 follows the target exactly (chi-square over a tiny vocabulary, and
the same test fails a wrong acceptance rule); prefix caching, stop tokens and strings, seeds;
``draft="mtp"``, draft directories through ``LLM`` and ``openk3 generate``; configuration errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import openk3.serve.speculative as spec
from openk3 import LLM, build_model, preset
from openk3.checkpoint.draft import save_draft
from openk3.cli import main
from openk3.model.draft import DraftConfig, Eagle3Draft
from openk3.serve.config import EngineConfig
from openk3.serve.eagle import eagle_propose_ref
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12)
OUTPUT_WEIGHTS = ("o_proj.weight", "down_proj.weight", "experts.w2", "routed_expert_up_proj.weight")


def _model(seed: int, **overrides):
    torch.manual_seed(seed)
    m = build_model(dataclasses.replace(preset("debug"), **overrides), seed=seed).eval()
    with torch.no_grad():  # non-uniform AttnRes mixing, so every source matters
        for name, p in m.named_parameters():
            if name.endswith("_res.proj.weight"):
                p.normal_(0, 0.5)
    return m


def _draft(target, seed: int) -> Eagle3Draft:
    """A random draft whose fusion reads all three sources (not only h, as at init)."""
    d = Eagle3Draft(DraftConfig.for_target(target.cfg))
    d.init_weights(seed)
    with torch.no_grad():
        d.fc.weight.normal_(0, 0.05)
    return d.eval()


@pytest.fixture(scope="module")
def model():
    return _model(0)


@pytest.fixture(scope="module")
def draft(model):
    return _draft(model, 1)


def echo_pair():
    """(target, draft): every layer of the target writes zeros, so its next token is a function
    of the current token only, ``argmax lm_head(norm(embed(x)))``; the draft's block writes zeros
    too and ``eh_proj`` passes the next token's normalised embedding, so the draft computes that
    same function of ``x_{t+1}``: every greedy draft is the target's next token."""
    target = _model(2)
    draft = Eagle3Draft(DraftConfig.for_target(target.cfg))
    draft.init_weights(3)
    with torch.no_grad():
        for m in (target, draft):
            for name, p in m.named_parameters():
                if name.endswith(OUTPUT_WEIGHTS):
                    p.zero_()
        d = target.cfg.hidden_size
        draft.layer.eh_proj.weight.zero_()
        draft.layer.eh_proj.weight[:, :d] = torch.eye(d)  # [enorm(embed(x_{t+1})) | hnorm(f)] -> the former
        draft.layer.shared_head.norm.weight.copy_(target.model.norm.weight)
    return target, draft.eval()


@pytest.fixture(scope="module")
def echo():
    return echo_pair()


def make_engine(model, draft_model=None, **kw) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, physical_block_size=32, hash_block_size=8,
                       kda_checkpoint_interval=16, max_model_len=256, cuda_graphs=False)
    return LLMEngine(model, ByteTokenizer(), dataclasses.replace(cfg, **kw), eos_token_ids=(), draft_model=draft_model)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [tokens(i, n) for i, n in enumerate((5, 23, 9, 1))]


def assert_free(eng: LLMEngine) -> None:
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_state_slots == bm.num_state_slots
    assert not eng.requests and not eng.scheduler.has_unfinished()


def greedy_outputs(eng: LLMEngine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outs = [o.token_ids for o in eng.generate(prompts, params)]
    assert_free(eng)
    return outs


@pytest.mark.parametrize("K", [1, 3])
def test_greedy_random_draft_equals_plain(model, draft, K):
    eng = make_engine(model, draft, num_speculative_tokens=K)
    assert greedy_outputs(eng) == greedy_outputs(make_engine(model))
    s = eng.stats
    assert s.spec_verifications > 0 and s.spec_accepted_tokens < s.spec_draft_tokens


def test_greedy_echo_draft_accepts_everything(echo):
    target, draft = echo
    eng = make_engine(target, draft, num_speculative_tokens=3)
    params = dataclasses.replace(GREEDY, max_tokens=20)
    assert greedy_outputs(eng, params=params) == greedy_outputs(make_engine(target), params=params)
    s = eng.stats
    assert s.spec_verifications > 0 and s.spec_accepted_tokens == s.spec_draft_tokens
    # every verify step emits k + 1 tokens; the first token of each request comes from its
    # prompt, a few more from plain decode steps (the last token, checkpoint boundaries)
    assert s.generation_tokens == 80 and 80 - 4 - 8 <= s.spec_draft_tokens + s.spec_verifications <= 80 - 4


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_proposals_equal_the_reference(model, draft, temperature):
    """Sampling at temperature 1 (some drafts accepted, some rejected), shared prefixes (later
    requests start their draft cache after a prefix-cache hit): every proposal's probabilities
    equal those of ``eagle_propose_ref``, which recomputes target and draft over the whole
    sequence from scratch given the same drafts. Greedy (the whole chain in one pass, no
    probabilities): every draft is the argmax of the reference's logits."""
    eng = make_engine(model, draft, num_speculative_tokens=3)
    calls, propose = [], eng.drafter.propose

    def recording(out, params, generators):
        got = propose(out, params, generators)
        seqs = [s for s, _ in out.scheduled if s.request_id in out.num_draft_tokens]
        if got is not None:
            calls.append([(list(s.token_ids), eng.drafter.base[s.state_slot], out.num_draft_tokens[s.request_id])
                          for s in seqs] + [got])
        return got

    eng.drafter.propose = recording
    base = tokens(9, 20)
    prompts = [base + tokens(10 + i, 3 + i) for i in range(3)]
    for i, p in enumerate(prompts):  # in turn: later ones hit the cache of the first
        eng.generate([p, tokens(20 + i, 6)], [SamplingParams(temperature=temperature, seed=i, max_tokens=10)] * 2)
    assert eng.block_manager.stats.hits > 0
    if temperature:
        assert 0 < eng.stats.spec_accepted_tokens < eng.stats.spec_draft_tokens
    checked, bases = 0, set()
    for *rows, (drafted, probs) in calls:
        assert (probs is None) == (temperature == 0)
        for b, (ids, start, k) in enumerate(rows):
            ref = eagle_propose_ref(model, draft, ids, drafted[b, :k].tolist(), start)
            if probs is None:
                assert drafted[b, :k].tolist() == ref.argmax(-1).tolist()
                assert (drafted[b, k:] == -1).all()
            else:  # log space: the random draft's probabilities are all near 1 / vocab
                torch.testing.assert_close(probs[b, :k].log(), torch.log_softmax(ref, -1), atol=1e-4, rtol=0)
            checked, bases = checked + 1, bases | {start}
    assert checked > 10 and len(bases) > 1  # base 0 and after a hit


def test_prefix_caching_on_and_off(model, draft):
    base = tokens(9, 37)
    prompts = [base + tokens(10 + i, 4 + i) for i in range(3)]
    params = dataclasses.replace(GREEDY, max_tokens=10)  # generation crosses a checkpoint boundary
    ref = greedy_outputs(make_engine(model), prompts, params)
    for caching in (True, False):
        eng = make_engine(model, draft, num_speculative_tokens=3, enable_prefix_caching=caching)
        assert [greedy_outputs(eng, [p], params)[0] for p in prompts] == ref
        assert (eng.block_manager.stats.hits > 0) == caching


def test_seeded_sampling_independent_of_the_batch(model, draft):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16)
    alone = make_engine(model, draft, num_speculative_tokens=3).generate([PROMPTS[0]], params)[0]
    others = [SamplingParams(temperature=1.0, seed=11, max_tokens=12), SamplingParams(temperature=0.5, max_tokens=9),
              SamplingParams(temperature=0, max_tokens=14)]
    eng = make_engine(model, draft, num_speculative_tokens=3)
    batch = eng.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[3]], [others[0], params, *others[1:]])
    assert batch[1].token_ids == alone.token_ids and eng.stats.spec_accepted_tokens > 0
    assert_free(eng)


class TagTokenizer:
    """Every id decodes to ``<id>``: stop strings can be placed on, and across, tokens."""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.strip("<>").split("><")]

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def _chi2_crit(df: int) -> float:
    """Upper 1e-3 point of chi-square with ``df`` dof by Wilson and Hilferty's cube-root
    approximation (0.2-3% above scipy's exact value for df 1-24: a slightly looser bound)."""
    z = 3.0902  # standard normal upper 1e-3 point
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _pair_statistic(eng, model, prompt: list[int], n: int) -> tuple[float, int]:
    """Pearson's statistic of the first two tokens of ``n`` seeded requests at temperature 1
    (the second comes out of a verify step: accepted draft or resample) against the target's
    own joint p(x1) p(x2 | x1), cells expected under 5 pooled; (statistic, dof)."""
    V, dev = model.cfg.vocab_size, model.lm_head.weight.device
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt], device=dev)).logits[0, -1].double(), -1)
        joint = torch.stack([p1[a] * torch.softmax(model(torch.tensor([prompt + [a]], device=dev)).logits[0, -1].double(), -1)
                             for a in range(V)]).flatten().cpu()
    outs = eng.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=3) for s in range(n)])
    counts = torch.bincount(torch.tensor([o.token_ids[0] * V + o.token_ids[1] for o in outs]), minlength=V * V)
    expected = n * joint
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum(0, keepdim=True).double()])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


@pytest.mark.parametrize("rule", ["exact", "always accept"])
def test_sampled_tokens_follow_the_target(monkeypatch, rule):
    """The engine with an EAGLE-3 draft samples from the target exactly: on a five-token
    vocabulary, 800 requests' first two tokens against the target's joint distribution (chi-square
    at 1e-3, cells pooled below 5 expected). The second token comes from a verify step (one
    draft, a random draft whose q is far from p: 45% accepted); accepting every draft
    (x2 ~ q) must fail the same test (chi2 17.4 and 3,803 with 17 dof, bound 40.9)."""
    target = _model(4, vocab_size=5)
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # peaked distributions: the draft's differ from the target's
    eng = make_engine(target, _draft(target, 5), num_speculative_tokens=2, max_num_seqs=128,
                      max_num_batched_tokens=1024)
    if rule != "exact":
        monkeypatch.setattr(spec, "acceptance_prob", lambda p_d, q_d: torch.ones_like(p_d))
    stat, df = _pair_statistic(eng, target, [1, 3, 0, 4, 2], 800)
    if rule == "exact":
        assert eng.stats.spec_draft_tokens == 800 and 0.2 < eng.stats.spec_acceptance_rate < 0.9
        assert stat < _chi2_crit(df), f"chi2 = {stat:.1f} with {df} dof"
    else:
        assert stat > 10 * _chi2_crit(df), f"a wrong rule passed: chi2 = {stat:.1f} with {df} dof"


def test_stop_strings_and_tokens_in_a_run(echo):
    """With every draft accepted a step emits K + 1 tokens; outputs still stop where plain
    decoding stops (a stop string on one token and across two, a stop token)."""
    target, draft = echo
    prompts = PROMPTS[:3]
    plain = greedy_outputs(make_engine(target), prompts, dataclasses.replace(GREEDY, max_tokens=20))
    p0, p1, p2 = plain
    params = [dataclasses.replace(GREEDY, stop=(f"<{p0[6]}>",)),
              dataclasses.replace(GREEDY, stop=(f"{p1[5]}><{p1[6]}",)),
              dataclasses.replace(GREEDY, stop_token_ids=(p2[7],))]

    def run(draft_model=None, **kw):
        eng = LLMEngine(target, TagTokenizer(), EngineConfig(
            max_num_seqs=4, max_num_batched_tokens=64, physical_block_size=32, hash_block_size=8,
            kda_checkpoint_interval=16, max_model_len=256, cuda_graphs=False, **kw), eos_token_ids=(),
            draft_model=draft_model)
        outs = eng.generate(prompts, params)
        assert_free(eng)
        return [(o.token_ids, o.text, o.finish_reason) for o in outs]

    spec = run(draft, num_speculative_tokens=5)
    assert spec == run() and all(f == "stop" for _, _, f in spec)


def test_mtp_layer_as_the_draft():
    """``draft="mtp"``: the target's own MTP layer (``Eagle3Draft.from_mtp``); a target without
    one is refused."""
    target = _model(4, num_nextn_predict_layers=1)
    eng = make_engine(target, num_speculative_tokens=3, draft="mtp")
    assert type(eng.drafter).__name__ == "EagleDrafter"
    assert greedy_outputs(eng) == greedy_outputs(make_engine(target))
    assert eng.stats.spec_verifications > 0
    with pytest.raises(ValueError, match="has none"):
        make_engine(_model(4), num_speculative_tokens=3, draft="mtp")


def test_draft_directory_through_llm_and_cli(tmp_path, capsys):
    """A draft directory (``save_draft``) of the ``debug`` preset's random target, through
    ``LLM(draft=DIR)`` and ``openk3 generate --draft DIR``: plain greedy outputs; a draft of
    another target is refused."""
    target = build_model(preset("debug"), seed=0)
    save_draft(_draft(target, 5), tmp_path / "draft")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    kw = {"preset": "debug", "random_init": True, "device": "cpu", "max_model_len": 64,
          "physical_block_size": 16, "hash_block_size": 8, "kda_checkpoint_interval": 16}
    llm = LLM(**kw, draft=str(tmp_path / "draft"), num_speculative_tokens=3)
    assert type(llm.engine.drafter).__name__ == "EagleDrafter"
    assert llm.generate("hi", greedy)[0].token_ids == LLM(**kw).generate("hi", greedy)[0].token_ids
    assert llm.engine.stats.spec_verifications > 0
    flags = ["generate", "--random-init", "--prompt", "hello", "--max-new-tokens", "8", "--temperature", "0",
             "--device", "cpu"]
    assert main(flags) == 0
    plain = capsys.readouterr()
    assert main(flags + ["--draft", str(tmp_path / "draft"), "--num-speculative-tokens", "2"]) == 0
    assert capsys.readouterr().out == plain.out
    other = _draft(_model(0, vocab_size=512), 5)
    with pytest.raises(ValueError, match="trained for a target"):
        make_engine(copy.deepcopy(target), other, num_speculative_tokens=2)


def test_the_drafts_router_keeps_its_fp32_values_in_a_bf16_engine():
    """The draft was cast to the target's dtype and its router back to fp32: rounded to bf16
    (its trained router then chose other experts for ~1% of tokens)."""
    target, draft = echo_pair()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith(".gate.weight"):
                p.add_(torch.rand_like(p) * 1e-3)  # values bf16 cannot hold
    want = {n: t.clone() for n, t in draft.state_dict().items() if ".gate." in n}
    assert want and all(t.dtype == torch.float32 for t in want.values())
    eng = make_engine(target.to(torch.bfloat16), draft_model=draft, num_speculative_tokens=3)
    got = eng.drafter.draft.state_dict()
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], t), name
    assert draft.layer.eh_proj.weight.dtype == torch.bfloat16
