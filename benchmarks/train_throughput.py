"""Training throughput on one GPU: openk3 vs transformers' KimiLinearForCausalLM in the same run.

Measures full training steps (forward, backward, optimiser) of the ``small`` preset in bf16
autocast with fp32 master weights, the loss taken from the forward as the trainer does
(``model(inputs, labels=targets).loss``: fla's fused linear cross-entropy, no ``[B, T, vocab]``
logits; the row names the loss backend) — tokens/s, MFU (formula in docs/training.md) and
peak memory — and, as the peer, a transformers Kimi Linear model of similar activated size
trained with AdamW the way a user would (bf16 weights, its default kernels).

Floor: MFU = tokens/s x FLOPs/token / 989e12. Run on the device:
``python benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10``.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import environment, profile, write_results
from openk3 import build_model, preset
from openk3.ops.loss import auto_backend
from openk3.train.balance import Balancer
from openk3.train.metrics import flops_per_token, peak_flops
from openk3.train.optim import build_optimizers


def time_steps(step, steps: int) -> float:
    step()  # warm-up: autotuning, compilation
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def openk3_row(args) -> dict:
    cfg = preset(args.preset)
    model = build_model(cfg, device="cuda").train()
    opts = build_optimizers(model, lr=1e-3, weight_decay=0.1)
    bal = Balancer("qb", cfg.num_experts, cfg.num_experts_per_token).attach(model)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        bal.update()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    sec = time_steps(step, args.steps)
    tok_s = args.batch * args.seq / sec
    mfu = tok_s * flops_per_token(cfg, args.seq) / peak_flops(torch.device("cuda"), torch.bfloat16)
    row = {"system": f"openk3 {args.preset}", "loss_backend": auto_backend(ids),
           "tokens_per_s": tok_s, "mfu": mfu,
           "peak_GiB": torch.cuda.max_memory_allocated() / 2**30}
    if args.profile:  # where the step's time goes (issue 3: the top costs when short of 35% MFU)
        row.update(profile(step, "openk3 training step"))
    return row


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
    ap.add_argument("--profile", action="store_true", help="profile one step (host vs GPU time)")
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
