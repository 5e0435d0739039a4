"""The engine through the debug model on CPU: equivalence with the plain generate path, the
prefix cache on vs off (hits inside and at the edge of physical blocks, shared and diverging
prefixes, preemption), sampling options, bad input, and no leaks under random workloads."""

from __future__ import annotations

import gc
import inspect

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openk3 import build_model, preset
from openk3.generate import generate
from openk3.serve.block_manager import BlockManager
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.inputs import SMALL_PROMPT, Checked, RequestInputs
from openk3.serve.sampler import InvalidRequest, SamplingParams
from openk3.serve.scheduler import Scheduler
from openk3.tokenizer import ByteTokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(preset("debug")).eval()
    with torch.no_grad():  # non-uniform AttnRes mixing, so every source matters
        for name, p in m.named_parameters():
            if name.endswith("_res.proj.weight"):
                p.normal_(0, 0.5)
    return m


def make_engine(model, **kw) -> LLMEngine:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=48, physical_block_size=32, hash_block_size=8,
               kda_checkpoint_interval=16, max_model_len=256, cuda_graphs=False)
    return LLMEngine(model, ByteTokenizer(), EngineConfig(**{**cfg, **kw}), eos_token_ids=())


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_free(eng: LLMEngine) -> None:
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_free_state_slots == bm.num_state_slots
    assert all(c == 0 for c in bm.ref_counts)
    assert not eng.requests and not eng.scheduler.has_unfinished()
    assert not bm.pending_checkpoints
    assert len(bm.free_checkpoint_ids) + len(bm.checkpoints) == bm.config.num_kda_checkpoints


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_requests_leave_no_tensors_behind(model):
    """After a first round of requests (which builds what the engine keeps: caches, buffers),
    more rounds leave the number of live tensors as it was: nothing of a step is kept by a
    cache keyed on its tensors (the nineteenth session found the experts' sum memoised, so every
    prefill's MoE outputs stayed alive)."""
    eng = make_engine(model)
    rounds = [[tokens(10 * r + i, n) for i, n in enumerate((40, 9, 25))] for r in range(3)]
    eng.generate(rounds[0], GREEDY)
    live = _live_tensors()
    for prompts in rounds[1:]:
        eng.generate(prompts, GREEDY)
        assert _live_tensors() == live
    assert_free(eng)


def test_matches_generate_with_chunked_prefill(model):
    prompts = [tokens(i, n) for i, n in enumerate((5, 23, 70, 17, 1))]  # 70 > the 48-token budget
    eng = make_engine(model)
    outs = eng.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == generate(model, p, 10, temperature=0.0)
        assert o.finish_reason == "length" and o.finished
    assert_free(eng)


def _run_pair(model, batches, **kw):
    """Run the same request batches (one after another) with the prefix cache on and off."""
    results = {}
    for on in (True, False):
        eng = make_engine(model, enable_prefix_caching=on, **kw)
        results[on] = [eng.generate(b, GREEDY) for b in batches]
        assert_free(eng)
        results[on, "engine"] = eng
    return results


def _assert_same(results):
    for outs_on, outs_off in zip(results[True], results[False]):
        for a, b in zip(outs_on, outs_off):
            assert a.token_ids == b.token_ids
            for la, lb in zip(a.logprobs, b.logprobs):
                assert la.token_id == lb.token_id
                assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
                assert list(la.top) == list(lb.top)


@pytest.mark.parametrize("shared, where", [(40, "inside"), (64, "edge"), (19, "inside")])
def test_prefix_cache_is_exact(model, shared, where):
    """A second request shares ``shared`` tokens: hits at 40 (inside physical block 1), 64 (the
    edge of block 2: no copy-on-write) and 16 (inside block 0, for a 19-token prefix)."""
    base = tokens(1, shared)
    first = [base + tokens(2, 5)]
    second = [base + tokens(3, 9), base + tokens(4, 30)]  # diverging after the shared prefix
    results = _run_pair(model, [first, second])
    _assert_same(results)
    hit = shared // 8 * 8  # the deepest hash boundary with a checkpoint below the shared part
    assert results[True][1][0].num_cached_tokens == hit
    eng = results[True, "engine"]
    assert eng.block_manager.stats.hits >= 2
    if where == "edge":
        assert hit % eng.config.physical_block_size == 0
    else:
        assert hit % eng.config.physical_block_size != 0
    assert all(o.num_cached_tokens == 0 for outs in results[False] for o in outs)


def test_prefix_cache_same_prompt_repeated(model):
    p = tokens(5, 50)
    results = _run_pair(model, [[p], [p], [p + p[:3]]])
    _assert_same(results)
    assert results[True][1][0].num_cached_tokens == 48


def test_preemption_keeps_outputs(model):
    """Seven blocks of 32 tokens for four sequences of ~60-90 tokens: preemption by
    recomputation must happen, and the prefix cache must give identical results."""
    prompts = [tokens(10 + i, 50 + 13 * i) for i in range(4)]
    results = _run_pair(model, [prompts], num_blocks=7, max_model_len=7 * 32 - 1)
    _assert_same(results)
    assert results[True, "engine"].stats.num_preemptions > 0
    for p, o in zip(prompts, results[True][0]):
        assert o.token_ids == generate(model, p, 10, temperature=0.0)


def test_sampling_seed_stop_and_logprobs(model):
    eng = make_engine(model)
    p = tokens(7, 12)
    a, b = eng.generate([p, p], SamplingParams(temperature=1.0, seed=123, max_tokens=8))
    c, = eng.generate([p], SamplingParams(temperature=1.0, seed=124, max_tokens=8))
    assert a.token_ids == b.token_ids != c.token_ids  # per-request seeds, batch-independent
    greedy, = eng.generate([p], SamplingParams(temperature=0, max_tokens=8, logprobs=3))
    stop_id = greedy.token_ids[3]
    out, = eng.generate([p], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop_id,)))
    assert out.token_ids == greedy.token_ids[:4] and out.finish_reason == "stop"
    lp = greedy.logprobs
    assert len(lp) == 8 and all(len(x.top) == 3 and x.token_id in x.top for x in lp)
    assert all(x.logprob == pytest.approx(max(x.top.values()), abs=1e-5) for x in lp)  # greedy
    assert_free(eng)


class LetterTokenizer:
    """Every id is one letter, so a random model's output is always text."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def test_stop_strings_cut_text(model):
    eng = make_engine(model)
    eng.tokenizer = LetterTokenizer()
    full, = eng.generate(["hello"], SamplingParams(temperature=0, max_tokens=12))
    text = full.text
    assert len(text) == 12
    stop = text[5:7]
    out, = eng.generate(["hello"], SamplingParams(temperature=0, max_tokens=12, stop=("zzzzz", stop)))
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
    # streaming: the deltas concatenate to the final text, and none shows the stop string
    rid = eng.add_request("hello", SamplingParams(temperature=0, max_tokens=12, stop=(stop,)))
    deltas = []
    while eng.has_unfinished():
        deltas += [o.delta_text for o in eng.step() if o.request_id == rid]
    assert "".join(deltas) == out.text
    assert_free(eng)


def test_bad_requests_name_the_parameter(model):
    eng = make_engine(model)
    cases = [("", SamplingParams(), "prompt"), ([], SamplingParams(), "prompt"),
             ([1] * 256, SamplingParams(max_tokens=1), "prompt"),
             ([1] * 10, SamplingParams(max_tokens=250), "max_tokens"),
             ([1] * 10, SamplingParams(max_tokens=10**9), "max_tokens"),
             ([5000], SamplingParams(), "prompt"), ([3, -1], SamplingParams(), "prompt"),
             ([3, 1.5], SamplingParams(), "prompt"), ([3, "a"], SamplingParams(), "prompt"),
             ([3, True], SamplingParams(), "prompt"),  # bools are not token ids
             ([0, 4, False, 1], SamplingParams(), "prompt"),
             ([3, None], SamplingParams(), "prompt"),
             ([3, 2**70], SamplingParams(), "prompt"),
             (b"hi", SamplingParams(), "prompt"),  # bytes were taken as the ids [104, 105]
             ({3: 4}, SamplingParams(), "prompt")]
    for prompt, params, param in cases:
        with pytest.raises(InvalidRequest) as e:
            eng.add_request(prompt, params)
        assert e.value.param == param
    for kw, param in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                      ({"top_k": -2}, "top_k"), ({"max_tokens": -1}, "max_tokens"),
                      ({"logprobs": 50}, "logprobs"), ({"stop": ("",)}, "stop"),
                      ({"seed": 2**64}, "seed")]:
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(**kw)
        assert e.value.param == param
    assert_free(eng)
    # a bad prompt in a batch: the ones queued before it go too, and the next call is clean
    # (their outputs made it stop early with a KeyError)
    with pytest.raises(InvalidRequest):
        eng.generate([[3, 4], [5000]], SamplingParams(max_tokens=1))
    assert not eng.has_unfinished()
    (out,) = eng.generate([[3, 4, 5]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.token_ids) == 3
    # params one per prompt in a tuple as in a list (a tuple was taken for one SamplingParams)
    greedy = (SamplingParams(max_tokens=2, temperature=0), SamplingParams(max_tokens=3, temperature=0))
    assert [len(o.token_ids) for o in eng.generate([[3, 4], [5, 6]], greedy)] == [2, 3]
    with pytest.raises(TypeError, match="params must be a SamplingParams or a list of them"):
        eng.generate([[3, 4]], {"max_tokens": 2})
    assert_free(eng)


@pytest.mark.parametrize("length", [2, SMALL_PROMPT, SMALL_PROMPT + 1, 3000])
def test_short_and_long_prompts_are_checked_alike(model, length):
    """Prompts up to ``SMALL_PROMPT`` ids are range-checked by Python, longer ones by torch: the
    same ids pass, the same faults are refused, wherever they sit."""
    inputs = RequestInputs(ByteTokenizer(), model.cfg, EngineConfig(), max_model_len=4096)
    vocab = model.cfg.vocab_size
    ok = [(7 * i) % vocab for i in range(length)]
    got = inputs.checked(ok, SamplingParams(max_tokens=1), None)
    assert got.ids == ok and list(got.packed) == ok and isinstance(got, Checked)
    for where in (0, length - 1):
        for bad in (-1, vocab, True, False, 1.0, None):
            prompt = list(ok)
            prompt[where] = bad
            with pytest.raises(InvalidRequest, match="token ids must be integers") as e:
                inputs.checked(prompt, SamplingParams(max_tokens=1), None)
            assert e.value.param == "prompt"


def test_integer_types_other_than_int_are_token_ids(model):
    """numpy integers (and other types with ``__index__``) are accepted: they hold the same ids."""
    np = pytest.importorskip("numpy")
    eng = make_engine(model)
    ids = [1, 0, 7, 200, 3]
    want = eng.generate([ids], SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    got = eng.generate([[np.int64(t) for t in ids]], SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    assert got == want
    assert_free(eng)


_REFERENCE: dict[tuple, list[int]] = {}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 70), st.integers(1, 12),
                          st.one_of(st.none(), st.integers(0, 6))), min_size=1, max_size=7),
       st.integers(5, 12), st.booleans())
def test_no_leaks_under_random_workloads(model, requests, num_blocks, overlap):
    """Random prompts (some sharing prefixes), lengths, cancellations, and a pool small enough to
    preempt, with and without overlapped decoding: every request that ran to the end gives
    exactly the plain generate path's tokens, the runner's device block table always holds each
    running sequence's blocks, and afterwards every block, state slot, reference and KDA
    checkpoint id is free or stored again."""
    eng = make_engine(model, num_blocks=num_blocks, max_num_batched_tokens=24, max_model_len=num_blocks * 32 - 1,
                      overlap_decode=overlap)
    base = tokens(99, 70)
    prompts, cancel_at = {}, {}
    for j, (family, length, max_tokens, cancel) in enumerate(requests):
        prompt = (base[:length] if family == 0 else tokens(family * 100 + j, length))
        max_tokens = max(1, min(len(prompt) + max_tokens, 255) - len(prompt))
        rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        prompts[rid] = (tuple(prompt), max_tokens)
        if cancel is not None:
            cancel_at[rid] = cancel
    step, done = 0, {}
    while eng.has_unfinished():
        for rid, when in list(cancel_at.items()):
            if when == step:
                eng.abort(rid)
                del cancel_at[rid]
        done.update((o.request_id, o.token_ids) for o in eng.step() if o.finished)
        for seq in eng.scheduler.running:
            table = eng.runner.block_tables[seq.state_slot, :len(seq.block_table)]
            assert table.tolist() == seq.block_table
        step += 1
        assert step < 2000
    assert_free(eng)
    for rid, ids in done.items():
        key = prompts[rid]
        if key not in _REFERENCE:
            _REFERENCE[key] = generate(model, list(key[0]), key[1], temperature=0.0)
        assert ids == _REFERENCE[key], rid


def test_incremental_detokenization_waits_for_whole_characters(model):
    from openk3.serve.engine import _Request

    eng = make_engine(model)
    ids = list("h€llo, wörld ✓".encode())
    r = _Request(seq=None, params=SamplingParams(), generator=None)
    seen = []
    for k in range(1, len(ids) + 1):
        seen.append(eng._detokenize(r, ids, 0, k, final=False))
        assert "\ufffd" not in seen[-1]
        assert seen[-1] == bytes(ids[:k]).decode(errors="ignore")[: len(seen[-1])]
    assert seen[-1] == "h€llo, wörld ✓"
    r = _Request(seq=None, params=SamplingParams(), generator=None)
    assert eng._detokenize(r, [7] + ids, 1, 3, final=True) == "h\ufffd"  # flushed when the request ends


def test_engine_config_is_the_one_source_of_defaults(model):
    """The scheduler and block manager read the engine's config itself (their constructors have
    no defaults to disagree with it); only run-time sizes come from the runner."""
    for cls in (BlockManager, Scheduler):
        params = list(inspect.signature(cls).parameters.values())
        assert all(p.default is inspect.Parameter.empty for p in params), cls
    eng = LLMEngine(model, ByteTokenizer())
    defaults = EngineConfig()
    assert eng.config == defaults
    assert eng.scheduler.config is eng.config and eng.block_manager.config is eng.config
    bm = eng.block_manager
    assert (bm.block_size, bm.hash_block_size) == (defaults.physical_block_size, defaults.hash_block_size)
    assert len(bm.free_checkpoint_ids) == defaults.num_kda_checkpoints
    assert bm.num_state_slots == defaults.max_num_seqs and bm.num_blocks == eng.runner.num_blocks
    assert eng.scheduler.max_model_len == eng.max_model_len == model.cfg.max_position_embeddings


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("cache_memory_gb", -1.0), ("num_blocks", 0),
                                         ("num_kda_checkpoints", -1), ("hash_block_size", 500),
                                         ("kda_checkpoint_interval", 1000)])
def test_invalid_engine_config_names_field(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}="):
        EngineConfig(**{field: value})


def test_a_checked_prompt_has_its_parameters_checked_again(model):
    """``StreamingEngine.generate`` takes a ``Checked`` prompt as it is, but still refuses
    parameters that do not fit it (a server's choices may differ from what it checked with)."""
    import asyncio

    from openk3.serve.engine import AsyncEngine

    engine = AsyncEngine(make_engine(model))
    valid = engine.check([5, 6, 7], SamplingParams(max_tokens=2))

    async def run(params):
        return [o async for o in engine.generate(valid, params, f"r{params.max_tokens}")]

    try:
        outs = asyncio.run(run(SamplingParams(temperature=0, max_tokens=3)))
        with pytest.raises(InvalidRequest) as e:
            asyncio.run(run(SamplingParams(max_tokens=10**6)))
    finally:
        engine.shutdown()
    assert e.value.param == "max_tokens"
    want, = make_engine(model).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert outs[-1].token_ids == want.token_ids and outs[-1].prompt_token_ids == [5, 6, 7]


def test_async_stream_merges_outputs_a_slow_consumer_left_queued(model):
    """AsyncEngine.generate: outputs queued while the consumer was busy arrive as one whose
    deltas are theirs concatenated; the stream still adds up to LLMEngine.generate's output."""
    import asyncio

    from openk3.serve.engine import AsyncEngine

    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    want, = make_engine(model).generate(["merge me"], params)
    engine = AsyncEngine(make_engine(model))

    async def consume():
        outs = []
        async for out in engine.generate("merge me", params, "r0"):
            outs.append(out)
            if len(outs) == 1:
                await asyncio.sleep(0.5)  # the engine thread runs ahead
        return outs

    try:
        outs = asyncio.run(consume())
    finally:
        engine.shutdown()
    assert len(outs) < 24  # merged: fewer outputs than tokens
    assert [t for o in outs for t in o.delta_token_ids] == want.token_ids == outs[-1].token_ids
    assert "".join(o.delta_text for o in outs) == want.text == outs[-1].text
    assert outs[-1].finished and [o.finished for o in outs[:-1]] == [False] * (len(outs) - 1)
    assert [lp.token_id for lp in outs[-1].logprobs] == want.token_ids


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_padded_prefill_matches_the_packed_pass(model, prefix_caching):
    """The graphed prefill's layout run eagerly (``ModelRunner.pad_prefill``, as on a GPU with
    CUDA graphs: tokens padded to a power of two, chunks padded with empty ones in the scratch
    slot, the padding's latents in the scratch block) gives the unpadded pass's tokens and
    log-probabilities, with chunked prefill, several prompts per step and prefix-cache hits;
    and the padding touches no block or slot the requests own."""
    prompts = [tokens(i, n) for i, n in enumerate((5, 23, 70, 17, 1))] + [tokens(0, 5) + tokens(9, 30)]
    results = {}
    for pad in (False, True):
        eng = make_engine(model, enable_prefix_caching=prefix_caching)
        eng.runner.pad_prefill = pad
        results[pad] = [eng.generate(prompts[:3], GREEDY), eng.generate(prompts[3:], GREEDY)]
        assert_free(eng)
        if pad:  # every pass was padded: 64 tokens at least, 4 chunk slots
            assert set(eng.runner._prefill_passes) <= {64, 128}
    _assert_same({True: results[True], False: results[False]})


def _overlap_workload(model, overlap: bool, stop_token: int | None = None):
    """A scripted run: greedy and seeded sampled requests ending at different steps, one ending
    at a stop token, one aborted mid-run, one arriving while the others decode; prefix caching
    on with 32-token blocks and a KDA checkpoint every 16 tokens (steps that need a block or a
    save). Returns every request's final output and how many steps were launched ahead."""
    eng = make_engine(model, overlap_decode=overlap, max_num_batched_tokens=64)
    launched, decode_ahead = [0], eng.runner.decode_ahead

    def counted(*a):
        launched[0] += 1
        return decode_ahead(*a)

    eng.runner.decode_ahead = counted
    rids = [eng.add_request(tokens(1, 20), SamplingParams(temperature=0, max_tokens=40)),
            eng.add_request(tokens(2, 9), SamplingParams(temperature=1.0, seed=7, max_tokens=30)),
            eng.add_request(tokens(3, 14), SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=13)),
            eng.add_request(tokens(1, 20), SamplingParams(temperature=0, max_tokens=40,
                                                          stop_token_ids=[] if stop_token is None else [stop_token]))]
    final, step = {}, 0
    while eng.has_unfinished():
        if step == 9:
            eng.abort(rids[1])
        if step == 14:
            rids.append(eng.add_request(tokens(4, 25), SamplingParams(temperature=0, max_tokens=12)))
        final.update((o.request_id, (o.token_ids, o.finish_reason)) for o in eng.step() if o.finished)
        step += 1
    assert_free(eng)
    return [final.get(r) for r in rids], launched[0]


def test_overlapped_decoding_gives_plain_steppings_outputs(model):
    """Decode steps launched before the previous step's tokens reach the host
    (``EngineConfig.overlap_decode``, forced on the CPU) give the outputs of plain stepping:
    rows that finish (length, stop token), an abort and a new prompt while steps are in flight,
    blocks and checkpoints due (no step is launched ahead then), seeded sampling unchanged; and
    most decode steps were launched ahead. Off, none is."""
    plain, none = _overlap_workload(model, False)
    assert none == 0
    stop = plain[0][0][6]  # request 3 (request 0's prompt, greedy) stops at its 7th token
    plain, _ = _overlap_workload(model, False, stop)
    overlapped, launched = _overlap_workload(model, True, stop)
    assert overlapped == plain
    assert plain[1] is None and plain[3][1] == "stop" and len(plain[3][0]) == 7
    assert [len(o[0]) for o in plain if o is not None] == [40, 13, 7, 12]
    assert launched >= 25


def test_overlapped_decoding_is_on_by_default_only_with_a_gpu(model):
    assert not make_engine(model).overlap_decode
    assert make_engine(model, overlap_decode=True).overlap_decode
