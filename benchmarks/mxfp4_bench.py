"""MXFP4-packed routed experts in serving (issue P10) against bf16 experts, on one GPU.

(a) memory: routed-expert weight bytes of ``small`` (the models of (b)) and of K3 (from its
    config), packed (4.25 bits per weight) vs bf16. Expect 16 / 4.25 = 3.76x.
(b) decode: engine throughput (CUDA graphs, 128-token prompts, 64 greedy tokens) at batch 1 and 32
    of one random ``small`` model with bf16 experts and with packed experts. The bf16 model holds
    the packed experts' decoded values, so both compute the same function; the first decode step's
    logits are compared as a check. Target (issue P10): batch-1 decode at least as fast as bf16.
(c) micro: one MoE layer of ``small`` and of K3, routed experts only, each path captured in a
    CUDA graph (median of replays): the decode GEMVs (``moe_gemv`` bf16 vs ``mxfp4_moe_gemv``)
    at 1, 32 and 128 tokens, and the sorted grouped path (``RoutedExperts.forward_sorted`` with
    ``grouped_mm`` vs ``PackedRoutedExperts.forward_sorted`` with the packed grouped GEMM) at 512
    and 4096 tokens. Floors: the bytes of the experts used (each read once) at 4.3 TB/s, per
    format; for the grouped path also the bf16 tensor-core floor (2 x 3 F D FLOP per pair at
    800 TFLOP/s). ``rel_err``: packed output against the bf16 path on the same decoded weights.

Uniform random routing. Run on the device (about a minute; K3's layer needs ~80 GB):
``python benchmarks/mxfp4_bench.py [--parts memory decode micro] [--presets small k3]``.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from benchmarks.common import environment, rel_err, write_results
from benchmarks.moe_decode_bench import graph_time
from benchmarks.serve_bench import decode_throughput, engine, random_ids
from openk3 import build_model, preset
from openk3.model.moe import RoutedExperts
from openk3.model.packed_experts import PackedRoutedExperts, pack_experts
from openk3.ops.moe import moe_gemv
from openk3.ops.mx import mxfp4_dequantize
from openk3.ops.mx_moe import mxfp4_moe_gemv

BANDWIDTH = 4.3e12  # bytes/s: the H200's device copy (shared/NOTES.md)
BF16_FLOPS = 800e12  # bf16 matmul, measured (shared/NOTES.md)
ROWS: list[dict] = []


def record(row: dict) -> None:
    ROWS.append(row)
    write_results("mxfp4_bench", ROWS)


def expert_bytes(model) -> int:
    """Bytes of the routed experts' weights as the model holds them."""
    total = 0
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            total += sum(p.numel() * p.element_size() for p in m.parameters())
        elif isinstance(m, PackedRoutedExperts):
            total += sum(b.numel() * b.element_size() for b in m.buffers())
    return total


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


@torch.no_grad()
def dequantise_into(dense: RoutedExperts, packed: PackedRoutedExperts) -> None:
    """Set ``dense``'s weights to ``packed``'s decoded values, one expert at a time (the fp32
    decode of a whole K3 stack would need 120 GB)."""
    for name in ("w1", "w3", "w2"):
        w, q = getattr(dense, name), packed.weight(name)
        for e in range(w.shape[0]):
            w[e].copy_(mxfp4_dequantize(q.packed[e], q.scale[e], w.dtype))


def part_memory(small_bf16, small_packed) -> None:
    for name, bf16, packed in (("small", expert_bytes(small_bf16), expert_bytes(small_packed)),
                               ("k3", *k3_expert_bytes())):
        record({"part": "memory", "model": name, "experts_bf16_GB": bf16 / 1e9,
                "experts_packed_GB": packed / 1e9, "bf16_over_packed": bf16 / packed})
    record({"part": "memory", "model": "small (whole model)", "bf16_GB": model_bytes(small_bf16) / 1e9,
            "packed_GB": model_bytes(small_packed) / 1e9,
            "bf16_over_packed": model_bytes(small_bf16) / model_bytes(small_packed)})


def k3_expert_bytes() -> tuple[int, int]:
    cfg = preset("k3")
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) + cfg.num_nextn_predict_layers
    weights = layers * cfg.num_experts * 3 * cfg.moe_intermediate_size * (cfg.moe_latent_size or cfg.hidden_size)
    return 2 * weights, weights * 17 // 32  # bf16; packed: 1/2 byte + 1/32 scale byte per weight


def part_decode(bf16, packed) -> None:
    results = {}
    for batch in (1, 32):
        for label, model in (("bf16", bf16), ("packed", packed)):
            eng = engine(model, max_num_seqs=32, max_num_batched_tokens=8192, max_model_len=1024)
            decode_throughput(eng, batch, new=8)  # warm-up: compiles and captures this bucket
            row = decode_throughput(eng, batch, new=64)
            results[label, batch] = row
            record({"part": "decode", "experts": label, **row})
        record({"part": "decode", "batch": batch, "packed_over_bf16_tok_s":
                results["packed", batch]["decode_tok_s"] / results["bf16", batch]["decode_tok_s"]})


def check_logits(bf16, packed) -> None:
    """One prefill + decode step of both models: the same function up to kernel rounding (bf16
    activations; a random model amplifies differences, so this only catches gross errors)."""
    ids = torch.tensor([random_ids(64, bf16.cfg.vocab_size, 1)], device="cuda")
    with torch.inference_mode():
        a, b = bf16(ids).logits.float(), packed(ids).logits.float()
    record({"part": "check", "what": "prefill logits, packed vs bf16 on the same decoded weights",
            "rel_err": rel_err(b, a)})


def micro_layer(name: str) -> tuple[RoutedExperts, PackedRoutedExperts]:
    """One MoE layer's routed experts: random packed bytes with O(1 / sqrt(fan_in)) scales, and a
    bf16 copy of their decoded values, both on the GPU."""
    cfg = preset(name)
    D = cfg.moe_latent_size or cfg.hidden_size
    packed = PackedRoutedExperts(cfg, D, device="cuda")
    for n, fan_in in (("w1", D), ("w3", D), ("w2", cfg.moe_intermediate_size)):
        centre = 127 + round(torch.log2(torch.tensor(0.6 / fan_in ** 0.5)).item())
        getattr(packed, f"{n}_packed").random_(0, 256)
        getattr(packed, f"{n}_scale").random_(centre - 2, centre + 2)
    with torch.device("meta"):
        dense = RoutedExperts(cfg, D)
    dense = dense.to(torch.bfloat16).to_empty(device="cuda").requires_grad_(False)
    dequantise_into(dense, packed)
    return dense, packed


def micro_row(name, dense, packed, N: int, path: str) -> dict:
    cfg = dense.cfg
    E, F, D = dense.w1.shape
    k = cfg.num_experts_per_token
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    topk_idx = torch.rand(N, E, device="cuda").topk(k).indices
    topk_weight = torch.rand(N, k, device="cuda")
    act = {"hidden_act": cfg.hidden_act, "situ_beta1": cfg.situ_beta1, "situ_beta2": cfg.situ_beta2}
    w = [packed.weight(n) for n in ("w1", "w3", "w2")]
    if path == "gemv":
        fns = (lambda: moe_gemv(x, dense.w1, dense.w3, dense.w2, topk_idx, topk_weight, **act),
               lambda: mxfp4_moe_gemv(x, *w, topk_idx, topk_weight, **act))
    else:
        fns = (lambda: dense.forward_sorted(x, topk_idx, topk_weight),
               lambda: packed.forward_sorted(x, topk_idx, topk_weight))
    with torch.inference_mode():
        bf16_s, packed_s = (graph_time(fn) for fn in fns)
        err = rel_err(fns[1](), fns[0]())
    used = topk_idx.unique().numel()
    weights = used * 3 * F * D
    row = {"part": "micro", "layer": name, "path": path, "tokens": N, "experts_used": used,
           "bf16_us": 1e6 * bf16_s, "packed_us": 1e6 * packed_s, "bf16_over_packed": bf16_s / packed_s,
           "bf16_floor_us": 1e6 * 2 * weights / BANDWIDTH,
           "packed_floor_us": 1e6 * weights * 17 / 32 / BANDWIDTH, "rel_err": err}
    if path == "grouped":
        row["tensor_core_floor_us"] = 1e6 * 2 * 3 * F * D * N * k / BF16_FLOPS
    return row


def part_micro(presets: list[str]) -> None:
    for name in presets:
        dense, packed = micro_layer(name)
        for N in (1, 32, 128):
            record(micro_row(name, dense, packed, N, "gemv"))
        for N in (512, 4096):
            record(micro_row(name, dense, packed, N, "grouped"))
        del dense, packed
        torch.cuda.empty_cache()


def print_table(rows: list[dict]) -> None:
    for part in dict.fromkeys(r["part"] for r in rows):
        sub = [r for r in rows if r["part"] == part]
        keys = list(dict.fromkeys(k for r in sub for k in r if k != "part"))
        print(f"\n{part}\n" + " | ".join(keys))
        for r in sub:
            print(" | ".join(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                             for k in keys))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["memory", "decode", "micro"])
    ap.add_argument("--presets", nargs="+", default=["small", "k3"], help="layers for --parts micro")
    args = ap.parse_args()
    print(environment())
    t0 = time.perf_counter()
    if {"memory", "decode"} & set(args.parts):
        bf16 = build_model(preset("small"), device="cuda", dtype=torch.bfloat16).eval()
        packed = pack_experts(copy.deepcopy(bf16))
        # the same function: the bf16 experts hold the packed ones' decoded values
        for dense, q in zip((m for m in bf16.modules() if isinstance(m, RoutedExperts)),
                            (m for m in packed.modules() if isinstance(m, PackedRoutedExperts))):
            dequantise_into(dense, q)
        if "memory" in args.parts:
            part_memory(bf16, packed)
        if "decode" in args.parts:
            check_logits(bf16, packed)
            part_decode(bf16, packed)
        del bf16, packed
        torch.cuda.empty_cache()
    if "micro" in args.parts:
        part_micro(args.presets)
    print_table(ROWS)
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
