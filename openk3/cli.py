"""The ``openk3`` command: ``params``, ``generate``."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from openk3.config import PRESETS, preset


def _fmt(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def cmd_params(args: argparse.Namespace) -> int:
    from openk3.params import count_parameters

    r = count_parameters(preset(args.preset))
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"preset {args.preset}: total {_fmt(r['total'])} ({r['total']:,}), "
          f"active per token {_fmt(r['active'])} ({r['active']:,})")
    for comp, n in sorted(r["breakdown"].items(), key=lambda kv: -kv[1]):
        print(f"  {comp:<20} {_fmt(n):>9}  {100 * n / r['total']:5.1f}%")
    return 0


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cmd_generate(args: argparse.Namespace) -> int:
    from openk3.generate import generate
    from openk3.tokenizer import load_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    if args.checkpoint:
        from openk3.checkpoint import load_pretrained

        model = load_pretrained(args.checkpoint, dtype=dtype, device=device)
        tok = load_tokenizer(args.checkpoint)
    elif args.random_init:
        from openk3.model import build_model

        model = build_model(preset(args.preset), device=device, dtype=dtype, seed=args.seed or 0).eval()
        tok = load_tokenizer(None)
    else:
        print("openk3 generate: give --checkpoint DIR, or --preset NAME --random-init", file=sys.stderr)
        return 2
    ids = tok.encode(args.prompt)
    if not ids:
        print("openk3 generate: --prompt is empty after tokenisation", file=sys.stderr)
        return 2
    too_big = [i for i in ids if i >= model.cfg.vocab_size]
    if too_big:
        print(f"openk3 generate: token ids {too_big[:5]} exceed the model's vocab_size "
              f"{model.cfg.vocab_size}", file=sys.stderr)
        return 2
    print(args.prompt, end="", flush=True)
    new: list[int] = []
    shown = ""

    def stream(t: int) -> None:  # decode the whole tail so multi-byte characters print whole
        nonlocal shown
        new.append(t)
        text = tok.decode(new)
        if not text.endswith("\ufffd"):
            print(text[len(shown):], end="", flush=True)
            shown = text

    t0 = time.perf_counter()
    generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
             seed=args.seed, eos_token_id=model.cfg.eos_token_id, on_token=stream)
    dt = time.perf_counter() - t0
    print(f"\n[{len(new)} tokens in {dt:.2f}s, {len(new) / max(dt, 1e-9):.1f} tok/s on {device}]",
          file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="openk3", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("params", help="count total and activated parameters of a preset")
    p.add_argument("--preset", default="k3", choices=sorted(PRESETS))
    p.add_argument("--json", action="store_true", help="print {'total', 'active', 'breakdown'}")
    p.set_defaults(fn=cmd_params)

    g = sub.add_parser("generate", help="generate text from a checkpoint or a random-init preset")
    g.add_argument("--checkpoint", help="HF checkpoint directory (kimi_k3 or kimi_linear)")
    g.add_argument("--preset", default="debug", choices=sorted(PRESETS))
    g.add_argument("--random-init", action="store_true", help="use random weights of --preset")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=sorted(_DTYPES))
    g.set_defaults(fn=cmd_generate)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:  # config, checkpoint and argument errors: one clear line
        print(f"openk3 {args.command}: error: {e}", file=sys.stderr)
        return 2
