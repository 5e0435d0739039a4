"""Model runner: owns the cache tensors and runs the forward passes a scheduler step asks for.

Tensors it owns (``L_mla`` MLA layers, ``L_kda`` KDA layers):

* MLA latent cache, one tensor per MLA layer: ``[(num_blocks + 1) * block_size, kv_lora_rank +
  qk_rope_head_dim]`` (576 wide for K3), token row = ``block_id * block_size + offset``.
* Block table ``[max_num_seqs + 1, max_blocks_per_seq]`` int32, one row per KDA state slot,
  resident on the device and written only where the scheduler's ``BlockTableUpdate``s say a
  row changed (admission, a new block).
* KDA state pool ``[L_kda, max_num_seqs + 1, ...]`` and checkpoint pool ``[L_kda,
  num_kda_checkpoints, ...]`` (``paged_views.KDAPool``). Slots and checkpoint ids come from the
  ``BlockManager`` through the scheduler's instructions.

With an EAGLE-3 draft (``feature_blocks`` set) every pass also returns the draft's inputs at
each position it computed (``StepResult.features``, ``verify_features``), CUDA graphs included.

The last block and the last slot are scratch: the padding rows of a CUDA-graph batch (and the
padded positions of a verify step) read and write only there.

One step (``execute``) runs up to three forward passes over the scheduled sequences:

* **decode group** (sequences computing one token): a ``[B, 1]`` batch whose inputs are one
  ``[3, B]`` host tensor (token ids, context lengths, state slots); slots of the new latents and
  the rows' block tables are read from the device table. KDA runs the single-token step, MLA the
  absorbed form with ``paged_mla_decode`` (reads only each row's blocks). On GPU the pass is a
  CUDA graph per batch bucket (the next power of two), whatever the context lengths.
* **verify group** (speculative decoding: the sequences of ``out.num_draft_tokens``, each its last
  token and its drafts): a fixed ``[B, K + 1]`` pass with logits at every position, a CUDA graph
  per batch bucket on GPU (``openk3/serve/verify.py``); it leaves the KDA states as they were
  until ``commit_verified`` writes those after the accepted positions.
* **prefill group** (prompt chunks; always eager): all chunks packed into one ``[1, sum T_i]``
  row with ``cu_seqlens``; KDA and its short convolutions run varlen, MLA the expanded form over
  every chunk's cached prefix with one varlen attention. Its inputs are one packed host tensor too.

Host -> device copies per step: one for the inputs of each group, and one for the instructions
of each side of the forward pass when there are any; never one per sequence, block or layer.

Images (``add_images``, ``docs/vision.md`` "Serving images"): the runner holds each request's
packed pixels on the host. The first prefill chunk that reaches one of a request's image
positions (``Sequence.image_spans``) runs the tower and projector, once, over the images of every
such request of the step (one packed call); the features stay on the device until the prefill is
past the request's last image, and each chunk splices the rows for its own positions into the
token embeddings, so a chunk may end inside an image. A one-token chunk at an image position
runs in the prefill group (decode passes and their CUDA graphs never see images). A prefix-cache
hit that covers the images skips the tower; a preempted request encodes them again.
"""

from __future__ import annotations

import ctypes
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from openk3.model.fuse import fuse_projections
from openk3.ops.fast import use_fast_path
from openk3.serve.config import EngineConfig
from openk3.serve.graphs import CapturedGraph, EagerPieces, Graphs, PiecewiseGraph, bucket, prefill_bucket
from openk3.serve.paged_views import DecodeBatch, KDAPool, PagedKDAView, PagedMLAView, PrefillBatch
from openk3.serve.scheduler import SchedulerOutput
from openk3.serve.sequence import Sequence
from openk3.serve.verify import VerifyStep
from openk3.vision.preprocess import PackedImages


MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)
PROMPT_LOGITS_ROWS = 1024  # prompt positions turned into log-probabilities at a time


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.2f} MiB"


def _num_blocks(config: EngineConfig, cfg, bytes_per_token: int) -> int:
    """Physical MLA blocks: ``config.num_blocks``, else room for ``max_num_seqs`` sequences of the
    context, capped by ``cache_memory_gb``. A ``max_model_len`` that is given but that the pool
    cannot hold once is an error naming the memory it needs, not a silent cap."""
    bs = config.physical_block_size
    per_block = bs * bytes_per_token
    max_len = config.max_model_len or cfg.max_position_embeddings
    needed = _cdiv(max_len + 1, bs)  # rows for every token and the first decode token's
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        budget = max(1, int(config.cache_memory_gb * 2**30 // per_block))
        num_blocks = min(config.max_num_seqs * needed, budget)
    if config.max_model_len is not None and num_blocks < needed:
        if config.num_blocks is not None:
            limit, fix = f"EngineConfig.num_blocks={num_blocks}", f"raise num_blocks to {needed}"
        else:
            limit = f"EngineConfig.cache_memory_gb={config.cache_memory_gb} ({num_blocks} blocks)"
            fix = f"raise cache_memory_gb to at least {math.ceil(needed * per_block / 2**28) / 4}"
        raise ValueError(
            f"EngineConfig.max_model_len={max_len}: one sequence needs {needed} MLA blocks of {bs} "
            f"tokens, {_size(needed * per_block)} of latent cache ({bytes_per_token} bytes per token), "
            f"but {limit} holds {num_blocks * bs - 1} tokens; {fix} or lower max_model_len")
    return num_blocks


def _check_device_memory(config: EngineConfig, num_bytes: int, device: torch.device) -> None:
    """An MLA cache larger than the GPU's free memory is refused with the fields that size it,
    rather than left to the allocator's out-of-memory error."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if num_bytes > free:
        raise ValueError(
            f"the MLA cache needs {_size(num_bytes)} but {device} has {_size(free)} free: lower "
            f"EngineConfig.cache_memory_gb={config.cache_memory_gb}, num_blocks={config.num_blocks}, "
            f"max_num_seqs={config.max_num_seqs} or max_model_len={config.max_model_len}")


@dataclass
class PromptLogprobs:
    """Log-probabilities of prompt tokens ``first ..`` (positions of the sequence):
    ``token [n]`` of the prompt's own tokens, ``top_ids`` / ``top_values [n, MAX_TOP_LOGPROBS]``
    the most likely alternatives."""

    first: int
    token: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor


@dataclass
class StepResult:
    """``logits [len(sampled), vocab]``, row i for ``sampled[i]``: the sequences of
    ``out.sampled``, decode rows first. ``verify_logits [len(verified), K + 1, vocab]`` (K =
    ``num_speculative_tokens``): row b for ``verified[b]`` (the speculating sequences, in
    ``out.scheduled`` order), positions ``0 .. k_b`` the logits after its last token and after
    each draft, the rest padding. ``prompt_logprobs`` by request id (one piece per step and
    request; a long prompt chunk is split and the pieces concatenated here).

    With ``ModelRunner.feature_blocks = (lo, mid)`` (an EAGLE-3 draft is attached):
    ``features [R, 3 * hidden_size]``, at every position the decode and prefill groups computed,
    ``cat(bank[lo], bank[mid], h)`` of the target (``KimiModel.hidden_and_blocks``), the input of
    the draft's fusion ``fc``; ``feature_spans`` the (sequence, first position, count) of its rows,
    in row order; ``verify_features [len(verified), K + 1, 3 * hidden_size]`` the same at every
    position of the verify group (the drafts that may be rejected included)."""

    logits: torch.Tensor
    sampled: list[Sequence] = field(default_factory=list)
    verified: list[Sequence] = field(default_factory=list)
    verify_logits: torch.Tensor | None = None
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    features: torch.Tensor | None = None
    feature_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)
    verify_features: torch.Tensor | None = None


@dataclass
class _RequestImages:
    """A request's images: ``pixels`` on the host and, once encoded, ``features`` [N, d] on the
    device (rows image after image, N = the request's image tokens)."""

    pixels: PackedImages
    features: torch.Tensor | None = None


def _in_prefill_group(seq: Sequence, n: int) -> bool:
    """Several tokens, or one at an image position (its embedding is an image feature)."""
    return n > 1 or bool(seq.image_keys(seq.num_computed_tokens - 1, seq.num_computed_tokens))


class _PaddedPrefill:
    """A prefill pass of ``Tb`` padded tokens (``ModelRunner._padded_prefill``): its static inputs
    (token ids [1, Tb], chunk offsets [max_num_seqs + 1], state slots [max_num_seqs]) and the one
    ``PrefillBatch`` its MLA attention parts read, updated in place before each run. Until the
    first run they describe one chunk of Tb tokens in the scratch slot and block (the capture's
    warm-up runs touch nothing else)."""

    def __init__(self, runner: ModelRunner, Tb: int):
        dev, Nmax, bs = runner.device, runner.config.max_num_seqs, runner.block_size
        self.runner = runner
        self.ids = torch.zeros(1, Tb, dtype=torch.long, device=dev)
        self.cu = torch.full((Nmax + 1,), Tb, dtype=torch.long, device=dev)
        self.cu[0] = 0
        self.slots = torch.full((Nmax,), runner.scratch_slot, dtype=torch.long, device=dev)
        scratch_rows = runner.scratch_block * bs + torch.arange(Tb, device=dev) % bs
        cu = torch.tensor([0, Tb])
        self.batch = PrefillBatch(scratch_rows, scratch_rows, cu.to(dev), cu.to(dev), cu, cu)

    def forward(self, pieces, ids: torch.Tensor, cu: torch.Tensor, slots: torch.Tensor):
        r = self.runner
        layers = [PagedMLAView(r.mla_cache[i], self.batch, pieces) if i in r.mla_cache else
                  PagedKDAView(r.kda_state, r.kda_index[i], slots, cu, None, static_varlen=True)
                  for i in range(r.cfg.num_hidden_layers)]
        return r.model.model.hidden_and_blocks(ids, _Views(layers))


class HostStaging:
    """Pinned host memory for the runner's host -> device copies, used as a ring.

    A copy from pinned memory is asynchronous, so its bytes must stay as they are until the GPU
    has read them: each upload takes the next region of the ring (back to its start when the
    rest is too short) and rewrites a region only after the event recorded behind the copies
    that read it (long passed: the ring holds several steps' uploads). Pinning per call instead
    (``torch.tensor(..., pin_memory=True)``, ``Tensor.pin_memory()``) left a 32K-token prefill's
    GPU idle 3-6 ms before its upload (docs/benchmarks.md, twenty-second session). Without CUDA
    the region is copied out (a CPU test of the same path)."""

    def __init__(self, device: torch.device, capacity: int):
        self.device, self.cuda = device, device.type == "cuda"
        self.buffer = torch.empty(capacity, dtype=torch.long, pin_memory=self.cuda)
        self.head = 0
        self.in_flight: list[tuple[int, int, torch.cuda.Event]] = []  # regions the GPU may still read

    def upload(self, host: array) -> torch.Tensor:
        """``host``'s int64s as a tensor on the device."""
        n = len(host)
        if not n:
            return torch.empty(0, dtype=torch.long, device=self.device)
        if 2 * n > len(self.buffer):  # a larger buffer, once the old one is read
            self._wait(0, len(self.buffer))
            self.buffer, self.head = torch.empty(4 * n, dtype=torch.long, pin_memory=self.cuda), 0
        if self.head + n > len(self.buffer):
            self.head = 0
        a, b = self.head, self.head + n
        self._wait(a, b)
        region = self.buffer[a:b]
        # one memcpy: Tensor.copy_ into pinned memory (and the pinning copies before) took 4 ms
        # of host time for 33K ids on the H200's host, the GPU idle meanwhile
        ctypes.memmove(region.data_ptr(), host.buffer_info()[0], n * host.itemsize)
        self.head = b
        if not self.cuda:
            return region.clone()
        out = region.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.in_flight.append((a, b, event))
        return out

    def _wait(self, a: int, b: int) -> None:
        """Until the GPU has read every region overlapping [a, b); forget the regions read."""
        pending = []
        for lo, hi, event in self.in_flight:
            if lo < b and a < hi:
                event.synchronize()
            elif not event.query():
                pending.append((lo, hi, event))
        self.in_flight = pending


class _Views:
    """What ``KimiModel.forward`` takes as ``cache``: one view per layer."""

    def __init__(self, layers: list):
        self.layers = layers


class ModelRunner:
    """Sizes the cache from ``config`` and the model: ``num_blocks`` MLA blocks and the
    ``max_model_len`` they leave (both resolved here, at run time, when the config says None)."""

    def __init__(self, model, config: EngineConfig):
        self.model, self.config = fuse_projections(model.eval().requires_grad_(False)), config
        cfg = self.cfg = model.cfg
        p = model.model.embed_tokens.weight
        self.device, self.dtype = p.device, p.dtype
        self.block_size = bs = config.physical_block_size
        self.mla_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_mla_layer(i)]
        self.kda_layers = [i for i in range(cfg.num_hidden_layers) if not cfg.is_mla_layer(i)]
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        # latent bytes per token: one row per MLA layer (small: 6 layers x 576 x 2 bytes in bf16)
        self.latent_bytes_per_token = max(1, len(self.mla_layers)) * width * p.element_size()
        self.num_blocks = num_blocks = _num_blocks(config, cfg, self.latent_bytes_per_token)
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, num_blocks * bs - 1)
        if self.max_model_len < 2:
            raise ValueError(f"the MLA cache ({num_blocks} blocks of {bs}) holds no request")
        _check_device_memory(config, (num_blocks + 1) * bs * self.latent_bytes_per_token, self.device)
        self.scratch_block, self.scratch_slot = num_blocks, config.max_num_seqs
        self.max_blocks_per_seq = _cdiv(self.max_model_len + 1, bs)
        self.mla_cache = {i: torch.zeros((num_blocks + 1) * bs, width, device=self.device,
                                         dtype=self.dtype) for i in self.mla_layers}
        # Entries no update has written point at the scratch block: the scratch slot's row
        # (padding rows) then reads and writes only there.
        self.block_tables = torch.full((config.max_num_seqs + 1, self.max_blocks_per_seq),
                                       self.scratch_block, device=self.device, dtype=torch.int32)
        self._block_offsets = torch.arange(bs, device=self.device)  # a row's offset in its block
        self.kda_index = {layer: k for k, layer in enumerate(self.kda_layers)}
        self.kda_state = KDAPool(cfg, len(self.kda_layers), config.max_num_seqs + 1, self.device, self.dtype)
        self.kda_checkpoints = KDAPool(cfg, len(self.kda_layers), config.num_kda_checkpoints,
                                       self.device, self.dtype)
        # graphs serve the fast paths: the references sync and gather whole block tables
        graphs = config.cuda_graphs and use_fast_path(p)
        self._graphs = Graphs(graphs, "decode")  # the decode pass, by batch bucket
        # prefill passes of up to ``prefill_graph_tokens`` tokens, by padded size: a pool of their
        # own (a step's prefill replays after its decode pass, whose logits are still to be read)
        self.prefill_graph_tokens = (config.max_num_batched_tokens if config.prefill_graph_tokens is None
                                     else config.prefill_graph_tokens)
        self.pad_prefill = graphs and self.prefill_graph_tokens > 0
        self._prefill_graphs = Graphs(graphs, "prefill")
        self._prefill_passes: dict[int, _PaddedPrefill] = {}
        # the verify pass has a memory pool of its own: it replays in the same step as a decode
        self.verifier = (VerifyStep(self, config.num_speculative_tokens, Graphs(graphs, "verify"))
                         if config.num_speculative_tokens else None)
        self._pin = self.device.type == "cuda"  # pinned host tensors copy asynchronously
        # what ``_upload`` copies from: a prefill pass's ids and offsets, several steps' worth
        self.staging = HostStaging(self.device, 4 * (config.max_num_batched_tokens + 8 * (config.max_num_seqs + 1)))
        # the AttnRes bank entries (lo, mid) whose values ``execute`` returns with h, set by the
        # engine when an EAGLE-3 draft reads them (``StepResult.features``); None: nothing extra
        self.feature_blocks: tuple[int, int] | None = None
        self.images: dict[str, _RequestImages] = {}  # by request id, from add_images
        self.num_images_encoded = 0  # images run through the tower (a prefix hit skips them)

    @property
    def use_graphs(self) -> bool:
        """Whether decode passes run as CUDA graphs (False: eagerly, as on a CPU)."""
        return self._graphs.enabled

    @use_graphs.setter
    def use_graphs(self, value: bool) -> None:
        self._graphs.enabled = value

    def cache_bytes(self) -> dict[str, int]:
        return {"mla": sum(t.numel() * t.element_size() for t in self.mla_cache.values()),
                "kda_state": self.kda_state.nbytes(), "kda_checkpoints": self.kda_checkpoints.nbytes()}

    def _upload(self, *parts: list[int] | array) -> list[torch.Tensor]:
        """One host -> device copy for several lists (or int64 ``array``s) of ints: int64 device
        tensors, one per part. The parts are packed into one ``array`` (a prompt's ids, an
        ``array`` already, by a copy of their bytes: ``torch.tensor`` of a 32K-int list took
        2.7 ms on this project's CPU, the ``array`` route 0.01) and copied through ``staging``."""
        host = array("q")
        for p in parts:
            host.extend(p)
        return list(self.staging.upload(host).split([len(p) for p in parts]))

    def host_tensor(self, *rows: list[int]) -> torch.Tensor:
        """Equal-length lists of ints as one int64 host tensor [len(rows), n], pinned on GPU so
        that its copy to the device does not wait for the device."""
        return torch.tensor(rows, dtype=torch.long, pin_memory=self._pin)

    # Images.

    def add_images(self, request_id: str, images: PackedImages) -> None:
        """Hold the images of ``request_id`` (whose sequence's ``image_spans`` say where each
        goes) until ``drop_images``."""
        self.images[request_id] = _RequestImages(images)

    def drop_images(self, request_id: str) -> None:
        """The request finished or was aborted (unknown ids are ignored)."""
        self.images.pop(request_id, None)

    def _encode_images(self, request_ids: list[str]) -> None:
        """Tower + projector over the images of ``request_ids``, in one packed call."""
        entries = [self.images[r] for r in request_ids]
        packed = PackedImages.cat([e.pixels for e in entries]).to(self.device)
        features = self.model.encode_images(packed)  # [sum of image tokens, d]
        vcfg = self.cfg.vision_config
        for e, f in zip(entries, features.split([sum(e.pixels.tokens_per_image(vcfg)) for e in entries])):
            e.features = f
        self.num_images_encoded += len(packed.grid_hws)

    def _image_rows(self, chunks: list[tuple[Sequence, int]]) -> tuple[list[int], torch.Tensor | None]:
        """The rows of a packed prefill pass over ``chunks`` that hold image positions, and their
        features [len(rows), d] (None without any), encoding the images not at hand yet."""
        rows, pieces, T = [], [], 0
        for seq, n in chunks:
            start, first = seq.num_computed_tokens - n, 0  # first: the span's row in the features
            for span in seq.image_spans:
                lo, hi = max(start, span.offset), min(start + n, span.offset + span.length)
                if lo < hi:
                    rows += range(T + lo - start, T + hi - start)
                    pieces.append((seq.request_id, first + lo - span.offset, hi - lo))
                first += span.length
            T += n
        if not pieces:
            return [], None
        missing = [r for r in dict.fromkeys(r for r, _, _ in pieces) if self.images[r].features is None]
        if missing:
            self._encode_images(missing)
        return rows, torch.cat([self.images[r].features[a:a + m] for r, a, m in pieces])

    def _release_image_features(self, chunks: list[tuple[Sequence, int]]) -> None:
        """Free the features of requests whose prefill is past their last image."""
        for seq, _ in chunks:
            last = seq.image_spans[-1] if seq.image_spans else None
            if last is not None and seq.num_computed_tokens >= last.offset + last.length:
                self.images[seq.request_id].features = None

    # Cache instructions from the scheduler.

    def _before_forward(self, out: SchedulerOutput) -> None:
        """Block table updates, block copies (copy-on-write), KDA restores and resets."""
        bs = self.block_size
        for c in out.block_copies:  # every MLA layer's rows in one call (one launch, not one a layer)
            torch._foreach_copy_([t[c.dst * bs: c.dst * bs + c.num_tokens] for t in self.mla_cache.values()],
                                 [t[c.src * bs: c.src * bs + c.num_tokens] for t in self.mla_cache.values()])
        if not (out.block_table_updates or out.kda_restores or out.kda_resets):
            return
        rows, cols, block_ids = self._table_entries(out)
        rows, cols, block_ids, restore_src, restore_dst, resets = self._upload(
            rows, cols, block_ids, [r.checkpoint_id for r in out.kda_restores],
            [r.dst_state_slot for r in out.kda_restores], out.kda_resets)
        if out.block_table_updates:
            self.block_tables[rows, cols] = block_ids.to(torch.int32)
        if out.kda_restores:
            self.kda_state.copy_(restore_dst, self.kda_checkpoints, restore_src)
        if out.kda_resets:
            self.kda_state.zero_(resets)

    @staticmethod
    def _table_entries(out: SchedulerOutput) -> tuple[list[int], list[int], list[int]]:
        """(rows, columns, block ids) of the step's block-table updates."""
        rows, cols, block_ids = [], [], []
        for u in out.block_table_updates:
            rows += [u.state_slot] * len(u.block_ids)
            cols += range(u.start, u.start + len(u.block_ids))
            block_ids += u.block_ids
        return rows, cols, block_ids

    def update_block_tables(self, out: SchedulerOutput) -> None:
        """Write the step's block-table updates now, ahead of ``execute`` (which writes them again):
        for the EAGLE-3 drafter, whose proposals write latents in the blocks the step appends."""
        if out.block_table_updates:
            rows, cols, block_ids = self._upload(*self._table_entries(out))
            self.block_tables[rows, cols] = block_ids.to(torch.int32)

    def commit_verified(self, num_kept: list[int] | torch.Tensor) -> None:
        """After speculative sampling: ``StepResult.verified[i]`` of the last ``execute`` keeps
        its first ``num_kept[i]`` verified positions (its last token and its accepted drafts, 1 ..
        k + 1; a list, or an int64 tensor on the device); its KDA states become those after them
        (``VerifyStep.commit``)."""
        self.verifier.commit(num_kept)

    def _after_forward(self, out: SchedulerOutput) -> None:
        """KDA saves: the state slots now hold the states at the checkpoint boundaries."""
        if out.kda_saves:
            slots, checkpoint_ids = self._upload([s.state_slot for s in out.kda_saves],
                                                 [s.checkpoint_id for s in out.kda_saves])
            self.kda_checkpoints.copy_(checkpoint_ids, self.kda_state, slots)

    # Forward passes.

    @staticmethod
    def _groups(out: SchedulerOutput) -> tuple[list[Sequence], list[Sequence], list[tuple[Sequence, int]]]:
        """The step's decode rows (the sampled ones first), speculating sequences and prefill chunks."""
        verify = [s for s, _ in out.scheduled if s.request_id in out.num_draft_tokens]
        rest = [(s, n) for s, n in out.scheduled if s.request_id not in out.num_draft_tokens]
        # sampled decode rows first: their logits are then a prefix of the decode pass's
        decode = sorted((s for s, n in rest if not _in_prefill_group(s, n)),
                        key=lambda s: s.num_computed_tokens < s.num_tokens)
        return decode, verify, [(s, n) for s, n in rest if _in_prefill_group(s, n)]

    def execute(self, out: SchedulerOutput, draft_tokens: torch.Tensor | None = None) -> StepResult:
        """Run the step: logits of ``out.sampled``, the verify logits of the speculating sequences
        (``out.num_draft_tokens``, whose drafts are ``draft_tokens`` [len(verified), K] on the
        device, as ``DraftProposer.propose`` returns them) and the prompt log-probabilities of this
        step's tokens of every sequence that wants them (``Sequence.wants_prompt_logprobs``)."""
        self._before_forward(out)
        decode, verify, prefill = self._groups(out)
        result = StepResult(torch.empty(0, self.cfg.vocab_size, device=self.device))
        logits, features = [], []
        if decode:
            rows, feats = self._decode(decode)
            if feats is not None:
                features.append(feats)
                result.feature_spans += [(s, s.num_computed_tokens - 1, 1) for s in decode]
            n = sum(s.num_computed_tokens == s.num_tokens for s in decode)
            logits.append(rows[:n])
            result.sampled += decode[:n]
            for j, s in enumerate(decode):
                if s.wants_prompt_logprobs:
                    self._add_prompt_logprobs(result, s, s.num_computed_tokens - 1, rows[j:j + 1])
        if verify:
            if draft_tokens is None:
                raise ValueError("execute: sequences speculate this step (out.num_draft_tokens) but no "
                                 "draft_tokens were given")
            hidden, result.verify_features = self.verifier.forward(
                verify, [out.num_draft_tokens[s.request_id] for s in verify], draft_tokens)
            result.verified, result.verify_logits = verify, self.model.lm_head(hidden).float()
        if prefill:
            sampled, rows, feats = self._prefill(prefill, result)
            logits.append(rows)
            result.sampled += sampled
            if feats is not None:
                features.append(feats)
                result.feature_spans += [(s, s.num_computed_tokens - n, n) for s, n in prefill]
        self._after_forward(out)
        if features:
            result.features = features[0] if len(features) == 1 else torch.cat(features)
        if len(logits) == 1:
            result.logits = logits[0]
        elif logits:
            result.logits = torch.cat(logits)
        return result

    def advance(self, out: SchedulerOutput) -> None:
        """Run the step's decode rows and prefill chunks through the caches, without logits; the
        speculating sequences are left out (a draft model keeping up with the target: ``Drafter``)."""
        decode, _, prefill = self._groups(out)
        if decode:
            self._decode(decode)
        if prefill:
            self._forward_segments([(s.state_slot, s.num_computed_tokens - n,
                                     s.ids_array(s.num_computed_tokens - n, s.num_computed_tokens))
                                    for s, n in prefill], [])

    @staticmethod
    def _add_prompt_logprobs(result: StepResult, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """Log-probabilities of prompt tokens ``start + 1 ..`` from the logits of positions
        ``start ..`` (rows of ``logits``), up to the last prompt token."""
        n = min(logits.shape[0], seq.num_prompt_tokens - 1 - start)
        if n <= 0:
            return
        targets = torch.tensor(seq.token_ids[start + 1:start + 1 + n], device=logits.device)
        logp = torch.log_softmax(logits[:n].float(), dim=-1)
        top = logp.topk(min(MAX_TOP_LOGPROBS, logp.shape[-1]), dim=-1)
        piece = PromptLogprobs(start + 1, logp.gather(-1, targets[:, None])[:, 0], top.indices, top.values)
        before = result.prompt_logprobs.get(seq.request_id)
        if before is not None:  # the next piece of the same chunk
            piece = PromptLogprobs(before.first, *(torch.cat([a, b]) for a, b in zip(
                (before.token, before.top_ids, before.top_values), (piece.token, piece.top_ids, piece.top_values))))
        result.prompt_logprobs[seq.request_id] = piece

    def _prefill(self, chunks: list[tuple[Sequence, int]],
                 result: StepResult) -> tuple[list[Sequence], torch.Tensor, torch.Tensor | None]:
        """Returns the sequences whose prompt this step completes, their logits [n, V] and the
        draft features of every row (``_features``; None without ``feature_blocks``)."""
        segments, last_rows, sampled, T = [], [], [], 0
        for seq, n in chunks:
            end = seq.num_computed_tokens  # already advanced by the scheduler
            segments.append((seq.state_slot, end - n, seq.ids_array(end - n, end)))
            if end == seq.num_tokens:
                last_rows.append(T + n - 1)
                sampled.append(seq)
            T += n
        image_rows, image_features = self._image_rows(chunks)
        hidden, rows, cu_q, bank = self._forward_segments(segments, last_rows, image_rows, image_features)
        self._release_image_features(chunks)
        feats = self._features(hidden, bank)
        for (seq, n), a, b in zip(chunks, cu_q[:-1], cu_q[1:]):
            if seq.wants_prompt_logprobs:  # in pieces: [rows, vocab] fp32 logits are large
                start = seq.num_computed_tokens - n
                for lo in range(a, b, PROMPT_LOGITS_ROWS):
                    hi = min(b, lo + PROMPT_LOGITS_ROWS)
                    self._add_prompt_logprobs(result, seq, start + lo - a, self.model.lm_head(hidden[lo:hi]))
        if not len(rows):
            return [], hidden.new_empty(0, self.cfg.vocab_size), feats
        return sampled, self.model.lm_head(hidden[rows]).float(), feats

    def _features(self, hidden: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor | None:
        """``cat(bank[lo], bank[mid], h)`` [R, 3 * d] of a pass's R positions (the EAGLE-3 draft's
        fusion input), or None without ``feature_blocks``. hidden [R, d] or [R, 1, d]; the bank
        entries [1, R, d] (packed pass) or [R, 1, d] (decode batch)."""
        if self.feature_blocks is None:
            return None
        lo, mid = self.feature_blocks
        d = hidden.shape[-1]
        return torch.cat([bank[lo].reshape(-1, d), bank[mid].reshape(-1, d), hidden.reshape(-1, d)], dim=-1)

    def _forward_segments(self, segments: list[tuple[int, int, array]], rows: list[int],
                          image_rows: list[int] = (), image_features: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[torch.Tensor]]:
        """One packed forward over segments (state slot, position of the first token, token
        ids), each continuing its slot's cache; ``image_features`` [len(image_rows), d] replace
        the token embeddings at ``image_rows`` (indices into the packed tokens). Returns the
        hidden states [sum T_i, D], ``rows`` (indices into them) uploaded with the inputs, the
        segments' offsets ``cu_q`` and the AttnRes bank of the pass (``_forward``)."""
        ids, cu_q, cu_k, starts, slots = array("q"), [0], [0], [], []
        for slot, start, token_ids in segments:
            ids.extend(token_ids)
            cu_q.append(cu_q[-1] + len(token_ids))
            cu_k.append(cu_k[-1] + start + len(token_ids))  # the segment attends over its whole prefix
            starts.append(start)
            slots.append(slot)
        if self.pad_prefill and image_features is None and cu_q[-1] <= self.prefill_graph_tokens:
            return self._padded_prefill(ids, cu_q, cu_k, starts, slots, rows)
        one = slots[0] if len(slots) == 1 else None
        ids, cu_q_dev, cu_k_dev, starts, slots, rows, image_rows = self._upload(
            ids, cu_q, cu_k, starts, slots, rows, list(image_rows))
        batch = self._prefill_batch(cu_q_dev, cu_k_dev, starts, slots, torch.tensor(cu_q), torch.tensor(cu_k), one)
        embeds = None
        if image_features is not None:
            embeds = self.model.model.embed_tokens(ids[None])  # [1, T, d]
            embeds[0, image_rows] = image_features.to(embeds.dtype)
        hidden, bank = self._forward(ids[None], batch, slots, batch.cu_seqlens_q, batch.cu_seqlens_q_cpu, embeds)
        return hidden[0], rows, cu_q, bank

    def _padded_prefill(self, ids: array, cu_q: list[int], cu_k: list[int], starts: list[int],
                        slots: list[int], rows: list[int],
                        ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[torch.Tensor]]:
        """``_forward_segments`` as a piecewise CUDA graph (``pad_prefill``): the T tokens padded to
        the bucket of their count, the N chunks to ``max_num_seqs`` with empty ones in the scratch
        slot (fla's graph mode), the padding's latents written to the scratch block; the MLA
        attention runs eagerly between the pieces on this step's ``PrefillBatch``. Without CUDA
        graphs (a CPU test) the same padded pass runs eagerly."""
        T, N = cu_q[-1], len(slots)
        Tb, Nmax = prefill_bucket(T), self.config.max_num_seqs
        one = slots[0] if N == 1 else None
        ids_pad, cu_pad, slots_pad, cu_q_dev, cu_k_dev, starts, slots, rows = self._upload(
            ids + array("q", bytes(8 * (Tb - T))), cu_q + [T] * (Nmax - N), slots + [self.scratch_slot] * (Nmax - N),
            cu_q, cu_k, starts, slots, rows)
        pass_ = self._prefill_pass(Tb)

        def attention_batch() -> None:
            """What the eager attention parts read (nothing captured does): computed once the first
            graph piece runs, so that its host time overlaps the GPU's work."""
            batch = self._prefill_batch(cu_q_dev, cu_k_dev, starts, slots, torch.tensor(cu_q), torch.tensor(cu_k),
                                        one)
            batch.slot_mapping = torch.nn.functional.pad(batch.slot_mapping, (0, Tb - T),
                                                         value=self.scratch_block * self.block_size)
            vars(pass_.batch).update(vars(batch))

        graph = self._prefill_graph(Tb)
        if graph is None:
            if self.device.type == "cuda":  # the capture failed (a warning said why): padding
                self.pad_prefill = False      # no longer buys anything
            attention_batch()
            hidden, bank = pass_.forward(EagerPieces(), ids_pad[None], cu_pad, slots_pad)
        else:
            hidden, bank = graph.run(ids_pad[None], cu_pad, slots_pad, before_eager=attention_batch)
        return hidden[0, :T], rows, cu_q, [b[:, :T] for b in bank]

    def _prefill_pass(self, Tb: int) -> _PaddedPrefill:
        pass_ = self._prefill_passes.get(Tb)
        if pass_ is None:
            pass_ = self._prefill_passes[Tb] = _PaddedPrefill(self, Tb)
        return pass_

    def _prefill_graph(self, Tb: int) -> PiecewiseGraph | None:
        """The padded prefill pass of ``Tb`` tokens as a piecewise graph, captured on first use
        (None: graphs are off, or a capture failed)."""
        pass_ = self._prefill_pass(Tb)
        # the capture's runs read the pass's first batch (one chunk in the scratch slot and block)
        return self._prefill_graphs.get_or_capture(Tb, lambda pool: PiecewiseGraph(
            pass_.forward, [pass_.ids, pass_.cu, pass_.slots], pool))

    def graph_sizes(self) -> tuple[list[int], list[int]]:
        """The decode batch buckets and padded prefill sizes this runner captures graphs for (both
        empty without CUDA graphs)."""
        if not self.use_graphs:
            return [], []
        decode = [1 << i for i in range(bucket(self.config.max_num_seqs).bit_length())]
        prefill = sorted({prefill_bucket(n) for n in range(1, self.prefill_graph_tokens + 1)}) if self.pad_prefill else []
        return decode, prefill

    def capture_graphs(self, progress: Callable[[str, int], None] | None = None) -> None:
        """Capture every decode and prefill graph now instead of on first use (``graph_sizes``), so
        that no request waits for a capture (each costs a few of its passes and, for a prefill
        size, its warm-up's autotuning) and the graphs' memory is taken before serving starts;
        with speculative decoding the verify pass's graphs of every decode bucket too.
        ``progress(kind, size)`` is called before each capture."""
        decode, prefill = self.graph_sizes()
        for B in decode:
            if progress is not None:
                progress("decode", B)
            self._decode_graph(B)
            if self.verifier is not None:
                if progress is not None:
                    progress("verify", B)
                self.verifier.graph(B)
        for Tb in prefill:
            if progress is not None:
                progress("prefill", Tb)
            self._prefill_graph(Tb)

    def _prefill_batch(self, cu_q: torch.Tensor, cu_k: torch.Tensor, starts: torch.Tensor,
                       slots: torch.Tensor, cu_q_cpu: torch.Tensor, cu_k_cpu: torch.Tensor,
                       slot: int | None = None) -> PrefillBatch:
        """Cache rows of the new tokens and of every chunk's keys, from the device block table.

        cu_q, cu_k [N+1]: offsets of the chunks' tokens and of their prefixes (past + chunk);
        starts [N]: position of each chunk's first token; slots [N]: state slots (table rows);
        ``slot``: the one chunk's state slot on the host, when N is 1."""
        bs, dev = self.block_size, self.device
        if slot is not None:
            # One chunk (a long prompt's, a warm request's): its keys are positions 0 .. K-1 of
            # its slot's blocks, its queries the last T of them. Three launches where the general
            # path takes ~25 (0.74 ms of host time before a warm request's first attention part)
            T, K = int(cu_q_cpu[-1]), int(cu_k_cpu[-1])
            table = self.block_tables[slot, :_cdiv(K, bs)]
            key_rows = (table[:, None].long() * bs + self._block_offsets).flatten()[:K]
            return PrefillBatch(key_rows[K - T:], key_rows, cu_q, cu_k, cu_q_cpu, cu_k_cpu)
        chunk = torch.arange(len(cu_q_cpu) - 1, device=dev)
        table = self.block_tables.index_select(0, slots).long()  # [N, max_blocks]
        T, K = int(cu_q_cpu[-1]), int(cu_k_cpu[-1])
        q_chunk = torch.repeat_interleave(chunk, cu_q.diff(), output_size=T)  # chunk of each token
        q_pos = starts[q_chunk] + torch.arange(T, device=dev) - cu_q[q_chunk]  # its position
        k_chunk = torch.repeat_interleave(chunk, cu_k.diff(), output_size=K)
        k_pos = torch.arange(K, device=dev) - cu_k[k_chunk]
        return PrefillBatch(table[q_chunk, q_pos // bs] * bs + q_pos % bs,
                            table[k_chunk, k_pos // bs] * bs + k_pos % bs,
                            cu_q, cu_k, cu_q_cpu, cu_k_cpu)

    def _decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [len(seqs), V] of a decode batch (padded to its bucket under CUDA graphs) and its
        draft features (``_features``)."""
        n = len(seqs)
        B = bucket(n) if self.use_graphs else n
        pad = B - n
        inputs = self.host_tensor([s.token_ids[s.num_computed_tokens - 1] for s in seqs] + [0] * pad,
                                  [s.num_computed_tokens for s in seqs] + [1] * pad,  # padding: one token
                                  [s.state_slot for s in seqs] + [self.scratch_slot] * pad)  # in the scratch block
        logits, features = self.decode_rows(inputs, max(s.num_computed_tokens for s in seqs))
        return logits[:n], None if features is None else features[:n]

    def decode_ahead(self, seqs: list[Sequence], tokens: torch.Tensor) -> torch.Tensor:
        """Logits [len(seqs), V] of the decode step after this one, launched before this step's
        tokens reach the host (``LLMEngine``'s overlapped decoding): ``tokens`` [len(seqs)], on
        the device, are each sequence's next token, fed at position ``len(seq.token_ids)`` (it is
        not appended yet); the states and caches advance as ``execute``'s decode step would.
        The caller has checked that the step needs no instruction (new block, checkpoint save).
        Under CUDA graphs the logits are the graph's static output (the next decode overwrites)."""
        n = len(seqs)
        B = bucket(n) if self.use_graphs else n
        pad = B - n
        inputs = self.host_tensor([0] * B, [len(s.token_ids) + 1 for s in seqs] + [1] * pad,
                                  [s.state_slot for s in seqs] + [self.scratch_slot] * pad)
        inputs = inputs.to(self.device, non_blocking=True)
        inputs[0, :n] = tokens
        logits, _ = self.decode_rows(inputs, max(len(s.token_ids) + 1 for s in seqs))
        return logits[:n]

    def decode_rows(self, inputs: torch.Tensor, max_context: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode pass: inputs [3, B] (token ids, context lengths with the new token, state
        slots; padding rows: 0, 1, ``scratch_slot``), on the host (pinned) or the device, B a
        bucket while graphs are on; ``max_context`` the largest context length (the eager
        reference attention reads that many positions). Returns logits [B, V] and the draft
        features [B, 3d] (None without ``feature_blocks``); under a CUDA graph both are static
        tensors that the next decode pass overwrites."""
        graph = self._decode_graph(inputs.shape[1])
        if graph is not None:
            return graph.run(inputs)
        return self._decode_forward(inputs.to(self.device, non_blocking=True), _cdiv(max_context, self.block_size))

    def _decode_graph(self, B: int) -> CapturedGraph | None:
        """The decode pass of a batch bucket ``B`` as a CUDA graph, captured on first use (None:
        graphs are off, or a capture failed)."""
        return self._graphs.get_or_capture(B, lambda pool: CapturedGraph(
            lambda x: self._decode_forward(x, self.max_blocks_per_seq),
            [self.host_tensor([0] * B, [1] * B, [self.scratch_slot] * B).to(self.device)], pool))

    def _decode_forward(self, inputs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """inputs [3, B] on the device: token ids, context lengths (the new token included), state
        slots; ``width`` block-table columns are handed to the attention. Returns logits [B, V]
        and the draft features (``_features``)."""
        hidden, bank = self._decode_hidden(inputs, width)
        return self.model.lm_head(hidden).float(), self._features(hidden, bank)

    def _decode_hidden(self, inputs: torch.Tensor, width: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``_decode_forward``'s final hidden states [B, d] and AttnRes bank (each [B, 1, d])."""
        ids, context_lens, slots = inputs
        bs = self.block_size
        table = self.block_tables[slots, :width]  # [B, width] int32
        pos = context_lens - 1
        new_rows = table.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs
        batch = DecodeBatch(new_rows, table, context_lens, bs)
        hidden, bank = self._forward(ids[:, None], batch, slots, None, None)
        return hidden[:, 0], bank

    def _forward(self, ids, batch: DecodeBatch | PrefillBatch, state_slots: torch.Tensor,
                 cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
                 inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final hidden states [B, T, d] and the AttnRes bank (``hidden_and_blocks``: it exists
        during the pass anyway). cu_seqlens: the chunks' offsets (on the device and the host) for
        a packed prefill; ``inputs_embeds`` [B, T, d]: the embeddings, images spliced in (None:
        the model embeds ``ids``)."""
        layers = [PagedMLAView(self.mla_cache[i], batch) if i in self.mla_cache else
                  PagedKDAView(self.kda_state, self.kda_index[i], state_slots, cu_seqlens, cu_seqlens_cpu)
                  for i in range(self.cfg.num_hidden_layers)]
        return self.model.model.hidden_and_blocks(ids, _Views(layers), inputs_embeds)
