"""The serving engine on CUDA (fla kernels, varlen prefill, paged MLA decode, CUDA graphs)
against the model's own full-sequence forward, CUDA-graph decode against eager decode, and the
host -> device copies of a decode step. Run on the device: ``pytest -m gpu tests/serve``.

bf16 (the routed experts' grouped matmul, which CUDA graphs need, is bf16-only), so greedy
continuations of a random model may legitimately differ between paths after a near-tie.
The check is therefore teacher-forced: whatever tokens the engine chose, the log-probability it
reports for each must match a fresh full-sequence forward over prompt + chosen tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from openk3 import build_model, preset
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def make_engine(graphs: bool, num_speculative_tokens: int = 0, **kw) -> LLMEngine:
    torch.manual_seed(0)
    model = build_model(preset("debug"), device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():  # peaked next-token distributions: a wrong context moves log-probs
        model.lm_head.weight.mul_(10)  # by whole units (a flat random model would hide it)
    draft = None
    if num_speculative_tokens:  # the target with noise on its head: some drafts are rejected
        draft = copy.deepcopy(model)
        with torch.no_grad():
            draft.lm_head.weight.add_(torch.randn_like(draft.lm_head.weight) * draft.lm_head.weight.std() * 0.3)
    config = dict(max_num_seqs=8, max_num_batched_tokens=96, physical_block_size=64, hash_block_size=16,
                  kda_checkpoint_interval=64, max_model_len=1024, cuda_graphs=graphs,
                  num_speculative_tokens=num_speculative_tokens, **kw)
    return LLMEngine(model, ByteTokenizer(), EngineConfig(**config), eos_token_ids=(), draft_model=draft)


@pytest.mark.parametrize("graphs,num_speculative_tokens", [(True, 0), (False, 0), (True, 3)])
def test_engine_logprobs_match_full_forward(graphs, num_speculative_tokens):
    """With graphs, the prefill passes (up to 96 tokens here) replay as piecewise CUDA graphs
    around the MLA attention. With speculation (K = 3) too: verify steps and their commits, the draft model's loop and
    its rollback, and plain decodes, all as CUDA graphs."""
    eng = make_engine(graphs, num_speculative_tokens)
    model = eng.model
    prompts = [torch.randint(3, 4000, (n,)).tolist() for n in (7, 33, 150, 64, 1)]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=1))
    assert bool(eng.runner._graphs) == graphs
    assert bool(eng.runner._prefill_graphs) == graphs  # prefill passes as piecewise graphs too
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    if num_speculative_tokens:
        s = eng.stats
        assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens, s
        # verify steps, their commits and the draft model's loop ran as graphs
        assert bool(eng.runner.verifier.graphs) == graphs and bool(eng.drafter.runner._graphs) == graphs
        assert bool(eng.drafter.runner.verifier.graphs) == graphs
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


def test_cuda_graph_decode_equals_eager_decode():
    """Every decode step runs twice from the same state, replayed and eager: the logits agree to
    bf16 rounding. Contexts from 2 to ~650 tokens share one graph per batch bucket."""
    eng = make_engine(graphs=True)
    runner, decode, errs = eng.runner, eng.runner._decode, []

    def both(seqs):
        saved = [t.clone() for t in runner.kda_state.tensors()]
        replayed = decode(seqs)[0].clone()
        for t, s in zip(runner.kda_state.tensors(), saved):
            t.copy_(s)
        runner.use_graphs = False
        try:
            eager = decode(seqs)[0]
        finally:
            runner.use_graphs = True
        errs.append(((replayed - eager).norm() / eager.norm()).item())
        return replayed, None

    runner._decode = both
    prompts = [torch.randint(3, 4000, (n,)).tolist() for n in (7, 33, 150, 300, 600, 1)]
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    assert set(runner._graphs) <= {1, 2, 4, 8} and len(runner._graphs) >= 2, set(runner._graphs)
    # a wrong block or a stale row moves logits by O(1) (relative > 0.3); bf16 kernels in another
    # batch shape and split count round differently, amplified through 8 random layers
    assert max(errs) < 5e-2, max(errs)


def test_graphs_captured_at_start_serve_as_those_captured_on_first_use():
    """``capture_graphs`` captures one graph per decode bucket and padded prefill size (what
    ``openk3 serve`` does before it listens); requests then capture nothing more and generate what
    an engine capturing on first use generates."""
    prompts = [torch.randint(3, 4000, (n,)).tolist() for n in (7, 33, 150, 90, 1)]
    params = SamplingParams(temperature=0, max_tokens=24)
    lazy = make_engine(graphs=True)
    expected = [o.token_ids for o in lazy.generate(prompts, params)]
    eng = make_engine(graphs=True)
    decode, prefill = eng.runner.graph_sizes()
    assert decode == [1, 2, 4, 8] and prefill == [64, 128]
    seen = []
    eng.capture_graphs(lambda kind, size: seen.append((kind, size)))
    assert seen == [("decode", b) for b in decode] + [("prefill", t) for t in prefill]
    captured = (dict(eng.runner._graphs), dict(eng.runner._prefill_graphs))
    assert set(captured[0]) == set(decode) and set(captured[1]) == set(prefill)
    assert [o.token_ids for o in eng.generate(prompts, params)] == expected
    assert (eng.runner._graphs, eng.runner._prefill_graphs) == captured  # the same graph objects


class HostToDevice(TorchDispatchMode):
    """Counts host -> device copies."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.copy_.default:
            self.count += args[1].device.type == "cpu" and args[0].device.type == "cuda"
        elif func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to):
            # under inference mode ``Tensor.to`` reaches the mode as ``aten.to.*``, not ``_to_copy``
            self.count += args[0].device.type == "cpu" and out.device.type == "cuda"
        elif func is torch.ops.aten.lift_fresh.default:
            self.count += out.device.type == "cuda"
        return out


def expected_copies(out) -> int:
    """The decode inputs, plus one copy of instruction ids before and one after the forward."""
    before = out.block_table_updates or out.kda_restores or out.kda_resets
    return 1 + bool(before) + bool(out.kda_saves)


@pytest.mark.parametrize("graphs", [True, False])
def test_decode_step_copies_one_tensor_to_the_device_at_any_context(graphs):
    eng = make_engine(graphs)
    counts, execute = [], eng.runner.execute

    def counting(out, draft_tokens=None):
        with HostToDevice() as mode:
            result = execute(out, draft_tokens)
        if all(n == 1 for _, n in out.scheduled):
            counts.append((mode.count, expected_copies(out), len(out.scheduled),
                           len(out.block_table_updates), len(out.kda_restores), len(out.kda_resets),
                           len(out.kda_saves)))
        return result

    for prompt_len in (5, 700):  # the first run also captures the graphs
        eng.generate([list(range(3, 3 + prompt_len))] * 3, SamplingParams(temperature=0, max_tokens=20))
    counts.clear()
    eng.runner.execute = counting
    for prompt_len in (5, 700):
        eng.generate([list(range(4, 4 + prompt_len))] * 3, SamplingParams(temperature=0, max_tokens=20))
    wrong = [c for c in counts if c[0] != c[1]]  # (copies, expected, batch, instruction counts)
    assert counts and not wrong, (len(counts), wrong[:12])


def test_graph_branches_give_the_single_streams_bits():
    """The decode and prefill graphs with the layers' independent parts as parallel branches
    (``openk3.model.branch``) replay the same kernels as the single-stream graphs, only
    concurrently: the same tokens and bit-equal log-probabilities. A missing wait (a branch
    reading what is not yet written, memory reused under a running branch) changes them."""
    from openk3.model import branch

    active = []
    side = branch.Fork.side

    def recording_side(fork):
        active.append(fork.active)
        return side(fork)

    prompts = [torch.randint(3, 4000, (n,)).tolist() for n in (7, 33, 150, 64, 1)]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    results = {}
    for enabled in (False, True):
        branch.ENABLED = enabled
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(branch.Fork, "side", recording_side)
                outs = make_engine(graphs=True).generate(prompts, params)
        finally:
            branch.ENABLED = True
        results[enabled] = [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]
        assert any(active) == enabled  # captures made branches only when enabled
        active.clear()
    assert results[True] == results[False]


def _count_ahead(eng: LLMEngine, launched: list[int]) -> None:
    decode_ahead = eng.runner.decode_ahead

    def counted(*a):
        launched[0] += 1
        return decode_ahead(*a)

    eng.runner.decode_ahead = counted


def test_overlapped_decoding_replays_plain_steppings_tokens():
    """Decode steps launched ahead (on by default with CUDA) replay the same graphs on the same
    inputs as plain stepping, their tokens fed on the device: the same tokens, greedy and seeded,
    and most decode steps launched ahead. The rows here end together: a batch that loses a row
    changes its bucket and the kernels' row counts (bf16 rounding), after which greedy near-ties
    may flip between any two engines; ragged ends are checked exactly on the CPU (fp32,
    tests/serve/test_engine.py) and here teacher-forced: every token the overlapped engine chose
    is the argmax of a fresh full-sequence forward, up to bf16's near-ties."""
    # 85 prompt tokens: one prefill step (the budget is 96), then every row decodes to the end
    prompts = [torch.randint(3, 4000, (n,)).tolist() for n in (7, 33, 20, 24, 1)]
    params = [SamplingParams(temperature=0, max_tokens=30)] * 4 + [SamplingParams(temperature=1.0, seed=11, max_tokens=30)]
    results, launched = {}, [0]
    for overlap in (False, True):
        eng = make_engine(graphs=True, overlap_decode=overlap)
        assert eng.overlap_decode == overlap
        _count_ahead(eng, launched)
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        final = {}
        while eng.has_unfinished():
            final.update((o.request_id, o.token_ids) for o in eng.step() if o.finished)
        results[overlap] = [final[r] for r in rids]
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        assert launched[0] == 0 or overlap
    assert results[True] == results[False]
    assert launched[0] >= 25
    assert make_engine(graphs=True).overlap_decode  # the default on CUDA
    eng = make_engine(graphs=True)  # ragged ends: rows leave the batch while a step is in flight
    launched[0] = 0
    _count_ahead(eng, launched)
    outs = eng.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=m) for m in (30, 12, 40, 5)])
    assert [len(o.token_ids) for o in outs] == [30, 12, 40, 5] and launched[0] >= 25
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p + o.token_ids[:-1]], device="cuda")
        with torch.inference_mode():
            logp = torch.log_softmax(eng.model(ids).logits[0, len(p) - 1:].float(), dim=-1)
        chosen = logp.gather(1, torch.tensor(o.token_ids, device="cuda")[:, None])[:, 0]
        gap = logp.max(-1).values - chosen  # a wrong state or token fed costs whole units
        assert gap.max() < 0.5, gap.max().item()
