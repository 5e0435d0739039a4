"""Training throughput on one GPU: openk3 vs transformers' KimiLinearForCausalLM in the same run.

Measures full training steps of the ``small`` preset through the trainer's own step function
(``openk3.train.trainer.train_step``: bf16 autocast over fp32 master weights, compiled layers,
the loss out of the forward through fla's fused linear cross-entropy, Quantile Balancing,
clipping, per-head Muon) — tokens/s and MFU by the same formula ``openk3 train`` logs
(``openk3.train.metrics``), first-step (compile) time and peak memory — and, as the peer, a
transformers Kimi Linear model of the same sizes trained with AdamW the way a user would (bf16
weights, its default kernels).

Floor: MFU = tokens/s x FLOPs/token / 989e12. Run on the device:
``python benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from benchmarks.common import environment, profile, write_results
from openk3 import preset
from openk3.ops.loss import auto_backend
from openk3.train.config import run_preset
from openk3.train.metrics import flops_per_token, peak_flops
from openk3.train.trainer import build_training, setup_env, step_function


def time_steps(step, steps: int, warmup: bool = True) -> float:
    if warmup:
        step()  # autotuning
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def openk3_row(args) -> dict:
    """The trainer's own step (``openk3.train.trainer.train_step``: autocast, the fused loss, the
    balancer, clipping, per-head Muon, compiled layers unless ``--no-compile``) on random tokens,
    and the trainer's own tokens/s and MFU formula."""
    cfg = run_preset(args.preset, batch_size=args.batch, seq_len=args.seq, compile=args.compile,
                     cuda_graph=args.cuda_graph, activation_checkpointing=args.activation_checkpointing,
                     device="cuda")
    model_cfg = cfg.model_config()
    env = setup_env(cfg)
    training = build_training(cfg, env, model_cfg)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, model_cfg.vocab_size, (args.batch, args.seq + 1), device="cuda", generator=g)

    train_step = step_function(training, cfg)  # as `openk3 train` runs it (CUDA graphs by default)

    def step():
        train_step([(ids[:, :-1], ids[:, 1:])])

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()  # the first step compiles and autotunes
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    step()  # the second captures the CUDA graphs (and replays them)
    torch.cuda.synchronize()
    second_s = time.perf_counter() - t0
    sec = time_steps(step, args.steps, warmup=False)
    tok_s = args.batch * args.seq / sec
    mfu = tok_s * flops_per_token(model_cfg, args.seq) / peak_flops(env.device, env.dtype)
    graphed = getattr(train_step, "graphs", None) is not None
    row = {"system": f"openk3 {args.preset}", "compile": cfg.compile, "cuda_graph": graphed,
           "ckpt": cfg.activation_checkpointing,
           "loss_backend": auto_backend(ids), "tokens_per_s": tok_s, "mfu": mfu,
           "first_step_s": first_s, "second_step_s": second_s,
           "peak_GiB": torch.cuda.max_memory_allocated() / 2**30}
    if args.profile:  # where the step's time goes
        row.update(profile(step, f"openk3 training step ({'graphed' if graphed else 'eager'})"))
    if args.census:  # which module's forward / backward, or which optimiser, launches what
        census(training, [(ids[:, :-1], ids[:, 1:])], cfg)
    return row


def census(training, batches, cfg) -> None:
    """One eager step (the graphs' kernels, launched where the profiler sees their sources)
    attributed by ``benchmarks.train_census``; printed and saved as ``train_census.json``."""
    from benchmarks.decode_census import label_modules, summarise
    from benchmarks.train_census import attribute_step
    from openk3.train.trainer import train_step

    for p in training.model.parameters():  # the graphs' gradients hold the last step's values
        p.grad = None
    train_step(training, batches, cfg)  # the eager path's own first call (lazy state)
    torch.cuda.synchronize()
    from openk3.parallel.compile import REGIONS

    remove = label_modules(training.model, leaves=REGIONS if cfg.compile is not False else ())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        train_step(training, batches, cfg)
        torch.cuda.synchronize()
    remove()
    rows = attribute_step(prof.events(), on_cuda=True)
    table = summarise(rows)
    table.sort(key=lambda r: -r["us"])
    print(f"census of one eager step: {sum(r['kernels'] for r in table)} kernels, "
          f"{sum(r['us'] for r in table) / 1e3:.1f} ms of kernel time")
    print(f"{'source':44s} {'kernels':>8s} {'ms':>8s}  most frequent")
    for r in table:
        print(f"{r['module'][:44]:44s} {r['kernels']:8d} {r['us'] / 1e3:8.2f}  {r['top']}")
    write_results("train_census", table)
    out = os.environ.get("OUT")
    if out:  # every (source, kernel) pair, most time first: what the table's top names leave out
        pairs: dict[tuple[str, str], list] = {}
        for label, name, us in rows:
            pair = pairs.setdefault((label, name), [0, 0.0])
            pair[0] += 1
            pair[1] += us
        with open(os.path.join(out, "train_census_kernels.json"), "w") as fh:
            json.dump(sorted(([*k, *v] for k, v in pairs.items()), key=lambda r: -r[3]), fh)


def transformers_row(args) -> dict:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    small = preset(args.preset)
    hf_cfg = KimiLinearConfig(
        vocab_size=small.vocab_size, hidden_size=small.hidden_size, num_hidden_layers=small.num_hidden_layers,
        intermediate_size=small.intermediate_size, moe_intermediate_size=small.moe_intermediate_size,
        num_attention_heads=small.num_attention_heads, num_key_value_heads=small.num_attention_heads,
        kv_lora_rank=small.kv_lora_rank, q_lora_rank=small.q_lora_rank, linear_num_heads=small.linear_num_heads,
        linear_head_dim=small.linear_head_dim, num_local_experts=small.num_experts,
        num_experts_per_tok=small.num_experts_per_token, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["full_attention" if small.is_mla_layer(i) else "linear_attention"
                     for i in range(small.num_hidden_layers)])
    model = KimiLinearForCausalLM(hf_cfg).to("cuda", torch.bfloat16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, small.vocab_size, (args.batch, args.seq), device="cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    gc.collect()  # openk3's graphs and caches go first: the trainer's hooks make reference cycles
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    sec = time_steps(step, args.steps)
    return {"system": "transformers KimiLinearForCausalLM (same sizes)",
            "tokens_per_s": args.batch * args.seq / sec,
            "peak_GiB": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="RunConfig.compile (default None: on CUDA)")
    ap.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                    help="RunConfig.cuda_graph (default None: on one GPU)")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--profile", action="store_true", help="profile one step (host vs GPU time)")
    ap.add_argument("--census", action="store_true",
                    help="attribute one eager step's kernels to modules' forward/backward and the optimisers")
    args = ap.parse_args()
    print(environment())
    rows = [openk3_row(args)]
    write_results("train_throughput", rows)
    if not args.no_peer:
        rows.append(transformers_row(args))
        rows[-1]["openk3_speedup"] = rows[0]["tokens_per_s"] / rows[-1]["tokens_per_s"]
        write_results("train_throughput", rows)


if __name__ == "__main__":
    main()
