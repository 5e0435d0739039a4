"""``EngineConfig``: every serving setting and its default, in one place. No tensors.

The scheduler, the block manager and the model runner all read this one object. What depends on
the model and the machine (the number of MLA blocks the runner can afford, the context that
leaves, one KDA state slot per running sequence) is worked out by the runner and handed to the
others as arguments, never written back here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# `openk3 serve --shutdown-grace`'s default: on SIGTERM or Ctrl-C, responses in flight get this
# less one second to finish, and the HTTP server closes what is left at this (docs/serving.md)
GRACE_SECONDS = 5.0


def check_grace(grace: float) -> None:
    """Raise ValueError unless ``grace`` (seconds) is a usable shutdown grace: finite and >= 1."""
    if not (math.isfinite(grace) and grace >= 1):
        raise ValueError(f"shutdown grace: {grace} s must be >= 1 and finite (responses in flight get it less 1 s)")


@dataclass
class EngineConfig:
    """Serving settings. Sizes are in tokens unless named otherwise; ``openk3 serve`` has one
    flag per field, spelled the same (``--max-num-seqs``).

    Scheduling and requests:
        max_num_seqs: sequences running at once (also the number of KDA state slots).
        max_num_batched_tokens: tokens per step, decodes plus prefill chunks (the chunked-prefill
            budget). 16384: every prefill pass pays a fixed cost (~0.1 s of host time for
            ``small`` eagerly, less as a graph), so fewer, larger chunks cut time to first
            token (a 32K prompt in 2 passes instead of 8 at 4096); activations of 16K tokens fit an H200 easily, while a larger
            budget would stall the decodes sharing a step for longer. With prefix caching
            chunks still end at every ``kda_checkpoint_interval``.
        max_model_len: prompt + max_tokens limit per request (None: the model's
            ``max_position_embeddings``, capped by what the MLA cache holds). A value the cache
            cannot hold once (``num_blocks``, or ``cache_memory_gb``) is an error that names the
            memory it needs; 1,048,576 + a margin serves ``small`` on one GPU
            (``docs/long_context.md``, "Serving at 1M tokens").
        max_tokens_limit: requests asking for more ``max_tokens`` than this are refused.
        max_image_bytes: the largest encoded image a request may carry (a chat ``image_url``
            data URL after base64 decoding, or bytes handed to the engine); 20 MiB, OpenAI's limit.
    Cache (block manager and model runner):
        num_blocks: physical MLA blocks (None: enough for ``max_num_seqs`` sequences of
            ``max_model_len`` tokens, capped by ``cache_memory_gb``).
        cache_memory_gb: budget for the MLA block pool when ``num_blocks`` is None, in GiB (the
            engine's ``gpu_memory_utilization``: a fixed size, not a share of the GPU). A pool
            larger than the GPU's free memory is refused at start-up.
        physical_block_size: tokens per physical MLA block.
        hash_block_size: tokens per prefix-hash block; must divide ``physical_block_size``.
        num_kda_checkpoints: KDA checkpoint storage entries (the checkpoint memory budget).
        kda_checkpoint_interval: a KDA checkpoint is taken every this many tokens (and at prompt
            ends, rounded down to a hash boundary); a multiple of ``hash_block_size``.
        enable_prefix_caching: off means no hashes, no checkpoints, no hits.
    Speculative decoding (``docs/speculative.md``, "Engine integration"):
        num_speculative_tokens: K, draft tokens proposed and verified per decode step (0: off).
            A decode then computes up to K + 1 positions and emits 1 to K + 1 tokens;
            ``max_num_batched_tokens`` must be at least ``max_num_seqs * (K + 1)``.
        draft: the draft (``openk3.runtime.load_draft_model``): a small openk3/Kimi model's
            directory (sharing the target's vocabulary), an EAGLE-3 draft directory written by
            ``openk3 train-draft``, or ``mtp`` (the target's own MTP layer); required when K > 0
            unless the engine is handed a draft model object.
    Runner:
        cuda_graphs: capture decode steps, and with speculative decoding the verify step, its
            rollback and the drafts' steps, as CUDA graphs, one per batch bucket (GPU fast paths
            only: not with ``OPENK3_REFERENCE=1``).
        prefill_graph_tokens: prefill passes of at most this many tokens run as CUDA graphs too
            (None: ``max_num_batched_tokens``, every pass without images), padded to their
            bucket (``prefill_bucket``: a power of two up to 4,096 tokens, at least 64; two
            sizes per octave above), split at the MLA layers' attention, which runs eagerly
            between the pieces (its keys are every chunk's whole prefix: no fixed shape). An
            eager prefill pass of ``small`` costs ~0.12-0.2 s of host time whatever its size,
            and even a 32K-token pass left its GPU idle for 28 of 156 ms (issue P8); a graph
            replays it in far less. The first pass of each size pays the capture (~0.4 s). The
            graphs' memory (the largest size's activations, and per size the MLA layers'
            attention inputs and outputs, all held: ~3 GB for ``small``'s 11 sizes up to
            16,384 tokens) is outside ``cache_memory_gb``: lower this, or 0 (off), when the
            GPU is short of memory.
        overlap_decode: while every running request decodes (no prompt waiting, no speculation,
            no log-probabilities asked for), launch the next decode step before this step's
            tokens reach the host, its input tokens read on the device: the host's work between
            two steps (the tokens' copy, bookkeeping, text, scheduling; 0.27-0.8 ms a step on the
            H200's host) overlaps the GPU's instead of idling it. The outputs are the same
            (``LLMEngine._launch_ahead``); a prompt that arrives meanwhile is admitted one step
            later. None (default): on a CUDA device (on the CPU there is nothing to overlap
            with; True runs the same steps there, as the tests do).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None
    max_tokens_limit: int = 1 << 20
    max_image_bytes: int = 20 << 20
    num_blocks: int | None = None
    cache_memory_gb: float = 8.0
    physical_block_size: int = 6144
    hash_block_size: int = 512
    num_kda_checkpoints: int = 16
    kda_checkpoint_interval: int = 8192
    enable_prefix_caching: bool = True
    num_speculative_tokens: int = 0
    draft: str | None = None
    cuda_graphs: bool = True
    prefill_graph_tokens: int | None = None
    overlap_decode: bool | None = None

    def __post_init__(self):
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"EngineConfig.{name}={getattr(self, name)!r}: {why}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_tokens_limit", "max_image_bytes",
                     "num_blocks", "cache_memory_gb", "physical_block_size", "hash_block_size",
                     "kda_checkpoint_interval"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise bad(name, "must be positive")
        if self.num_kda_checkpoints < 0:
            raise bad("num_kda_checkpoints", "must be >= 0")
        if self.prefill_graph_tokens is not None and self.prefill_graph_tokens < 0:
            raise bad("prefill_graph_tokens", "must be >= 0 (0 turns prefill graphs off)")
        if self.num_speculative_tokens < 0:
            raise bad("num_speculative_tokens", "must be >= 0 (0 turns speculative decoding off)")
        need = self.max_num_seqs * (1 + self.num_speculative_tokens)
        if self.num_speculative_tokens and self.max_num_batched_tokens < need:
            raise bad("max_num_batched_tokens", f"must be >= max_num_seqs * (1 + num_speculative_tokens) = {need}: "
                                                "every decode's token and drafts, with room left for prompts")
        if self.physical_block_size % self.hash_block_size:
            raise bad("hash_block_size", f"must divide physical_block_size ({self.physical_block_size})")
        if self.kda_checkpoint_interval % self.hash_block_size:
            raise bad("kda_checkpoint_interval", f"must be a multiple of hash_block_size ({self.hash_block_size})")
