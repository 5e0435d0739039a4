"""Model runner: owns the cache tensors and runs the forward passes a scheduler step asks for.

Tensors it owns (``L_mla`` MLA layers, ``L_kda`` KDA layers):

* MLA latent cache, one tensor per MLA layer: ``[num_blocks * block_size, kv_lora_rank +
  qk_rope_head_dim]`` (576 wide for K3), token row = ``block_id * block_size + offset``.
* KDA state pool, per KDA layer: recurrent ``[slots, H, K, V]`` fp32 and the three conv states
  ``[slots, H*K, W-1]``; the checkpoint pool has the same layout with ``num_kda_checkpoints``
  entries. Slots and checkpoint ids come from the ``BlockManager``.

One step (``execute``) runs up to two forward passes over the scheduled sequences:

* **decode group** (sequences computing one token): a ``[B, 1]`` batch; KDA through the
  single-token step (fla's ``fused_recurrent_kda`` on GPU), MLA through the absorbed form over
  each row's latents gathered from the paged cache (padded to a common length, masked). On GPU
  this pass is captured once per (batch bucket, context bucket) as a CUDA graph and replayed.
* **prefill group** (prompt chunks): all chunks packed into one ``[1, sum T_i]`` row with
  ``cu_seqlens``; KDA and its short convolutions run varlen (fla's ``chunk_kda`` kernel on GPU),
  MLA runs the expanded form per chunk over that sequence's cached prefix plus the chunk.

Layers see this through view objects (``PagedKDAView``, ``PagedMLAView``) that look like the
generate path's ``KDAState`` / ``MLAState``: the model code is the same for both paths.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from openk3.model.fuse import fuse_projections
from openk3.serve.block_manager import BlockManager
from openk3.serve.config import EngineConfig
from openk3.serve.scheduler import SchedulerOutput
from openk3.serve.sequence import Sequence


MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)
PROMPT_LOGITS_ROWS = 1024  # prompt positions turned into log-probabilities at a time


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    """``logits [len(out.sampled), vocab]`` in ``out.sampled`` order; ``prompt_logprobs`` by
    request id (one piece per step and request; a long prompt chunk is split and the pieces
    concatenated here)."""

    logits: torch.Tensor
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


class KDAPool:
    """Per-KDA-layer state tensors for ``n`` entries (state slots or checkpoints)."""

    FIELDS = ("recurrent", "conv_q", "conv_k", "conv_v")

    def __init__(self, cfg, n: int, device, dtype):
        H, K, W = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_size
        self.recurrent = torch.zeros(n, H, K, K, device=device, dtype=torch.float32)
        self.conv_q, self.conv_k, self.conv_v = (
            torch.zeros(n, H * K, W - 1, device=device, dtype=dtype) for _ in range(3))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f) for f in self.FIELDS]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class PagedKDAView:
    """A KDA layer's view of the state slots of this batch's sequences. Reading an attribute
    gathers the rows, assigning scatters them back into the pool."""

    def __init__(self, pool: KDAPool, slots: torch.Tensor, cu_seqlens: torch.Tensor | None,
                 cu_seqlens_cpu: torch.Tensor | None):
        self._pool, self._slots = pool, slots
        self.cu_seqlens, self.cu_seqlens_cpu = cu_seqlens, cu_seqlens_cpu

    def __getattr__(self, name):
        if name in KDAPool.FIELDS:
            return getattr(self._pool, name).index_select(0, self._slots)
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name in KDAPool.FIELDS:
            t = getattr(self._pool, name)
            t.index_copy_(0, self._slots, value.to(t.dtype))
        else:
            super().__setattr__(name, value)


@dataclass
class MLABatch:
    """Where this batch's latents go and which cached rows each sequence attends over.

    slot_mapping [T_total]: cache row of every new token. Decode: ``context_slots`` [B, L] and
    ``context_mask`` [B, L]. Prefill: per chunk, ``segments`` (start, end, past) in the packed
    row and ``segment_slots`` (cache rows of the whole prefix, past + chunk)."""

    slot_mapping: torch.Tensor
    context_slots: torch.Tensor | None = None
    context_mask: torch.Tensor | None = None
    segments: list[tuple[int, int, int]] | None = None
    segment_slots: list[torch.Tensor] | None = None


class PagedMLAView:
    def __init__(self, cache: torch.Tensor, rank: int, batch: MLABatch):
        self.cache, self.rank, self.batch = cache, rank, batch

    def attend(self, layer, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        b, r = self.batch, self.rank
        rows = torch.cat([latent, k_rope], dim=-1).flatten(0, 1).to(self.cache.dtype)
        self.cache.index_copy_(0, b.slot_mapping, rows)
        if b.context_slots is not None:  # decode: one token per row, absorbed form
            ctx = self.cache[b.context_slots]  # [B, L, r + rope]
            return layer.attend_absorbed(q, ctx[..., :r], ctx[..., r:], b.context_mask)
        outs = []
        for (start, end, past), slots in zip(b.segments, b.segment_slots):
            ctx = self.cache[slots][None]  # [1, past + chunk, r + rope]
            outs.append(layer.attend_expanded(q[:, start:end], ctx[..., :r], ctx[..., r:], past))
        return torch.cat(outs, dim=1)


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
        max_len = config.max_model_len or cfg.max_position_embeddings
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            per_block = max(1, len(self.mla_layers)) * bs * width * p.element_size()
            budget = max(1, int(config.cache_memory_gb * 2**30 // per_block))
            num_blocks = min(config.max_num_seqs * _cdiv(max_len + 1, bs), budget)
        self.num_blocks = num_blocks
        self.max_model_len = min(max_len, num_blocks * bs - 1)
        if self.max_model_len < 2:
            raise ValueError(f"the MLA cache ({num_blocks} blocks of {bs}) holds no request")
        # One scratch block and one scratch state slot past the real ones: the padding rows of a
        # CUDA-graph decode batch write there, never into a live sequence's cache.
        self.scratch_block, self.scratch_slot = num_blocks, config.max_num_seqs
        self.mla_cache = {i: torch.zeros((num_blocks + 1) * bs, width, device=self.device,
                                         dtype=self.dtype) for i in self.mla_layers}
        self.kda_state = {i: KDAPool(cfg, config.max_num_seqs + 1, self.device, self.dtype)
                          for i in self.kda_layers}
        self.kda_checkpoints = {i: KDAPool(cfg, config.num_kda_checkpoints, self.device, self.dtype)
                                for i in self.kda_layers}
        self.use_graphs = config.cuda_graphs and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}

    def cache_bytes(self) -> dict[str, int]:
        return {"mla": sum(t.numel() * t.element_size() for t in self.mla_cache.values()),
                "kda_state": sum(p.nbytes() for p in self.kda_state.values()),
                "kda_checkpoints": sum(p.nbytes() for p in self.kda_checkpoints.values())}

    # Cache instructions from the block manager.

    def _apply_cache_ops(self, out: SchedulerOutput) -> None:
        bs = self.block_size
        for c in out.block_copies:
            for t in self.mla_cache.values():
                t[c.dst * bs: c.dst * bs + c.num_tokens] = t[c.src * bs: c.src * bs + c.num_tokens]
        for r in out.kda_restores:
            for i in self.kda_layers:
                for dst, src in zip(self.kda_state[i].tensors(), self.kda_checkpoints[i].tensors()):
                    dst[r.dst_state_slot] = src[r.checkpoint_id]
        for slot in out.kda_resets:
            for i in self.kda_layers:
                for t in self.kda_state[i].tensors():
                    t[slot] = 0

    def _save_checkpoints(self, out: SchedulerOutput, bm: BlockManager) -> None:
        for seq, num_tokens in out.kda_checkpoints:
            cid = bm.register_kda_checkpoint(seq, num_tokens)
            if cid is None:
                continue
            for i in self.kda_layers:
                for dst, src in zip(self.kda_checkpoints[i].tensors(), self.kda_state[i].tensors()):
                    dst[cid] = src[seq.state_slot]

    # Index helpers: cache rows from block tables, on the device.

    def _rows(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        table = torch.tensor(block_table, device=self.device, dtype=torch.long)
        pos = torch.arange(start, end, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    # Forward passes.

    def execute(self, out: SchedulerOutput, bm: BlockManager) -> StepResult:
        """Run the step: logits of ``out.sampled`` and the prompt log-probabilities of this step's
        tokens of every sequence that wants them (``Sequence.wants_prompt_logprobs``)."""
        self._apply_cache_ops(out)
        decode = [(s, n) for s, n in out.scheduled if n == 1]
        prefill = [(s, n) for s, n in out.scheduled if n > 1]
        logits: dict[str, torch.Tensor] = {}
        result = StepResult(torch.empty(0, self.cfg.vocab_size, device=self.device))
        if decode:
            seqs = [s for s, _ in decode]
            rows = self._decode(seqs)
            logits.update((s.request_id, rows[j]) for j, s in enumerate(seqs)
                          if s.num_computed_tokens == s.num_tokens)
            for j, s in enumerate(seqs):
                if s.wants_prompt_logprobs:
                    self._add_prompt_logprobs(result, s, s.num_computed_tokens - 1, rows[j:j + 1])
        if prefill:
            logits.update(self._prefill(prefill, result))
        self._save_checkpoints(out, bm)
        if out.sampled:
            result.logits = torch.stack([logits[s.request_id] for s in out.sampled])
        return result

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

    def _prefill(self, chunks: list[tuple[Sequence, int]], result: StepResult) -> dict[str, torch.Tensor]:
        ids, slots, segments, segment_slots, cu, last = [], [], [], [], [0], {}
        for seq, n in chunks:
            end = seq.num_computed_tokens  # already advanced by the scheduler
            start = end - n
            ids.extend(seq.token_ids[start:end])
            prefix = self._rows(seq.block_table, 0, end)
            slots.append(prefix[start:])
            segments.append((cu[-1], cu[-1] + n, start))
            segment_slots.append(prefix)
            cu.append(cu[-1] + n)
            if end == seq.num_tokens:
                last[seq.request_id] = cu[-1] - 1
        dev = self.device
        cu_cpu = torch.tensor(cu, dtype=torch.long)
        cu_seqlens = cu_cpu.to(dev)
        state_slots = torch.tensor([s.state_slot for s, _ in chunks], device=dev, dtype=torch.long)
        batch = MLABatch(torch.cat(slots), segments=segments, segment_slots=segment_slots)
        hidden = self._forward(torch.tensor([ids], device=dev), batch, state_slots, (cu_seqlens, cu_cpu))
        for (seq, n), (a, b, start) in zip(chunks, segments):
            if seq.wants_prompt_logprobs:  # in pieces: [rows, vocab] fp32 logits are large
                for lo in range(a, b, PROMPT_LOGITS_ROWS):
                    hi = min(b, lo + PROMPT_LOGITS_ROWS)
                    self._add_prompt_logprobs(result, seq, start + lo - a, self.model.lm_head(hidden[0, lo:hi]))
        if not last:
            return {}
        rows = hidden[0, list(last.values())]
        return dict(zip(last, self.model.lm_head(rows).float()))

    def _decode_inputs(self, seqs: list[Sequence], B: int, L: int):
        """Host -> device inputs of a decode batch padded to B rows and contexts of L tokens."""
        bs, dev = self.block_size, self.device
        width = _cdiv(L, bs)
        ids = [s.token_ids[s.num_computed_tokens - 1] for s in seqs]
        ctx = [s.num_computed_tokens for s in seqs]
        scratch = self.scratch_block
        tables = [s.block_table[:width] + [scratch] * (width - len(s.block_table[:width])) for s in seqs]
        pad = B - len(seqs)
        ids, ctx = ids + [0] * pad, ctx + [1] * pad  # padding rows: one token in the scratch block
        tables += [[scratch] * width] * pad
        slots = [s.state_slot for s in seqs] + [self.scratch_slot] * pad
        return (torch.tensor(ids, device=dev), torch.tensor(ctx, device=dev),
                torch.tensor(tables, device=dev, dtype=torch.long),
                torch.tensor(slots, device=dev, dtype=torch.long))

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        n = len(seqs)
        L = max(s.num_computed_tokens for s in seqs)
        if self.use_graphs:
            B = 1 << (n - 1).bit_length()  # batch bucket: next power of two
            Lb = max(256, 1 << (L - 1).bit_length())
            key = (B, Lb)
            if key not in self._graphs:
                try:
                    self._graphs[key] = _DecodeGraph(self, B, Lb)
                except RuntimeError as e:  # an op in the decode pass cannot be captured
                    warnings.warn(f"CUDA graph capture failed ({e}); decoding eagerly from now on")
                    self.use_graphs = False
                    return self._decode(seqs)
            return self._graphs[key].run(self._decode_inputs(seqs, B, Lb))[:n]
        return self._decode_eager(*self._decode_inputs(seqs, n, L), L)

    def _decode_eager(self, ids, ctx, tables, state_slots, L: int) -> torch.Tensor:
        """ids, ctx, state_slots: [B]; tables: [B, cdiv(L, block_size)]. Returns logits [B, V]."""
        bs = self.block_size
        pos = torch.arange(L, device=self.device)
        context_slots = tables[:, pos // bs] * bs + pos % bs  # [B, L]
        mask = pos[None, :] < ctx[:, None]
        new_slot = context_slots.gather(1, (ctx - 1)[:, None])[:, 0]
        batch = MLABatch(new_slot, context_slots=context_slots, context_mask=mask)
        hidden = self._forward(ids[:, None], batch, state_slots, (None, None))
        return self.model.lm_head(hidden[:, 0]).float()

    def _forward(self, ids, batch: MLABatch, state_slots, cu_seqlens: tuple) -> torch.Tensor:
        """cu_seqlens: (on the device, on the host) for a packed prefill, else (None, None)."""
        layers = []
        for i in range(self.cfg.num_hidden_layers):
            if i in self.mla_cache:
                layers.append(PagedMLAView(self.mla_cache[i], self.cfg.kv_lora_rank, batch))
            else:
                layers.append(PagedKDAView(self.kda_state[i], state_slots, *cu_seqlens))
        return self.model.model(ids, _Views(layers))


class _DecodeGraph:
    """One CUDA graph of the decode pass for B rows and contexts padded to L tokens.

    Inputs are copied into static buffers before each replay; padding rows point at the
    runner's scratch block and scratch state slot, and their logits are dropped."""

    def __init__(self, runner: ModelRunner, B: int, L: int):
        self.inputs = runner._decode_inputs([], B, L)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: compilation, autotuning, allocator
                runner._decode_eager(*self.inputs, L)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = runner._decode_eager(*self.inputs, L)

    def run(self, inputs) -> torch.Tensor:
        for static, new in zip(self.inputs, inputs):
            static.copy_(new)
        self.graph.replay()
        return self.logits
