"""Bookkeeping for the hybrid cache: paged MLA latents, KDA state slots, KDA-aware prefix cache.

Pure policy: everything here is an integer id. The model runner owns the tensors and executes
the instructions the scheduler hands on: ``BlockTableUpdate``, ``BlockCopy`` and ``KDARestore``
before the forward pass of the step that returned them, ``KDASave`` after it.

Prefix cache, in brief (K3_SPEC §5):
- Token ids are hashed in chained fine blocks of ``hash_block_size`` tokens; MLA latents live
  in coarse physical blocks of ``physical_block_size`` tokens (both ``EngineConfig`` fields).
- A block holding image positions is keyed by its token ids *and* the content digest of each
  image there (``Sequence.image_keys``): equal placeholder ids with another image never hit.
- A hit at boundary ``b`` (a multiple of ``hash_block_size``) needs every hash block below ``b``
  registered with matching token ids *and* a KDA checkpoint (recurrent + conv state of every KDA
  layer) stored for exactly that prefix: KDA state cannot be rebuilt from the latents.
- Physical blocks entirely below ``b`` are shared (refcount + 1); the block containing ``b`` is
  copied into a fresh block (copy-on-write of its first ``b % physical_block_size`` tokens); the
  checkpoint is restored into the sequence's own state slot; prefill resumes at ``b``.
- A block whose refcount drops to zero keeps its registered hashes and stays readable until the
  pool needs it again (least recently freed first); only then are its hashes dropped.
- KDA checkpoints live in a separate pool of ``num_kda_checkpoints`` storage ids with LRU
  eviction. A checkpoint pins no MLA block: without its latents it simply cannot hit.
- A checkpoint id is handed out when the step that reaches the boundary is scheduled
  (``plan_kda_save``) and becomes visible to lookups only once that step has run
  (``commit_kda_save``); freeing the sequence first (abort, failure) returns the id.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from openk3.serve.config import EngineConfig
from openk3.serve.sequence import Sequence


def hash_token_block(parent_hash: int | None, token_bytes: bytes,
                     image_keys: tuple[tuple[bytes, int], ...] = ()) -> int:
    """Chained hash of one hash block; through ``parent_hash`` it depends on every earlier token.
    ``image_keys``: (content digest, offset) of the images whose positions the block holds.

    Collisions are tolerated: every hit is verified against the stored token ids and image keys.
    """
    return hash((parent_hash, token_bytes, image_keys))


@dataclass(frozen=True)
class BlockCopy:
    """Copy the first ``num_tokens`` token rows of MLA block ``src`` into block ``dst`` (every layer)."""

    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True)
class KDARestore:
    """Copy KDA checkpoint ``checkpoint_id`` (every KDA layer) into state slot ``dst_state_slot``."""

    checkpoint_id: int
    dst_state_slot: int


@dataclass(frozen=True)
class KDASave:
    """After the forward pass, copy the KDA states of ``state_slot`` (every KDA layer) into
    checkpoint ``checkpoint_id``."""

    state_slot: int
    checkpoint_id: int


@dataclass(frozen=True)
class BlockTableUpdate:
    """Row ``state_slot`` of the runner's block table holds ``block_ids`` from column ``start`` on
    (the whole table at admission, the new blocks as a sequence grows)."""

    state_slot: int
    start: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Allocation:
    """What ``allocate`` did: the hit length and the instructions the runner must execute.

    With no ``kda_restore`` the sequence starts from token 0 and its state slot must be zeroed.
    """

    num_cached_tokens: int
    block_copy: BlockCopy | None
    kda_restore: KDARestore | None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # admissions that looked up the prefix cache
    hits: int = 0
    saved_tokens: int = 0  # prefill tokens skipped thanks to hits


@dataclass(frozen=True)
class _HashBlock:
    """A registered hash block: its token ids (``Sequence.ids_bytes``: int64 bytes, compared by
    ``memcmp``; a 32K-token prompt's 62 blocks as tuples took ~1 ms to build and compare) and the
    physical block holding its latents.

    ``parent_serial`` names the entry registered for the previous hash block by the same writer,
    so a chain of verified entries proves the whole prefix, not just each block on its own.
    """

    serial: int
    parent_serial: int | None
    token_bytes: bytes
    block_id: int
    image_keys: tuple[tuple[bytes, int], ...] = ()


@dataclass(frozen=True)
class _Checkpoint:
    """A KDA checkpoint of the first ``num_tokens`` ids of ``writer_token_ids``, verified on
    every hit.

    ``writer_token_ids`` is the writer's ``Sequence.token_ids`` itself, not a copy: that list is
    only ever appended to, so its first ``num_tokens`` ids never change and no prefix is copied.
    ``writer_prompt`` is its ``prompt_array``: prefixes within both prompts compare as int64s.
    """

    checkpoint_id: int
    writer_token_ids: list[int]
    num_tokens: int
    image_keys: tuple[tuple[bytes, int], ...]  # the prefix's images (``Sequence.image_keys``)
    writer_prompt: array

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The prefix, copied on demand (for inspection; lookups use ``same_prefix``)."""
        return tuple(self.writer_token_ids[: self.num_tokens])

    def same_prefix(self, other: _Checkpoint) -> bool:
        n, mine, theirs = self.num_tokens, self.writer_token_ids, other.writer_token_ids
        if n != other.num_tokens or self.image_keys != other.image_keys:
            return False
        if mine is theirs:  # the same writer's list holds the same prefix (the re-save case)
            return True
        if n <= min(len(self.writer_prompt), len(other.writer_prompt)):  # a memcmp: 31K ids in 0.03 ms
            return self.writer_prompt[:n] == other.writer_prompt[:n]      # (list slices: 0.2-0.7)
        return mine[:n] == theirs[:n]


@dataclass(frozen=True)
class _Hit:
    num_tokens: int
    shared_blocks: list[int]
    cow_src: int | None
    checkpoint_key: int
    last_serial: int  # serial of the entry of the hit's last hash block


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates MLA blocks and KDA state slots to sequences and runs the prefix cache.

    Block sizes, the checkpoint pool and ``enable_prefix_caching`` come from ``config``; the pool
    sizes are what the model runner could afford: ``num_blocks`` physical MLA blocks (not
    ``config.num_blocks``, which may be None) and ``num_state_slots`` KDA state slots (one per
    running sequence).
    """

    def __init__(self, config: EngineConfig, num_blocks: int, num_state_slots: int):
        for name, value in (("num_blocks", num_blocks), ("num_state_slots", num_state_slots)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.config = config
        self.num_blocks, self.num_state_slots = num_blocks, num_state_slots
        self.block_size = config.physical_block_size
        self.hash_block_size = config.hash_block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # hold no prefix
        # Refcount 0 but still holding registered prefixes; least recently freed first.
        self.cached_block_ids: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int, _HashBlock] = {}
        self.block_to_hashes: dict[int, list[int]] = {}
        self.free_state_slots: deque[int] = deque(range(num_state_slots))
        self.checkpoints: OrderedDict[int, _Checkpoint] = OrderedDict()  # LRU first
        self.free_checkpoint_ids: deque[int] = deque(range(config.num_kda_checkpoints))
        # Saves planned for the step being run, by request id: (hash key, checkpoint).
        self.pending_checkpoints: dict[str, tuple[int, _Checkpoint]] = {}
        self.stats = PrefixCacheStats()
        self._serials = itertools.count()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.cached_block_ids)

    @property
    def num_free_state_slots(self) -> int:
        return len(self.free_state_slots)

    @property
    def usage(self) -> float:
        """Fraction of MLA blocks held by sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    # Physical blocks and state slots.

    def _take_block(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.cached_block_ids[block_id]
        self.ref_counts[block_id] += 1

    def _release_block(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if block_id in self.block_to_hashes:
                self.cached_block_ids[block_id] = None
            else:
                self.free_block_ids.append(block_id)

    def _allocate_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.cached_block_ids.popitem(last=False)
            for h in self.block_to_hashes.pop(block_id):
                del self.hash_to_block[h]
        self.ref_counts[block_id] = 1
        return block_id

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether admitting ``seq`` fits: blocks for all its tokens plus the first decode token,
        and a state slot. Never over-commits."""
        return self._plan(seq)[1]

    def allocate(self, seq: Sequence) -> Allocation:
        """Admit ``seq``: look up the prefix cache, take blocks and a state slot.

        Sets ``seq.num_computed_tokens`` to the hit length (0 on a miss).
        """
        allocation = self.admit(seq)
        if allocation is None:
            raise RuntimeError(f"request {seq.request_id!r} does not fit; call can_allocate first")
        return allocation

    def admit(self, seq: Sequence) -> Allocation | None:
        """``allocate`` if ``seq`` fits (``can_allocate``), else None, with one prefix-cache
        lookup for both (a 32K-token prompt's costs ~1 ms)."""
        if seq.block_table or seq.state_slot is not None:
            raise RuntimeError(f"request {seq.request_id!r} already holds cache")
        hit, fits = self._plan(seq)
        if not fits:
            return None
        if self.config.enable_prefix_caching:
            self.stats.queries += 1
        seq.state_slot = self.free_state_slots.popleft()
        block_copy = kda_restore = None
        num_cached = 0
        if hit is not None:
            num_cached = hit.num_tokens
            for block_id in hit.shared_blocks:
                self._take_block(block_id)
            seq.block_table = list(hit.shared_blocks)
            if hit.cow_src is not None:
                self._take_block(hit.cow_src)  # pinned so our own allocations cannot evict it
                dst = self._allocate_block()
                seq.block_table.append(dst)
                block_copy = BlockCopy(hit.cow_src, dst, num_cached % self.block_size)
            self.checkpoints.move_to_end(hit.checkpoint_key)
            checkpoint_id = self.checkpoints[hit.checkpoint_key].checkpoint_id
            kda_restore = KDARestore(checkpoint_id, seq.state_slot)
            self.stats.hits += 1
            self.stats.saved_tokens += num_cached
        while len(seq.block_table) < self.num_blocks_for(seq.num_tokens + 1):
            seq.block_table.append(self._allocate_block())
        if hit is not None and hit.cow_src is not None:
            self._release_block(hit.cow_src)
        seq.num_computed_tokens = num_cached
        seq.num_cached_tokens = num_cached
        seq.num_registered_hash_blocks = num_cached // self.hash_block_size
        seq.last_registered_serial = hit.last_serial if hit is not None else None
        return Allocation(num_cached, block_copy, kda_restore)

    def can_append(self, seq: Sequence, num_lookahead: int = 0) -> bool:
        """Whether the pool can hold all of ``seq.num_tokens`` (the next token to compute) and
        ``num_lookahead`` positions after it (speculative draft tokens)."""
        return (self.num_blocks_for(seq.num_tokens + num_lookahead) - len(seq.block_table)
                <= self.num_free_blocks)

    def append_slot(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """Grow ``seq`` to hold its newest token and ``num_lookahead`` positions after it,
        taking new blocks when the last one is full."""
        while len(seq.block_table) < self.num_blocks_for(seq.num_tokens + num_lookahead):
            seq.block_table.append(self._allocate_block())

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past the one holding ``seq``'s newest token: a speculative step's
        lookahead for drafts that were rejected (never registered: they hold no computed token)."""
        while len(seq.block_table) > self.num_blocks_for(seq.num_tokens):
            self._release_block(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Release the blocks, the state slot and any uncommitted KDA save of ``seq``; registered
        prefixes and committed checkpoints stay cached."""
        # Tail blocks first, so the pool reuses them before the shared heads of prefixes.
        for block_id in reversed(seq.block_table):
            self._release_block(block_id)
        seq.block_table = []
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
        seq.num_registered_hash_blocks = 0
        seq.last_registered_serial = None
        seq.prefix_registration_stopped = False
        pending = self.pending_checkpoints.pop(seq.request_id, None)
        if pending is not None:
            self.free_checkpoint_ids.append(pending[1].checkpoint_id)

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat cache slot (``block_id * physical_block_size + offset``) of tokens [start, end)."""
        return [seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)]

    # Prefix cache.

    def _hash_chain(self, seq: Sequence, num_hash_blocks: int) -> list[int]:
        """``seq.block_hashes``, extended to at least ``num_hash_blocks`` entries: only the blocks
        not hashed yet are hashed (the chain's state is its last hash). Read the first
        ``num_hash_blocks``; the list may be longer."""
        chain, size = seq.block_hashes, self.hash_block_size
        while len(chain) < num_hash_blocks:
            k = len(chain)
            parent = chain[-1] if chain else None
            chain.append(hash_token_block(parent, seq.ids_bytes(k * size, (k + 1) * size),
                                          seq.image_keys(k * size, (k + 1) * size)))
        return chain

    @staticmethod
    def _prefix(seq: Sequence, num_tokens: int) -> _Checkpoint:
        """What a checkpoint of ``seq``'s first ``num_tokens`` tokens must match (id unset)."""
        return _Checkpoint(-1, seq.token_ids, num_tokens, seq.image_keys(0, num_tokens), seq.prompt_array)

    def _find_hit(self, seq: Sequence) -> _Hit | None:
        if not self.config.enable_prefix_caching or not self.checkpoints or seq.wants_prompt_logprobs:
            return None
        size = self.hash_block_size
        # At least one token must be left to compute: it produces the next-token logits.
        num_hash_blocks = (seq.num_tokens - 1) // size
        chain = self._hash_chain(seq, num_hash_blocks)
        entries: list[_HashBlock] = []
        for k in range(num_hash_blocks):
            entry = self.hash_to_block.get(chain[k])
            parent_serial = entries[-1].serial if entries else None
            if (entry is None or entry.parent_serial != parent_serial
                    or entry.token_bytes != seq.ids_bytes(k * size, (k + 1) * size)
                    or entry.image_keys != seq.image_keys(k * size, (k + 1) * size)):
                break
            entries.append(entry)
        for n in range(len(entries), 0, -1):
            checkpoint = self.checkpoints.get(chain[n - 1])
            if checkpoint is not None and checkpoint.same_prefix(self._prefix(seq, n * size)):
                break
        else:
            return None
        num_tokens = n * size
        per_block = self.block_size // size
        # Any entry of a physical block vouches for the whole block up to that entry: its writer
        # had the same verified prefix. Use the block's last entry (full blocks) or the hit's.
        shared = [entries[(j + 1) * per_block - 1].block_id for j in range(num_tokens // self.block_size)]
        cow_src = entries[n - 1].block_id if num_tokens % self.block_size else None
        return _Hit(num_tokens, shared, cow_src, chain[n - 1], entries[n - 1].serial)

    def _fits(self, seq: Sequence, hit: _Hit | None) -> bool:
        if not self.free_state_slots:
            return False
        needed = self.num_blocks_for(seq.num_tokens + 1)
        available = self.num_free_blocks
        if hit is not None:
            needed -= len(hit.shared_blocks)
            # Reviving a cached block, or pinning the copy source, uses up a free block.
            available -= sum(self.ref_counts[b] == 0 for b in hit.shared_blocks)
            if hit.cow_src is not None and self.ref_counts[hit.cow_src] == 0:
                available -= 1
        return needed <= available

    def _plan(self, seq: Sequence) -> tuple[_Hit | None, bool]:
        hit = self._find_hit(seq)
        if hit is not None and self._fits(seq, hit):
            return hit, True
        # Pinning a cached copy source can cost one block; a miss may still fit.
        return None, self._fits(seq, None)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Register the full hash blocks ``seq`` has computed since its last registration (call
        after the step ran); the work is proportional to the new blocks, not to the prefix.

        A new entry is only ever linked below the verified chain for this exact prefix: the
        sequence keeps the serial of its last registered (or hit) entry, which was verified
        against its tokens when it was reached. A colliding or stale entry stops registration
        for the rest of the sequence's stay (never a wrong hit); re-admission starts afresh.
        """
        size = self.hash_block_size
        num_full = seq.num_computed_tokens // size
        if (not self.config.enable_prefix_caching or seq.prefix_registration_stopped
                or num_full <= seq.num_registered_hash_blocks):
            return
        chain = self._hash_chain(seq, num_full)
        parent_serial = seq.last_registered_serial
        for k in range(seq.num_registered_hash_blocks, num_full):
            h = chain[k]
            token_bytes = seq.ids_bytes(k * size, (k + 1) * size)
            image_keys = seq.image_keys(k * size, (k + 1) * size)
            entry = self.hash_to_block.get(h)
            if entry is None:
                block_id = seq.block_table[k * size // self.block_size]
                entry = _HashBlock(next(self._serials), parent_serial, token_bytes, block_id, image_keys)
                self.hash_to_block[h] = entry
                self.block_to_hashes.setdefault(block_id, []).append(h)
            elif (entry.parent_serial != parent_serial or entry.token_bytes != token_bytes
                  or entry.image_keys != image_keys):
                seq.prefix_registration_stopped = True
                break
            parent_serial = entry.serial
        seq.num_registered_hash_blocks = num_full
        seq.last_registered_serial = parent_serial

    def kda_checkpoint_boundaries(self, seqs: list[Sequence]) -> list[Sequence]:
        """The sequences of ``seqs`` whose computed tokens end at a KDA checkpoint boundary, in
        order. Checkpoints sit every ``kda_checkpoint_interval`` tokens and at the prompt end
        rounded down to a hash boundary. (One call per step: the scheduler asks for the batch.)"""
        config = self.config
        if not config.enable_prefix_caching or config.num_kda_checkpoints == 0:
            return []
        interval, size = config.kda_checkpoint_interval, self.hash_block_size
        return [s for s in seqs if s.num_computed_tokens > 0 and (
            s.num_computed_tokens % interval == 0 or s.num_computed_tokens == s.num_prompt_tokens // size * size)]

    def next_kda_checkpoint_boundary(self, seq: Sequence, after: int) -> int | None:
        """The first checkpoint boundary strictly after token ``after``, or None when disabled."""
        if not self.config.enable_prefix_caching or self.config.num_kda_checkpoints == 0:
            return None
        interval = self.config.kda_checkpoint_interval
        boundary = (after // interval + 1) * interval
        prompt_end = seq.num_prompt_tokens // self.hash_block_size * self.hash_block_size
        return prompt_end if after < prompt_end < boundary else boundary

    def plan_kda_save(self, seq: Sequence, num_tokens: int) -> KDASave | None:
        """Hand out a checkpoint id for the KDA state of ``seq`` after ``num_tokens`` (computed by
        the step being scheduled); the runner saves into it after that step's forward pass.

        Returns None when that prefix is already stored (its LRU entry is refreshed), when
        checkpoints are disabled, or when every id is being written this step. Evicts the least
        recently used checkpoint when the pool is full. The save stays invisible to lookups until
        ``commit_kda_save``.
        """
        if num_tokens <= 0 or num_tokens % self.hash_block_size or num_tokens > seq.num_computed_tokens:
            raise ValueError(
                f"request {seq.request_id!r}: a KDA checkpoint needs a computed hash boundary, "
                f"got {num_tokens} (computed {seq.num_computed_tokens}, hash_block_size {self.hash_block_size})"
            )
        if not self.config.enable_prefix_caching or self.config.num_kda_checkpoints == 0:
            return None
        if seq.request_id in self.pending_checkpoints:
            raise RuntimeError(f"request {seq.request_id!r} already has a KDA save in this step")
        num_hash_blocks = num_tokens // self.hash_block_size
        key = self._hash_chain(seq, num_hash_blocks)[num_hash_blocks - 1]
        prefix = self._prefix(seq, num_tokens)
        existing = self.checkpoints.get(key)
        if existing is not None and existing.same_prefix(prefix):
            self.checkpoints.move_to_end(key)
            return None
        if self.free_checkpoint_ids:
            checkpoint_id = self.free_checkpoint_ids.popleft()
        elif self.checkpoints:
            # A restore planned earlier in this step reads the evicted entry before the forward
            # pass; the save overwrites it only after.
            _, evicted = self.checkpoints.popitem(last=False)
            checkpoint_id = evicted.checkpoint_id
        else:
            return None
        self.pending_checkpoints[seq.request_id] = (key, _Checkpoint(checkpoint_id, seq.token_ids,
                                                                     num_tokens, prefix.image_keys,
                                                                     seq.prompt_array))
        return KDASave(seq.state_slot, checkpoint_id)

    def commit_step(self, seqs: list[Sequence]) -> None:
        """The step that computed ``seqs`` has run: ``register_computed_blocks`` and
        ``commit_kda_save`` for each, in order, calling them only for sequences with new full
        hash blocks or a planned save (most decode steps have neither)."""
        size, pending = self.hash_block_size, self.pending_checkpoints
        for seq in seqs:
            if seq.num_computed_tokens // size > seq.num_registered_hash_blocks:
                self.register_computed_blocks(seq)
            if pending and seq.request_id in pending:
                self.commit_kda_save(seq)

    def commit_kda_save(self, seq: Sequence) -> None:
        """The step that saved ``seq``'s planned checkpoint has run: make it available to hits."""
        pending = self.pending_checkpoints.pop(seq.request_id, None)
        if pending is None:
            return
        key, checkpoint = pending
        existing = self.checkpoints.pop(key, None)
        if existing is not None and existing.same_prefix(checkpoint):
            # another sequence of the same step saved this prefix first: keep one copy
            self.free_checkpoint_ids.append(checkpoint.checkpoint_id)
            checkpoint = existing
        elif existing is not None:  # hash collision: the newer prefix takes the key
            self.free_checkpoint_ids.append(existing.checkpoint_id)
        self.checkpoints[key] = checkpoint
