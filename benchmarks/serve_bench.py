"""Serving on one GPU: prefix-cache TTFT, decode throughput vs transformers, bandwidth floor.

(a) ttft: time to first token of a 32K-token prompt with a cold cache (prefill chunks of the
    default ``max_num_batched_tokens``, and of 32768: the whole prompt in one pass; an engine's
    first prompt, which captures the prefill graphs, reported apart), and with a
    cached prefix (a request of the prefix alone ran before): 31744 tokens (a hit inside
    physical block 5 of 6144: copy-on-write of 1024 rows) and 30720 (the edge of block 5: no
    copy), each the best of four runs with a new prefix (the first meets new shapes; all four
    are reported). Target: warm under 10% of cold.
(b) decode: generation throughput of ``small`` (random weights) at batch 1, 32, 128 with
    128-token prompts and 128 new tokens, CUDA graphs on and off; and, in the same run, a
    Kimi-Linear-format model of similar size (transformers' ``KimiLinearForCausalLM``, random
    weights, saved and loaded by openk3) served by openk3 and by transformers' ``generate``.
    ``decode-ab`` runs the decode part at batch 1, 4 and 32 with all decode-path changes on,
    with the norms not folded into the GEMVs, and without branches and GEMVs, twice.
    ``decode-split`` splits the decode step at batch 1, 4, 32 into its graph replay's GPU time
    and the host time around it, with the GEMV's folds (norms, residual adds) on and off, three times.
(c) floor: batch-1 decode time vs (bytes of weights read per token + KDA state read and
    written + MLA latents read) / 4.3 TB/s (the measured copy bandwidth of the H200).
(d) long: batch-1 decode step (CUDA graphs) at 4K, 32K and 128K tokens of context: the paged
    MLA attention reads only the blocks in use, one graph serves every length.
(e) peer also times a 32K-token cold prefill through the engine against transformers' single
    forward over the same prompt and weights.
(f) server: 64 concurrent streams through the OpenAI server (official client) vs the same
    requests through the engine directly, the streams in one client process and shared among
    ``--client-procs`` processes (one process's GIL bounds the client). Target: the server adds
    at most 10%.
(g) million: one prompt of ``--million-tokens`` tokens (default 1,048,576; several values run
    one after another) with ``max_model_len`` just above it, prefilled in chunks of
    ``--million-chunk`` tokens, prefix caching off: time to first token, prefill tokens/s, peak
    GPU memory against the memory floor, then a few batch-1 decode steps at that context
    (CUDA graph) against their bandwidth floor (``docs/long_context.md``, "Serving at 1M tokens").

Run on the device: ``python benchmarks/serve_bench.py [--parts ttft decode peer long]``;
``--parts million --million-tokens 524288 1048576`` for the long prompts.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import traceback

import torch

from benchmarks.common import environment, profile, write_results
from openk3 import build_model, load_pretrained, preset
from openk3.params import count_parameters
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer, VisibleTokenizer

COPY_BANDWIDTH = 4.3e12  # bytes/s, the H200's device copy (docs/benchmarks.md)
ROWS: list[dict] = []


def record(row: dict) -> None:
    ROWS.append(row)
    print(row, flush=True)
    write_results("serve_bench", ROWS)


def engine(model, tokenizer=None, **kw) -> LLMEngine:
    return LLMEngine(model, tokenizer or ByteTokenizer(), EngineConfig(**kw), eos_token_ids=())


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft(eng: LLMEngine, prompt: list[int]) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    assert rid not in eng.requests
    return time.perf_counter() - t


def part_ttft(model) -> None:
    vocab = model.cfg.vocab_size
    kw = dict(max_num_seqs=4, max_model_len=40000, cuda_graphs=True)  # prefill passes up to prefill_graph_tokens as graphs
    prompt_len = 32768
    warm_eng = engine(model, **kw)
    ttft(warm_eng, random_ids(2048, vocab, 0))  # warm-up: kernels, autotuning
    default_budget = EngineConfig().max_num_batched_tokens
    cold = {}
    for budget in (default_budget, prompt_len):
        # one engine: its first prompt meets new pass sizes (the prefill graphs' capture, cuDNN's
        # plans), reported apart; no prefix caching, so every prompt is cold
        eng = engine(model, enable_prefix_caching=False, **kw, max_num_batched_tokens=budget)
        first = ttft(eng, random_ids(prompt_len, vocab, 1))
        cold[budget] = min(ttft(eng, random_ids(prompt_len, vocab, s)) for s in (2, 3))
        record({"part": "ttft", "case": f"cold, chunks of {budget}", "prompt": prompt_len,
                "ttft_ms": 1e3 * cold[budget], "first_run_ms": 1e3 * first})
    # where a cold request's time goes (the whole prompt in one chunk; no cache: one engine serves every run)
    cold_eng, cold_prompt = engine(model, enable_prefix_caching=False, **kw, max_num_batched_tokens=prompt_len), \
        random_ids(prompt_len, vocab, 1)
    record(profile(lambda: ttft(cold_eng, cold_prompt), f"cold request, {prompt_len} tokens in one chunk"))
    for prefix, where in ((31744, "inside block"), (30720, "block edge")):
        times, hit = [], 0
        eng = engine(model, **kw)
        for rep in range(4):  # the first run meets new chunk shapes (autotuning, the prefill
            # graph's capture): keep the best; a new prefix each time, so each run is a first hit
            shared = random_ids(prefix, vocab, 3 + rep)
            ttft(eng, shared)  # the prefix alone: a KDA checkpoint at its end
            before = eng.block_manager.stats.saved_tokens
            times.append(ttft(eng, shared + random_ids(prompt_len - prefix, vocab, 4)))
            hit = eng.block_manager.stats.saved_tokens - before
        t = min(times)
        record({"part": "ttft", "case": f"warm, {prefix}-token prefix ({where})", "prompt": prompt_len,
                "ttft_ms": 1e3 * t, "first_run_ms": 1e3 * times[0], "runs_ms": [round(1e3 * x, 2) for x in times],
                "cached_tokens": hit,
                "warm_over_cold": t / cold[default_budget]})
    # where a warm request's time goes: the same cached prefix, a new 1024-token tail each call
    eng, shared, tails = engine(model, **kw), random_ids(31744, vocab, 5), iter(range(10, 20))
    ttft(eng, shared)
    record(profile(lambda: ttft(eng, shared + random_ids(1024, vocab, next(tails))),
                   "warm request, 31744-token cached prefix"))


def decode_throughput(eng: LLMEngine, batch: int, prompt_len: int = 128, new: int = 128) -> dict:
    vocab = eng.model.cfg.vocab_size
    params = SamplingParams(temperature=0, max_tokens=new)
    for i in range(batch):
        eng.add_request(random_ids(prompt_len, vocab, 100 + i), params)
    decode_s, decode_tokens, t0 = 0.0, 0, time.perf_counter()
    other = []  # the steps with prefill in them: (ms, tokens scheduled)
    torch.cuda.synchronize()
    t = time.perf_counter()
    while eng.has_unfinished():  # no synchronisation per step: a step may run ahead (overlap_decode)
        all_decode = eng.scheduler.num_waiting == 0 and all(
            s.num_uncomputed_tokens == 1 for s in eng.scheduler.running)
        outs = eng.step()
        now = time.perf_counter()
        if all_decode:
            decode_s += now - t
            decode_tokens += len(outs)
        else:
            other.append(round(1e3 * (now - t), 1))
        t = now
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return {"batch": batch, "decode_tok_s": decode_tokens / decode_s,
            "ms_per_step": 1e3 * decode_s / max(1, decode_tokens // batch),
            "end_to_end_tok_s": batch * new / total, "prefill_steps_ms": other}


def part_decode(model, name: str, batches=(1, 32, 128), modes=(True, False)) -> dict:
    results = {}
    for graphs in modes:
        for B in batches:
            eng = engine(model, max_num_seqs=128, max_num_batched_tokens=8192, max_model_len=4096,
                         cuda_graphs=graphs)
            try:
                decode_throughput(eng, B, new=16)  # warm-up: compiles and captures this bucket
                row = decode_throughput(eng, B)
            except Exception as e:  # noqa: BLE001 - record the failure, keep measuring
                traceback.print_exc()
                row = {"batch": B, "error": f"{type(e).__name__}: {e}"[:300]}
            row.update(part="decode", model=name, cuda_graphs=graphs)
            record(row)
            results[graphs, B] = row
    return results


def part_decode_ab(model, batches=(1, 4, 32), rounds: int = 2) -> None:
    """The decode step with the decode-path changes of the last sessions off and on, in one run,
    ``rounds`` times in turn (engines of the same code measured apart differed by up to 0.2 ms a
    step): everything on; the norms not folded into the GEMVs (``openk3.ops.gemv.FOLD_NORMS``,
    twenty-seventh session); and the twenty-sixth session's base, without the parallel graph
    branches (``openk3.model.branch.ENABLED``) and the Triton GEMVs (``GEMV_MAX_ROWS`` 0: cuBLAS)."""
    from openk3.model import branch
    from openk3.ops import gemv

    saved = branch.ENABLED, gemv.GEMV_MAX_ROWS, gemv.FOLD_NORMS
    variants = (("all on", saved), ("norms not folded", (True, saved[1], False)),
                ("no branches, no GEMV", (False, 0, False)))
    try:
        for _ in range(rounds):
            for name, settings in variants:
                branch.ENABLED, gemv.GEMV_MAX_ROWS, gemv.FOLD_NORMS = settings
                part_decode(model, f"small, {name}", batches=batches, modes=(True,))
                gc.collect()
                torch.cuda.empty_cache()
    finally:
        branch.ENABLED, gemv.GEMV_MAX_ROWS, gemv.FOLD_NORMS = saved


def decode_split(eng: LLMEngine, batch: int, steps: int = 64) -> dict:
    """A decode step's period (``steps`` steps of ``batch`` rows, the GPU synchronised only
    before the first and after the last) against its graph replay's GPU time (CUDA events
    around ``CUDAGraph.replay``): the rest is host work the GPU waits through. Plain stepping is
    synchronous (scheduling, inputs, launch, sampling, the tokens' copy, bookkeeping, text);
    with overlapped decoding (``EngineConfig.overlap_decode``) the host works while the GPU
    runs the step launched ahead. The replay's time is the stable measure of a change to the
    graph's kernels."""
    vocab = eng.model.cfg.vocab_size
    for i in range(batch):
        eng.add_request(random_ids(128, vocab, 300 + i), SamplingParams(temperature=0, max_tokens=steps + 8))
    while eng.scheduler.num_waiting or any(s.num_uncomputed_tokens > 1 for s in eng.scheduler.running):
        eng.step()
    eng.step()  # a decode step: the next one may be in flight now
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    replay = torch.cuda.CUDAGraph.replay

    def timed(graph):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay(graph)
        b.record()
        events.append((a, b))

    torch.cuda.CUDAGraph.replay = timed
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t) / steps
    finally:
        torch.cuda.CUDAGraph.replay = replay
    gpu = statistics.median(a.elapsed_time(b) for a, b in events)
    eng.abort_all()
    while eng.has_unfinished():
        eng.step()
    return {"batch": batch, "step_ms": wall, "replay_gpu_ms": gpu, "host_exposed_ms": wall - gpu}


SPLIT_VARIANTS = {  # (gemv.FOLD_NORMS, gemv.FOLD_ADDS, EngineConfig.overlap_decode)
    "overlap": {"all on": (True, True, True), "no overlap": (True, True, False),
                "no overlap, no folds": (False, False, False)},
    "folds": {"all folds": (True, True, True), "adds not folded": (True, False, True),
              "norms not folded": (False, True, True), "no folds": (False, False, True)},
}


def part_decode_split(model, batches=(1, 4, 32), rounds: int = 3, variants: str = "overlap") -> None:
    """``decode_split`` with the twenty-seventh session's changes on and off, one engine each, in
    turn ``rounds`` times: ``variants`` "overlap", overlapped decoding
    (``EngineConfig.overlap_decode``) and all GEMV folds; "folds", each fold apart
    (``gemv.FOLD_NORMS``: the norms before the MoE's up projection and KDA's ``o_proj``;
    ``gemv.FOLD_ADDS``: the residual add after the attention's ``o_proj``), whose share the
    replay's GPU time shows."""
    from openk3.ops import gemv

    saved = gemv.FOLD_NORMS, gemv.FOLD_ADDS
    variants = SPLIT_VARIANTS[variants]
    engines = {}
    try:
        for name, (norms, adds, overlap) in variants.items():
            gemv.FOLD_NORMS, gemv.FOLD_ADDS = norms, adds
            engines[name] = engine(model, max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=4096,
                                   cuda_graphs=True, overlap_decode=overlap)
            for B in batches:  # captures each bucket's graph with these folds
                decode_split(engines[name], B, steps=4)
        for _ in range(rounds):
            for name, (norms, adds, _) in variants.items():
                gemv.FOLD_NORMS, gemv.FOLD_ADDS = norms, adds
                for B in batches:
                    record({"part": "decode-split", "variant": name, **decode_split(engines[name], B)})
    finally:
        gemv.FOLD_NORMS, gemv.FOLD_ADDS = saved


def part_long(model, contexts=(4096, 32768, 131072), new: int = 64) -> None:
    for context in contexts:
        eng = engine(model, max_num_seqs=1, max_model_len=context + 2 * new)
        decode_throughput(eng, 1, prompt_len=16, new=8)  # warm-up: captures the batch-1 graph
        row = decode_throughput(eng, 1, prompt_len=context, new=new)
        row.update(part="long", model="small", context=context, graphs=len(eng.runner._graphs))
        record(row)


def mla_attention_flop(cfg, tokens: int) -> float:
    """Causal attention of a ``tokens``-token prompt in every MLA layer, expanded form: about
    tokens^2 / 2 (query, key) pairs per head, each 2 * (qk_head_dim + v_head_dim) FLOPs."""
    n_mla = sum(cfg.is_mla_layer(i) for i in range(cfg.num_hidden_layers))
    return n_mla * cfg.num_attention_heads * tokens ** 2 * (cfg.qk_head_dim + cfg.v_head_dim)


def part_million(model, tokens: int, chunk: int, decode_steps: int = 8) -> None:
    """One ``tokens``-token prompt, batch 1: TTFT (``add_request`` to the first token, every
    prefill pass included), peak memory, then ``decode_steps`` decode steps at that context."""
    vocab, gib = model.cfg.vocab_size, 2**30
    gc.collect()  # the previous length's engine and its cache
    torch.cuda.empty_cache()
    eng = engine(model, max_num_seqs=1, max_model_len=tokens + 64, max_num_batched_tokens=chunk,
                 enable_prefix_caching=False)
    # warm-up on this engine: kernels and autotuning at the chunk's shape, the batch-1 decode graph
    eng.generate([random_ids(min(2 * chunk + 100, tokens), vocab, 20)], SamplingParams(temperature=0, max_tokens=4))
    prompt = random_ids(tokens, vocab, 21)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1 + decode_steps))
    passes = 1
    while not eng.step():  # prefill passes until the one that samples the first token
        passes += 1
    torch.cuda.synchronize()
    ttft = time.perf_counter() - t
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    step_ms = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        step_ms.append(1e3 * (time.perf_counter() - t))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    latents = tokens * eng.runner.latent_bytes_per_token
    kda_state = eng.runner.kda_state.nbytes() // (eng.config.max_num_seqs + 1)  # one slot
    flop = mla_attention_flop(model.cfg, tokens)
    decode_ms = sorted(step_ms)[len(step_ms) // 2]
    record({"part": "million", "prompt": tokens, "chunk": chunk, "prefill_passes": passes,
            "ttft_s": ttft, "prefill_tok_s": tokens / ttft,
            "mla_attention_tflop": flop / 1e12, "attention_tflops_lower_bound": flop / ttft / 1e12,
            "peak_allocated_gib": peak / gib, "peak_reserved_gib": reserved / gib,
            "weights_gib": weights / gib, "latents_gib": latents / gib, "kda_state_mib": kda_state / 2**20,
            "floor_gib": (weights + latents + kda_state) / gib,
            "mla_cache_gib": eng.runner.cache_bytes()["mla"] / gib,
            "decode_ms": decode_ms, "decode_steps_ms": step_ms,
            "decode_floor_ms": bandwidth_floor(model, decode_ms, tokens)["floor_ms"],
            "cuda_graphs": len(eng.runner._graphs)})


def bandwidth_floor(model, ms_per_token: float, context: int = 192) -> dict:
    """Bytes one batch-1 decode step must move: weights (activated experts only), KDA states
    (fp32, read + written), MLA latents of the context (read)."""
    cfg = model.cfg
    elem = next(model.parameters()).element_size()
    active = count_parameters(cfg)["active"]
    emb = cfg.vocab_size * cfg.hidden_size  # the embedding reads one row, not the table
    weights = (active - emb) * elem
    n_kda = sum(not cfg.is_mla_layer(i) for i in range(cfg.num_hidden_layers))
    n_mla = cfg.num_hidden_layers - n_kda
    kda_state = n_kda * cfg.linear_num_heads * cfg.linear_head_dim ** 2 * 4 * 2
    latents = n_mla * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elem
    total = weights + kda_state + latents
    floor_ms = 1e3 * total / COPY_BANDWIDTH
    return {"part": "floor", "bytes_per_token": total, "weights": weights, "kda_state": kda_state,
            "latents": latents, "floor_ms": floor_ms, "measured_ms": ms_per_token,
            "measured_over_floor": ms_per_token / floor_ms}


def hf_kimi_linear(small):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=small.vocab_size, hidden_size=small.hidden_size,
        num_hidden_layers=small.num_hidden_layers, intermediate_size=small.intermediate_size,
        moe_intermediate_size=small.moe_intermediate_size * 2,
        num_attention_heads=small.num_attention_heads, num_key_value_heads=small.num_attention_heads,
        kv_lora_rank=small.kv_lora_rank, q_lora_rank=small.q_lora_rank,
        linear_num_heads=small.linear_num_heads, linear_head_dim=small.linear_head_dim,
        num_local_experts=small.num_experts, num_experts_per_tok=small.num_experts_per_token,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["full_attention" if small.is_mla_layer(i) else "linear_attention"
                     for i in range(small.num_hidden_layers)])
    torch.manual_seed(0)
    return KimiLinearForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


@torch.inference_mode()
def hf_generate_throughput(hf, batch: int, prompt_len: int = 128, new: int = 128) -> dict:
    vocab = hf.config.vocab_size
    ids = torch.tensor([random_ids(prompt_len, vocab, 100 + i) for i in range(batch)], device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    hf.generate(ids[:, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = hf.generate(ids, **kw)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    assert out.shape[1] == prompt_len + new
    return {"batch": batch, "end_to_end_tok_s": batch * new / total}


@torch.inference_mode()
def hf_prefill_seconds(hf, ids: list[int]) -> float:
    """One forward of transformers over the whole prompt, keeping the last position's logits
    (what its ``generate`` does before the first token)."""
    x = torch.tensor([ids], device="cuda")
    hf(x[:, :2048], logits_to_keep=1)  # warm-up
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf(x, logits_to_keep=1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


def part_peer() -> None:
    hf = hf_kimi_linear(preset("small"))
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_pretrained(d, dtype=torch.bfloat16, device="cuda").eval()
    print(f"Kimi-Linear-format peer model: {sum(p.numel() for p in ours.parameters()) / 1e9:.3f}B")
    prompt = random_ids(32768, ours.cfg.vocab_size, 7)
    kw = dict(max_num_seqs=2, max_model_len=40000, enable_prefix_caching=False)
    for budget in (EngineConfig().max_num_batched_tokens, 32768):
        eng = engine(ours, max_num_batched_tokens=budget, **kw)
        first = ttft(eng, prompt)  # the prefill graphs' capture and cuDNN's plans, once per engine
        cold = min(ttft(eng, prompt) for _ in range(2))  # no prefix caching: cold every time
        try:
            peer = hf_prefill_seconds(hf, prompt)
        except Exception as e:  # noqa: BLE001 - record the failure, keep measuring
            traceback.print_exc()
            peer = float("nan")
            print(f"transformers prefill failed: {e}")
        record({"part": "peer_prefill", "prompt": len(prompt), "openk3_chunks": budget,
                "openk3_ttft_ms": 1e3 * cold, "openk3_first_run_ms": 1e3 * first,
                "transformers_forward_ms": 1e3 * peer,
                "openk3_over_transformers": cold / peer})
    rows = part_decode(ours, "kimi_linear (HF format)", batches=(1, 32), modes=(True,))
    for B in (1, 32):
        try:
            peer = hf_generate_throughput(hf, B)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            peer = {"batch": B, "error": f"{type(e).__name__}: {e}"[:300]}
        peer.update(part="decode", model="kimi_linear, transformers generate")
        best = rows[True, B].get("end_to_end_tok_s", 0)
        if "end_to_end_tok_s" in peer:
            peer["openk3_over_transformers_end_to_end"] = best / peer["end_to_end_tok_s"]
        record(peer)


def quantiles(values: list[float]) -> dict:
    """Min, median, 90th percentile and max of sorted ``values`` (rounded), or {} if empty."""
    return {q: round(values[int(q * (len(values) - 1))], 2) for q in (0, 0.5, 0.9, 1)} if values else {}


def step_counts(before, after, seconds: float) -> dict:
    """What the engine's steps did between two ``EngineStats`` (steps, prefill steps, their wall
    seconds, tokens per step) and the share of ``seconds`` (a round's wall) they took."""
    steps = after.num_steps - before.num_steps
    busy = after.step_seconds - before.step_seconds
    return {"steps": steps, "prefill_steps": after.prefill_steps - before.prefill_steps, "steps_s": busy,
            "prefill_steps_s": after.prefill_step_seconds - before.prefill_step_seconds,
            "tokens_per_step": (after.generation_tokens - before.generation_tokens) / max(steps, 1),
            "busy_share": busy / seconds}


def bench_engine(name: str, device: str, dtype: str, **kw) -> LLMEngine:
    """The benchmark's engine over a fresh random ``name`` model (what a ``ProcessEngine`` builds
    in its own process; ``build_model``'s default seed: the weights ``main`` built)."""
    eng = engine(build_model(preset(name), device=device, dtype=getattr(torch, dtype)), VisibleTokenizer(), **kw)
    eng.capture_graphs()  # as openk3 serve
    return eng


def part_server(model, name: str, streams: int = 64, new: int = 128, prompt_len: int = 128,
                client_procs: tuple[int, ...] = (1, 8), switch_intervals: tuple[float, ...] = (0.005,),
                engines: tuple[str, ...] = ("thread", "process"), clients: tuple[str, ...] = ("threads",),
                api_servers: tuple[int, ...] = (1,)) -> None:
    """What the OpenAI server adds over the engine: the same 64 requests (128-token prompts, 128
    greedy tokens each) through ``LLMEngine.generate``, then as 64 concurrent streams of the
    official ``openai`` client (a thread per stream) against ``openk3 serve``'s app (uvicorn in
    this process), every engine with ``VisibleTokenizer`` (what ``openk3 serve`` gives a random
    model: every token is text, so every token is one SSE chunk; with ``ByteTokenizer``, as
    before the twenty-eighth session, ids above 255 decode to nothing and a round streamed ~23
    chunks of its 8,192 tokens), the clients in other processes so that their JSON parsing does not share this
    interpreter's GIL: a round with all streams in one client process, then one with the streams
    shared among ``client_procs[1]`` processes, a round per client kind of ``clients``
    (``openai_clients.py``: ``threads``, ``async``, ``raw``). One process's GIL bounds the client at ~220 us
    per chunk (``benchmarks/openai_clients.py``); ``client_cpu_max_s`` near ``server_s`` says a
    round measured the client.

    ``engines``: the app over ``AsyncEngine`` (``thread``: the engine's steps share this
    process's GIL with the event loop) and over ``ProcessEngine`` (``process``: the engine in a
    process of its own, ``openk3 serve``'s default). Each round's engine steps (``EngineStats``:
    how many, how many prefill, their wall, tokens per step, the share of the round they took)
    are reported beside the engine's alone; the thread engine's rounds run for each of ``switch_intervals``
    (``sys.setswitchinterval``: how long the event loop may keep the GIL once the engine thread,
    back from the GPU, asks for it; CPython's default 5 ms). The process engine runs once per
    ``api_servers`` count: 1 is the app in this process (uvicorn on a thread), N > 1 is ``openk3
    serve --api-servers N`` (``ApiServers``: N server processes on one port, the engine in
    another; the time each request reached the engine is not recorded there)."""
    import contextlib
    import functools
    import socket
    import threading

    import uvicorn

    from benchmarks.openai_clients import Clients
    from openk3.serve.api_servers import ApiServers
    from openk3.serve.engine import AsyncEngine
    from openk3.serve.engine_process import ProcessEngine
    from openk3.serve.server import build_app

    vocab = model.cfg.vocab_size
    prompts = [random_ids(prompt_len, vocab, 300 + i) for i in range(streams)]
    kw = dict(max_num_seqs=streams, max_model_len=1024)
    eng = engine(model, VisibleTokenizer(), **kw)
    eng.capture_graphs()  # every engine here, as openk3 serve: no request waits for a capture
    eng.generate(prompts[:streams], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    before = eng.snapshot_stats()
    t = time.perf_counter()
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=new))
    engine_s = time.perf_counter() - t
    alone = step_counts(before, eng.snapshot_stats(), engine_s)
    del eng
    gc.collect()
    weight = next(model.parameters())
    factory = functools.partial(bench_engine, name, weight.device.type, str(weight.dtype).removeprefix("torch."), **kw)
    for engine_kind, count in [("thread", 1)] * ("thread" in engines) + [("process", n) for n in api_servers
                                                                      if "process" in engines]:
        submitted: list[tuple[tuple[int, ...], float]] | None = None
        with contextlib.ExitStack() as stack:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            if count > 1:  # openk3 serve --api-servers N
                servers = stack.enter_context(ApiServers(factory, count, sock, model_name="bench"))
                stats, intervals = servers.engine.stats, (sys.getswitchinterval(),)
            else:
                if engine_kind == "thread":
                    eng = engine(model, VisibleTokenizer(), **kw)
                    eng.capture_graphs()
                    async_engine, intervals = AsyncEngine(eng), switch_intervals
                else:
                    async_engine, intervals = ProcessEngine(factory), (sys.getswitchinterval(),)
                stack.callback(async_engine.shutdown)
                stats, submitted, submit = async_engine.stats, [], async_engine._submit

                def timed_submit(request_id, valid, *a, submit=submit, submitted=submitted):
                    submitted.append((tuple(valid.ids[:4]), time.perf_counter()))
                    return submit(request_id, valid, *a)

                async_engine._submit = timed_submit
                server = uvicorn.Server(uvicorn.Config(build_app(async_engine, "bench"), log_level="warning"))
                threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
                stack.callback(setattr, server, "should_exit", True)
                while not server.started:
                    time.sleep(0.05)
            stack.callback(sys.setswitchinterval, 0.005)
            for interval, procs, kind in ((i, p, k) for i in intervals for p in client_procs for k in clients):
                sys.setswitchinterval(interval)
                with Clients(sock.getsockname()[1], prompts, new, kind, procs) as round_clients:
                    before = stats()  # after the clients' warm-up round (a ProcessEngine's
                    # counters come with each step's outputs: current once a round ends)
                    if submitted is not None:
                        submitted.clear()
                    row = round_clients.round()
                server_s = row.pop("seconds")
                # when the server handed each request to the engine, from the round's first "go"
                start, sent = row.pop("start"), {tuple(ids): t for ids, t in row.pop("sent")}
                made = sorted(1e3 * (t - start) for t in sent.values())
                timing = {"sent_ms": quantiles(made)}
                if submitted is not None:
                    # each request's time in the server before the engine had it (HTTP, checks, IPC)
                    timing["submitted_ms"] = quantiles(sorted(1e3 * (t - start) for _, t in submitted))
                    timing["in_server_ms"] = quantiles(sorted(1e3 * (t - sent[key]) for key, t in submitted
                                                              if key in sent))
                under = step_counts(before, stats(), server_s)
                record({"part": "server", "engine": engine_kind, "api_servers": count, "client": kind,
                        "streams": streams, "new_tokens": new,
                        "engine_s": engine_s, "server_s": server_s, "server_over_engine": server_s / engine_s,
                        **row, "expected_chunks": streams * new, **timing,
                        "engine_tok_s": streams * new / engine_s, "server_tok_s": streams * new / server_s,
                        "switch_interval_s": sys.getswitchinterval(),
                        **{f"alone_{k}": v for k, v in alone.items()},
                        **{f"served_{k}": v for k, v in under.items()}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["decode", "ttft", "long", "peer", "eager"],
                    help="run in this order; 'eager' is decode without CUDA graphs")
    ap.add_argument("--preset", default="small", help="the random model served (debug: a CPU check)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--million-tokens", type=int, nargs="+", default=[1 << 20],
                    help="prompt lengths of the 'million' part (e.g. 524288 1048576)")
    ap.add_argument("--million-chunk", type=int, default=EngineConfig().max_num_batched_tokens,
                    help="the 'million' part's max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--client-procs", type=int, nargs="+", default=[1, 8],
                    help="the 'server' part's client processes, one round per value")
    ap.add_argument("--split-variants", choices=tuple(SPLIT_VARIANTS), default="overlap",
                    help="the 'decode-split' part's variants: overlapped decoding, or each GEMV fold apart")
    ap.add_argument("--clients", nargs="+", choices=("threads", "async", "raw"), default=["threads"],
                    help="the 'server' part's client kinds (benchmarks/openai_clients.py), a round each")
    ap.add_argument("--switch-intervals", type=float, nargs="+", default=[0.005],
                    help="the 'server' part's sys.setswitchinterval values, the thread engine's rounds for each")
    ap.add_argument("--server-engines", nargs="+", choices=("thread", "process"), default=["thread", "process"],
                    help="the 'server' part's engines: AsyncEngine (a thread) and ProcessEngine")
    ap.add_argument("--api-servers", type=int, nargs="+", default=[1],
                    help="the 'server' part's process engine behind this many server processes, a run each "
                         "(1: the app in this process; N > 1: openk3 serve --api-servers N)")
    args = ap.parse_args()
    print(environment())
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(preset(args.preset), device=args.device, dtype=dtype)
    for part in args.parts:
        if part in ("decode", "eager"):
            rows = part_decode(model, "small", modes=(part == "decode",))
            if "ms_per_step" in rows[part == "decode", 1]:
                record(bandwidth_floor(model, rows[part == "decode", 1]["ms_per_step"]))
        elif part == "decode-ab":
            part_decode_ab(model)
        elif part == "decode-split":
            part_decode_split(model, variants=args.split_variants)
        elif part == "ttft":
            part_ttft(model)
        elif part == "peer":
            part_peer()
        elif part == "long":
            part_long(model)
        elif part == "server":
            part_server(model, args.preset, client_procs=tuple(args.client_procs), clients=tuple(args.clients),
                        switch_intervals=tuple(args.switch_intervals), engines=tuple(args.server_engines),
                        api_servers=tuple(args.api_servers))
        elif part == "million":
            for tokens in args.million_tokens:
                part_million(model, tokens, args.million_chunk)
        else:
            raise SystemExit(f"unknown part {part!r}")


if __name__ == "__main__":
    main()
