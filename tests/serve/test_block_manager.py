"""Block manager: paging, admission, and the KDA-aware prefix cache (hash 512 inside 6144 blocks)."""

import random
from array import array

import pytest

from openk3.serve import block_manager as bm_module
from openk3.serve.block_manager import BlockCopy, BlockManager, KDARestore, KDASave
from openk3.serve.config import EngineConfig
from openk3.serve.sequence import ImageSpan, Sequence


def make_manager(num_blocks=16, num_state_slots=4, **overrides) -> BlockManager:
    config = dict(physical_block_size=6144, hash_block_size=512, num_kda_checkpoints=8,
                  kda_checkpoint_interval=8192)
    config.update(overrides)
    return BlockManager(EngineConfig(**config), num_blocks, num_state_slots)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def save(bm: BlockManager, seq: Sequence, num_tokens: int) -> int | None:
    """Plan a KDA save at ``num_tokens``, pretend the step ran, commit; the id handed out."""
    planned = bm.plan_kda_save(seq, num_tokens)
    bm.commit_kda_save(seq)
    return None if planned is None else planned.checkpoint_id


def run_prefill(bm: BlockManager, seq: Sequence, checkpoints=()) -> list[int]:
    """Pretend the runner computed the whole prompt and saved KDA states at ``checkpoints``."""
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed_blocks(seq)
    return [save(bm, seq, b) for b in checkpoints]


def test_hit_inside_physical_block_copies_on_write():
    bm = make_manager()
    prefix = tokens(2560, 0)
    a = Sequence("a", prefix + tokens(440, 1), max_tokens=8)
    (ckpt,) = run_prefill(bm, a, checkpoints=[2560])
    b = Sequence("b", prefix + tokens(300, 2), max_tokens=8)
    allocation = bm.allocate(b)
    assert allocation.num_cached_tokens == 2560 == b.num_computed_tokens
    assert allocation.block_copy == BlockCopy(a.block_table[0], b.block_table[0], 2560 % 6144)
    assert b.block_table[0] != a.block_table[0]
    assert allocation.kda_restore == KDARestore(ckpt, b.state_slot)
    assert b.state_slot != a.state_slot
    assert bm.stats.hits == 1 and bm.stats.queries == 2 and bm.stats.saved_tokens == 2560
    assert (bm.stats.hits, bm.stats.queries) == (1, 2)


def test_hit_at_physical_block_edge_shares_without_copy():
    bm = make_manager()
    prefix = tokens(6144, 0)
    a = Sequence("a", prefix + tokens(100, 1), max_tokens=8)
    run_prefill(bm, a, checkpoints=[6144])
    b = Sequence("b", prefix + tokens(700, 2), max_tokens=8)
    allocation = bm.allocate(b)
    assert allocation.num_cached_tokens == 6144 and allocation.block_copy is None
    assert allocation.kda_restore is not None
    assert b.block_table[0] == a.block_table[0] and bm.ref_counts[a.block_table[0]] == 2
    assert b.block_table[1] != a.block_table[1]
    bm.free(a)
    bm.free(b)
    assert all(r == 0 for r in bm.ref_counts) and bm.num_free_blocks == 16


def test_diverging_prefixes_hit_at_last_common_checkpoint():
    bm = make_manager()
    a = Sequence("a", tokens(3000, 0), max_tokens=8)
    run_prefill(bm, a, checkpoints=[512, 1024, 1536, 2048])
    b = Sequence("b", a.token_ids[:1100] + tokens(900, 5), max_tokens=8)
    assert bm.allocate(b).num_cached_tokens == 1024
    # Only a checkpointed boundary counts: 1024 is the last one at or below the divergence.
    c = Sequence("c", tokens(3000, 9), max_tokens=8)
    assert bm.allocate(c).num_cached_tokens == 0


def test_whole_prompt_hit_leaves_one_token_to_compute():
    bm = make_manager()
    a = Sequence("a", tokens(1024, 0), max_tokens=8)
    run_prefill(bm, a, checkpoints=[512, 1024])
    b = Sequence("b", list(a.token_ids), max_tokens=8)
    assert bm.allocate(b).num_cached_tokens == 512


def test_no_hit_without_kda_checkpoint():
    bm = make_manager()
    a = Sequence("a", tokens(3000, 0), max_tokens=8)
    run_prefill(bm, a)  # latents registered, no KDA state saved
    b = Sequence("b", list(a.token_ids), max_tokens=8)
    allocation = bm.allocate(b)
    assert allocation.num_cached_tokens == 0 and allocation.kda_restore is None
    assert bm.stats.hits == 0


def test_token_verification_rejects_forged_hash_collision(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_token_block", lambda *args: 42)
    bm = make_manager()
    a = Sequence("a", tokens(2000, 0), max_tokens=8)
    run_prefill(bm, a, checkpoints=[512, 1024])
    forged = Sequence("forged", tokens(2000, 1), max_tokens=8)  # every hash collides
    assert bm.allocate(forged).num_cached_tokens == 0
    # Same first block, different second block: the shared hash key holds a's 1024-token
    # checkpoint, which must not be taken for a 512-token prefix either.
    partial = Sequence("partial", a.token_ids[:512] + tokens(1500, 2), max_tokens=8)
    assert bm.allocate(partial).num_cached_tokens == 0
    assert bm.stats.hits == 0


def test_checkpoint_lru_eviction_under_small_budget():
    bm = make_manager(num_kda_checkpoints=2)
    seqs = [Sequence(f"s{i}", tokens(600, i), max_tokens=8) for i in range(3)]
    ids = [run_prefill(bm, s, checkpoints=[512])[0] for s in seqs]
    assert ids[2] == ids[0]  # s0's storage was recycled
    for s in seqs:
        bm.free(s)
    hits = [bm.allocate(Sequence(f"q{i}", seqs[i].token_ids[:512] + [7], max_tokens=8)).num_cached_tokens
            for i in range(3)]
    assert hits == [0, 512, 512]


def test_registering_existing_checkpoint_returns_none_and_refreshes_lru():
    bm = make_manager(num_kda_checkpoints=2)
    s0, s1, s2 = (Sequence(f"s{i}", tokens(600, i), max_tokens=8) for i in range(3))
    run_prefill(bm, s0, checkpoints=[512])
    run_prefill(bm, s1, checkpoints=[512])
    assert save(bm, s0, 512) is None  # refresh s0: s1 is now the oldest
    run_prefill(bm, s2, checkpoints=[512])
    for s in (s0, s1, s2):
        bm.free(s)
    assert bm.allocate(Sequence("q0", s0.token_ids[:512] + [1], max_tokens=8)).num_cached_tokens == 512
    assert bm.allocate(Sequence("q1", s1.token_ids[:512] + [1], max_tokens=8)).num_cached_tokens == 0


def test_planned_save_is_invisible_until_committed():
    """The id is handed out when the step is scheduled; a hit needs the state written, so only
    the commit (after the step ran) makes the checkpoint available."""
    bm = make_manager()
    a = Sequence("a", tokens(600, 0), max_tokens=8)
    bm.allocate(a)
    a.num_computed_tokens = a.num_tokens
    bm.register_computed_blocks(a)
    planned = bm.plan_kda_save(a, 512)
    assert planned == KDASave(a.state_slot, planned.checkpoint_id)
    probe = Sequence("probe", a.token_ids[:512] + [1], max_tokens=8)
    assert bm.allocate(probe).num_cached_tokens == 0
    bm.free(probe)
    bm.commit_kda_save(a)
    assert bm.allocate(Sequence("hit", a.token_ids[:512] + [1], max_tokens=8)).num_cached_tokens == 512


def test_freeing_before_the_commit_returns_the_planned_id():
    bm = make_manager(num_kda_checkpoints=2)
    a = Sequence("a", tokens(600, 0), max_tokens=8)
    bm.allocate(a)
    a.num_computed_tokens = a.num_tokens
    bm.register_computed_blocks(a)
    planned = bm.plan_kda_save(a, 512)
    bm.free(a)  # aborted before its step was confirmed
    bm.commit_kda_save(a)  # a late commit finds nothing
    assert sorted(bm.free_checkpoint_ids) == [0, 1] and not bm.checkpoints and not bm.pending_checkpoints
    assert planned.checkpoint_id in bm.free_checkpoint_ids


def test_two_saves_of_one_prefix_in_a_step_keep_one_checkpoint():
    bm = make_manager(num_kda_checkpoints=3)
    prompt = tokens(600, 0)
    seqs = [Sequence(f"s{i}", list(prompt), max_tokens=8) for i in range(2)]
    planned = []
    for s in seqs:
        bm.allocate(s)
        s.num_computed_tokens = 512
        planned.append(bm.plan_kda_save(s, 512))
    assert planned[0].checkpoint_id != planned[1].checkpoint_id
    for s in seqs:
        bm.commit_kda_save(s)
    assert len(bm.checkpoints) == 1 and len(bm.free_checkpoint_ids) == 2
    assert next(iter(bm.checkpoints.values())).checkpoint_id == planned[0].checkpoint_id


def test_no_save_when_every_id_is_being_written():
    bm = make_manager(num_kda_checkpoints=1)
    a, b = (Sequence(f"s{i}", tokens(600, i), max_tokens=8) for i in range(2))
    for s in (a, b):
        bm.allocate(s)
        s.num_computed_tokens = 512
    assert bm.plan_kda_save(a, 512) is not None
    assert bm.plan_kda_save(b, 512) is None  # the only id is pending, nothing to evict


def test_freed_prefix_stays_cached_until_the_pool_needs_it():
    bm = make_manager(num_blocks=3)
    a = Sequence("a", tokens(6144 + 10, 0), max_tokens=8)
    run_prefill(bm, a, checkpoints=[6144])
    bm.free(a)
    assert bm.num_free_blocks == 3
    b = Sequence("b", a.token_ids[:6144] + [1, 2], max_tokens=8)
    assert bm.allocate(b).num_cached_tokens == 6144  # revived from the cached pool
    bm.free(b)
    filler = Sequence("f", tokens(3 * 6144 - 1, 3), max_tokens=1)  # needs every block
    assert bm.allocate(filler).num_cached_tokens == 0
    bm.free(filler)
    c = Sequence("c", a.token_ids[:6144] + [1, 2], max_tokens=8)
    assert bm.allocate(c).num_cached_tokens == 0  # latents were evicted, checkpoint alone is not enough


def test_admission_never_over_commits():
    bm = make_manager(num_blocks=2, num_state_slots=2)
    a = Sequence("a", tokens(6144, 0), max_tokens=8)  # prompt + first decode token: 2 blocks
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 2 and not bm.can_allocate(Sequence("b", [1], max_tokens=1))
    bm.free(a)
    bm2 = make_manager(num_state_slots=1)
    bm2.allocate(Sequence("x", [1], max_tokens=1))
    assert not bm2.can_allocate(Sequence("y", [1], max_tokens=1))  # no state slot left


def test_append_slot_grows_by_a_block_at_the_edge():
    bm = make_manager(num_blocks=4, physical_block_size=8, hash_block_size=4, kda_checkpoint_interval=8)
    s = Sequence("s", list(range(7)), max_tokens=20)
    bm.allocate(s)
    assert len(s.block_table) == 1  # 7 prompt tokens + 1 decode token
    s.append_token(7)
    bm.append_slot(s)
    assert len(s.block_table) == 1
    s.append_token(8)
    assert bm.can_append(s)
    bm.append_slot(s)
    assert len(s.block_table) == 2
    assert bm.slot_mapping(s, 7, 9) == [s.block_table[0] * 8 + 7, s.block_table[1] * 8]


@pytest.mark.parametrize("overrides", [
    dict(physical_block_size=6144, hash_block_size=500),
    dict(hash_block_size=512, kda_checkpoint_interval=1000),
    dict(num_blocks=0),
])
def test_bad_sizes_raise(overrides):
    with pytest.raises(ValueError):
        make_manager(**overrides)


def chain_from_scratch(seq: Sequence, num_hash_blocks: int, size: int) -> list[int]:
    chain: list[int] = []
    for k in range(num_hash_blocks):
        chain.append(bm_module.hash_token_block(chain[-1] if chain else None,
                                                array("q", seq.token_ids[k * size : (k + 1) * size]).tobytes(),
                                                seq.image_keys(k * size, (k + 1) * size)))
    return chain


@pytest.mark.parametrize("seed", range(6))
def test_incremental_registration_equals_registering_from_scratch(seed):
    """Blocks registered in uneven steps (prefill chunks, then decode tokens appended between
    registrations) carry the from-scratch chained hashes, and leave exactly the entries that
    one registration of the whole sequence leaves."""
    rng = random.Random(seed)
    size = 4
    ids = tokens(rng.randrange(5, 60), seed)
    spans = (ImageSpan(3, 6, b"img"),) if seed % 2 else ()
    stepwise, at_once = (make_manager(num_blocks=64, physical_block_size=16, hash_block_size=size,
                                      kda_checkpoint_interval=8) for _ in range(2))
    seq = Sequence("s", ids, max_tokens=100, image_spans=spans)
    stepwise.allocate(seq)
    while seq.num_tokens < 150:
        if seq.num_computed_tokens == seq.num_tokens:
            for _ in range(rng.randrange(1, 6)):
                seq.append_token(rng.randrange(50_000))
            stepwise.append_slot(seq)
        seq.num_computed_tokens += rng.randrange(1, seq.num_uncomputed_tokens + 1)
        stepwise.register_computed_blocks(seq)
        num_full = seq.num_computed_tokens // size
        assert seq.num_registered_hash_blocks == num_full
        assert seq.block_hashes[:num_full] == chain_from_scratch(seq, num_full, size)
    fresh = Sequence("s", seq.token_ids, max_tokens=100, image_spans=spans)
    at_once.allocate(fresh)
    fresh.num_computed_tokens = seq.num_computed_tokens
    at_once.register_computed_blocks(fresh)
    assert stepwise.hash_to_block == at_once.hash_to_block
    assert stepwise.block_to_hashes == at_once.block_to_hashes


def test_registration_work_per_decode_step_is_constant(monkeypatch):
    """Each decode step hashes and walks only its new hash block, however long the prefix."""
    size = 4
    bm = make_manager(num_blocks=64, physical_block_size=16, hash_block_size=size, kda_checkpoint_interval=8)
    seq = Sequence("s", tokens(400, 0), max_tokens=200)
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed_blocks(seq)
    calls = {"hash": 0, "image_keys": 0}
    hash_block, image_keys = bm_module.hash_token_block, seq.image_keys

    def counting_hash(*args):
        calls["hash"] += 1
        return hash_block(*args)

    def counting_image_keys(start, end):
        calls["image_keys"] += 1
        return image_keys(start, end)

    monkeypatch.setattr(bm_module, "hash_token_block", counting_hash)
    monkeypatch.setattr(seq, "image_keys", counting_image_keys)
    for step in range(100):
        seq.append_token(step)
        bm.append_slot(seq)
        seq.num_computed_tokens = seq.num_tokens
        bm.register_computed_blocks(seq)
        if bm.kda_checkpoint_boundaries([seq]):
            save(bm, seq, seq.num_computed_tokens)
    assert seq.num_registered_hash_blocks == 500 // size
    assert calls["hash"] == 100 // size
    # One per new block to hash it and one to register it, one per checkpoint's prefix.
    assert calls["image_keys"] == 2 * (100 // size) + 100 // 8


def test_prefixes_compare_as_int64s_in_the_prompts_and_as_lists_past_them():
    """``_Checkpoint.same_prefix`` reads the writers' prompt arrays where the prefix lies in both
    prompts and their token lists where it does not (a checkpoint in generated tokens)."""
    a = Sequence("a", tokens(20, 0), max_tokens=64)
    for t in tokens(12, 1):
        a.append_token(t)
    b = Sequence("b", a.token_ids[:32] + tokens(5, 2), max_tokens=8)  # a's next turn

    def changed(seq, i):
        ids = list(seq.token_ids)
        ids[i] += 1
        return Sequence("c", ids, max_tokens=8)

    def same(x, y, n):
        return BlockManager._prefix(x, n).same_prefix(BlockManager._prefix(y, n))

    assert same(a, b, 16) and same(a, b, 32)  # within both prompts; past a's
    assert not same(a, changed(b, 3), 16) and not same(a, changed(b, 25), 32)
    assert same(a, changed(b, 25), 24)


def test_sequence_ids_as_int64s_past_the_prompt():
    seq = Sequence("s", [5, 6, 7], max_tokens=8)
    seq.append_token(9)
    assert list(seq.ids_array(1, 4)) == [6, 7, 9] and list(seq.ids_array(0, 2)) == [5, 6]
    assert seq.ids_bytes(1, 4) == array("q", [6, 7, 9]).tobytes()
    with pytest.raises(ValueError, match="prompt_array holds 2 ids"):
        Sequence("t", [1, 2, 3], max_tokens=8, prompt_array=array("q", [1, 2]))
