"""Per-request state that the scheduler and the block manager share. No tensors, no sampling."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable
from dataclasses import dataclass


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's features go: positions ``[offset, offset + length)`` of the prompt (its
    placeholder tokens), and a digest of the image's content (``PackedImages.content_hashes``),
    which keys the prefix cache of those positions."""

    offset: int
    length: int
    content_hash: bytes


class Sequence:
    """One request: its token ids (prompt followed by generated ids) and the cache it holds.

    ``num_computed_tokens`` counts the leading tokens whose MLA latents sit in the paged cache and
    whose effect is folded into the KDA state slot. The last generated token is never computed
    until the next step, so a decoding sequence has ``num_tokens - num_computed_tokens == 1``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        eos_token_ids: Iterable[int] = (),
        image_spans: tuple[ImageSpan, ...] = (),
        prompt_array: array | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        # copied once: every output of the request shares it (do not mutate)
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # the prompt as int64s (``prompt_array``, when the caller has it, must hold the same ids):
        # prefill passes upload slices of it without converting Python ints (``ids_array``)
        self.prompt_array = array("q", prompt_token_ids) if prompt_array is None else prompt_array
        if len(self.prompt_array) != self.num_prompt_tokens:
            raise ValueError(f"request {request_id!r}: prompt_array holds {len(self.prompt_array)} ids, "
                             f"the prompt {self.num_prompt_tokens}")
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        # the prompt's images, in order (the model runner holds their pixels and features)
        self.image_spans = tuple(image_spans)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop", "length" or "abort"
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit length at the latest admission
        self.num_preemptions = 0
        self.block_table: list[int] = []  # physical MLA block ids, in token order
        self.state_slot: int | None = None  # KDA recurrent + conv state slot
        # Chained hashes of the full hash blocks, filled lazily by the block manager; valid for
        # the whole life of the sequence because token ids are only ever appended.
        self.block_hashes: list[int] = []
        self.num_registered_hash_blocks = 0
        # Serial of the prefix-cache entry of the last registered (or hit) hash block: the next
        # registration links below it instead of re-walking the chain from the start.
        self.last_registered_serial: int | None = None
        self.prefix_registration_stopped = False  # a colliding or stale entry was met
        # The log-probabilities of the prompt's own tokens are wanted: every prompt token is then
        # computed here (a prefix-cache hit would skip their logits), though its blocks are still
        # registered for others.
        self.wants_prompt_logprobs = False
        # Speculative decoding: the draft tokens verified this step (the scheduler planned ``k``
        # of them; the engine sets them when verification brings them to the host, before
        # ``Scheduler.postprocess``, which clears them). The scheduler counts them in
        # ``num_computed_tokens`` until postprocess rolls it back to the accepted ones.
        self.draft_token_ids: list[int] = []

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token left to compute: a (re)prefill rather than a decode step."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def image_keys(self, start: int, end: int) -> tuple[tuple[bytes, int], ...]:
        """(content digest, offset) of the images with positions in [start, end): with the token
        ids, the prefix-cache key of those positions (equal ids, other image: another key)."""
        if not self.image_spans:  # a text prompt (a 32K prompt's hash chain asks 126 times)
            return ()
        return tuple((s.content_hash, s.offset) for s in self.image_spans
                     if s.offset < end and start < s.offset + s.length)

    def ids_array(self, start: int, end: int) -> array:
        """``token_ids[start:end]`` as int64s: a copy of the prompt's bytes where the range lies in
        the prompt (every prefill chunk but a preempted sequence's recompute)."""
        if end <= self.num_prompt_tokens:
            return self.prompt_array[start:end]
        if end > len(self.token_ids):  # a slice would silently come back short
            raise IndexError(f"request {self.request_id!r}: tokens [{start}, {end}) of {len(self.token_ids)}")
        return array("q", self.token_ids[start:end])

    def ids_bytes(self, start: int, end: int) -> bytes:
        """``ids_array(start, end)``'s bytes: the prefix cache's key and check of a hash block."""
        if end <= self.num_prompt_tokens:
            return memoryview(self.prompt_array)[start:end].tobytes()
        return self.ids_array(start, end).tobytes()

    def append_token(self, token_id: int) -> None:
        """The only change ``token_ids`` ever sees: KDA checkpoints keep a reference to the list
        and read its prefix, and ``block_hashes`` cover it."""
        self.token_ids.append(token_id)
