"""The runner's host side (CPU, ``debug`` model): ``execute`` takes only the scheduler's output
(and the drafts of a speculative step);
a decode step turns a constant number of host lists into tensors (each one host -> device copy
on GPU), whatever the context length; the engine brings sampled ids and log-probs back with one
host copy each per step."""

from __future__ import annotations

import inspect
from array import array

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from openk3 import build_model, preset
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.model_runner import HostStaging, ModelRunner
from openk3.serve.sampler import SamplingParams
from openk3.serve.scheduler import SchedulerOutput
from openk3.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(preset("debug")).eval()


def make_engine(model) -> LLMEngine:
    return LLMEngine(model, ByteTokenizer(), EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=256, physical_block_size=16, hash_block_size=8,
        kda_checkpoint_interval=16, max_model_len=256, cuda_graphs=False), eos_token_ids=())


class HostTensors(TorchDispatchMode):
    """Counts tensors built from host data (``torch.tensor(list)``, list indices; ``_upload``'s
    packed arrays are counted by ``counting`` below): on GPU each is a host -> device copy."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


def test_execute_takes_only_the_scheduler_output():
    params = list(inspect.signature(ModelRunner.execute).parameters.values())
    assert [p.name for p in params] == ["self", "out", "draft_tokens"]
    assert params[1].annotation in (SchedulerOutput, "SchedulerOutput") and params[2].default is None


def decode_step_counts(model, prompt_len: int) -> list[tuple[int, int]]:
    """(host tensors built, those expected) per all-decode step: the decode inputs, plus the ids
    of the instructions before the forward (block-table updates) and after it (KDA saves)."""
    eng = make_engine(model)
    for i in range(3):
        eng.add_request(list(range(3 + i, 3 + i + prompt_len)), SamplingParams(temperature=0, max_tokens=12))
    counts, execute, upload, uploads = [], eng.runner.execute, eng.runner._upload, [0]

    def counting_upload(*parts):
        uploads[0] += 1
        return upload(*parts)

    def counting(out, draft_tokens=None):
        uploads[0] = 0
        with HostTensors() as mode:
            result = execute(out, draft_tokens)
        if all(n == 1 for _, n in out.scheduled):
            expected = 1 + bool(out.block_table_updates or out.kda_restores or out.kda_resets) + bool(out.kda_saves)
            counts.append((mode.count + uploads[0], expected))
        return result

    eng.runner.execute, eng.runner._upload = counting, counting_upload
    while eng.has_unfinished():
        eng.step()
    return counts


def test_decode_step_host_copies_are_few_and_do_not_grow_with_context(model):
    counts = decode_step_counts(model, 5) + decode_step_counts(model, 150)
    assert all(count == expected for count, expected in counts), counts
    assert {expected for _, expected in counts} >= {1, 2}


def test_one_host_copy_for_tokens_and_one_for_logprobs_per_step(model, monkeypatch):
    """Outside the forward pass (whose host-side offsets are host tensors by design), a step
    reads the device twice: the sampled ids, and the log-probs of the rows that want them."""
    eng = make_engine(model)
    eng.add_request(list(range(3, 20)), SamplingParams(temperature=0, max_tokens=6, logprobs=2))
    eng.add_request(list(range(5, 9)), SamplingParams(temperature=0.8, seed=1, max_tokens=6, logprobs=1))
    eng.add_request(list(range(7, 30)), SamplingParams(temperature=1.0, max_tokens=6, logprobs=0))
    reads, in_forward, execute = [], [False], eng.runner.execute

    def forward(out, draft_tokens=None):
        in_forward[0] = True
        try:
            return execute(out, draft_tokens)
        finally:
            in_forward[0] = False

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(t, *args, **kwargs):
            if not in_forward[0]:
                reads.append(name)
            return original(t, *args, **kwargs)
        return read

    eng.runner.execute = forward
    for name in ("tolist", "item", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    steps = 0
    while eng.has_unfinished():
        reads.clear()
        if eng.step():
            steps += 1
            assert reads == ["tolist", "tolist"], reads  # sampled ids, then log-probs
    assert steps >= 6


def test_prefill_buckets_pad_little_and_stay_few():
    """Powers of two up to 4,096 tokens (at least 64), two sizes per octave above: a pass is
    padded by at most 50% there, and 16K tokens of passes need 11 graphs, ~51K tokens of them."""
    from openk3.serve.graphs import prefill_bucket

    assert [prefill_bucket(n) for n in (1, 64, 65, 4096, 4097, 6144, 6145, 8193, 16384, 20000, 32768)] == \
        [64, 64, 128, 4096, 6144, 6144, 8192, 12288, 16384, 24576, 32768]
    sizes = {prefill_bucket(n) for n in range(1, 16385)}
    assert len(sizes) == 11 and sum(sizes) == 51136
    assert all(prefill_bucket(n) >= n for n in range(1, 40000, 7))
    assert max(prefill_bucket(n) / n for n in range(4097, 40000, 3)) <= 1.5


def test_prefill_graphs_default_to_the_token_budget(model):
    assert EngineConfig().prefill_graph_tokens is None
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(prefill_graph_tokens=-1)
    runner = ModelRunner(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=300, max_model_len=256))
    assert runner.prefill_graph_tokens == 300
    runner = ModelRunner(model, EngineConfig(max_num_seqs=2, prefill_graph_tokens=64, max_model_len=256))
    assert runner.prefill_graph_tokens == 64


def _staging_round(device: str, capacity: int, sizes: list[int]) -> list[tuple[torch.Tensor, list[int]]]:
    staging = HostStaging(torch.device(device), capacity)
    out = []
    for i, n in enumerate(sizes):
        ids = [(i * 7919 + j) % 100_003 for j in range(n)]
        out.append((staging.upload(array("q", ids)), ids))
        if device == "cuda" and i % 3 == 0:  # keep the GPU busy, so that copies are still in flight
            torch.cuda._sleep(1_000_000)
    return out


def test_host_staging_wraps_and_grows():
    """The ring goes back to its start (sizes that do not fit behind the head) and grows for an
    upload over half of it; every upload keeps its own values."""
    sizes = [5, 9, 3, 7, 0, 40, 6, 11]  # 9 + 3 + 7 > 16 - 5: a wrap; 40 > 16 / 2: a new buffer
    for got, want in _staging_round("cpu", 16, sizes):
        assert got.tolist() == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_staging_never_rewrites_what_the_gpu_has_not_read():
    """Uploads queued behind GPU sleeps (the copies run long after the host moved on) into a ring
    that wraps every few of them: each device tensor holds its own values."""
    results = _staging_round("cuda", 64, [20, 30, 25, 10, 31, 1, 30, 30, 30, 100, 7] * 3)
    torch.cuda.synchronize()
    for got, want in results:
        assert got.tolist() == want


@pytest.mark.parametrize("start,T", [(0, 5), (0, 16), (3, 1), (16, 16), (21, 40), (47, 1), (100, 60)])
def test_one_chunks_cache_rows_are_the_general_paths(model, start, T):
    """``_prefill_batch`` for one chunk (its slot given on the host: a slice of its table's row)
    gives the rows the general path computes for any N: its queries' and its keys' cache rows."""
    runner = make_engine(model).runner
    slot, K = 2, start + T
    g = torch.Generator().manual_seed(start * 131 + T)
    blocks = torch.randperm(runner.num_blocks, generator=g)[:runner.max_blocks_per_seq].to(torch.int32)
    runner.block_tables[slot] = blocks
    cu_q, cu_k = torch.tensor([0, T]), torch.tensor([0, K])
    args = (cu_q, cu_k, torch.tensor([start]), torch.tensor([slot]), cu_q.clone(), cu_k.clone())
    general, one = runner._prefill_batch(*args), runner._prefill_batch(*args, slot=slot)
    bs = runner.block_size
    want = torch.tensor([int(blocks[p // bs]) * bs + p % bs for p in range(K)])
    assert torch.equal(general.key_rows, want) and torch.equal(one.key_rows, want)
    assert torch.equal(general.slot_mapping, want[start:]) and torch.equal(one.slot_mapping, want[start:])
