"""The ``openk3`` command: ``params``, ``generate``, ``train``, ``serve``, ``plot``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import typing
from pathlib import Path

import torch

from openk3.config import PRESETS, preset
from openk3.train.config import RunConfig, run_preset


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

        ckpt_dir = Path(args.checkpoint)
        if (ckpt_dir / "run_config.json").exists():  # a training run: use its export
            ckpt_dir = ckpt_dir / "export"
        model = load_pretrained(ckpt_dir, dtype=dtype, device=device)
        tok = load_tokenizer(ckpt_dir)
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


def _add_run_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per RunConfig field, same name (``--max-steps`` is ``max_steps``); a flag left
    out keeps the preset's (or, with --resume, the run's) value."""
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = f"RunConfig.{f.name} (default {f.default if f.default is not dataclasses.MISSING else '{}'})"
        t = hints[f.name]
        if t is bool:
            p.add_argument(flag, dest=f.name, action="store_true", default=None, help=help_)
        elif f.name == "data":
            p.add_argument(flag, dest=f.name, nargs="+", default=None, metavar="PATH", help=help_)
        elif f.name == "model_overrides":
            p.add_argument(flag, dest=f.name, type=json.loads, default=None, metavar="JSON", help=help_)
        else:
            base = next((a for a in typing.get_args(t) if a is not type(None)), t)
            p.add_argument(flag, dest=f.name, type=base, default=None, help=help_)


def cmd_train(args: argparse.Namespace) -> int:
    from openk3.train.trainer import TrainingDiverged, train

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig)
             if getattr(args, f.name) is not None}
    name = given.pop("preset", "debug")
    cfg = run_preset(name, **given)
    saved = Path(cfg.out) / "run_config.json"
    if cfg.resume and saved.exists():  # continue the run as it was configured
        prev = json.loads(saved.read_text())["run"]
        cfg = RunConfig.from_dict({**prev, **given, "resume": True})
    try:
        summary = train(cfg)
    except TrainingDiverged as e:
        print(f"openk3 train: {e}", file=sys.stderr)
        return 1
    if summary.get("first_loss") is not None and os.environ.get("RANK", "0") == "0":
        print(f"openk3 train: steps {summary['start_step']}..{summary['end_step']}, loss "
              f"{summary['first_loss']:.3f} -> {summary['last_loss']:.3f}; run in {cfg.out}",
              file=sys.stderr)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from openk3.train.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from openk3.serve.chat import ChatTemplate
    from openk3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
    from openk3.serve.llm import load_model
    from openk3.serve.server import serve

    if not args.checkpoint and not args.random_init:
        print("openk3 serve: give --checkpoint DIR, or --preset NAME --random-init", file=sys.stderr)
        return 2
    ckpt_dir = Path(args.checkpoint) if args.checkpoint else None
    if ckpt_dir is not None and (ckpt_dir / "run_config.json").exists():  # a training run: use its export
        ckpt_dir = ckpt_dir / "export"
    model, tok, name = load_model(ckpt_dir, None if ckpt_dir else args.preset, args.random_init, args.device,
                                  _DTYPES[args.dtype] if args.dtype else None)
    if args.checkpoint:
        name = Path(args.checkpoint).resolve().name
    given = {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}
    config = EngineConfig(**{k: v for k, v in given.items() if v is not None},
                          enable_prefix_caching=not args.no_prefix_caching)
    engine = LLMEngine(model, tok, config, model_name=args.served_model_name or name)
    cache = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in engine.runner.cache_bytes().items())
    print(f"openk3 serve: {engine.model_name} on {engine.runner.device}, context {engine.max_model_len} tokens, "
          f"{config.max_num_seqs} sequences at once; cache: {cache}", file=sys.stderr)
    serve(AsyncEngine(engine), engine.model_name, host=args.host, port=args.port,
          api_key=args.api_key or os.environ.get("OPENK3_API_KEY"),
          chat_template=ChatTemplate.from_checkpoint(ckpt_dir) if ckpt_dir else None)
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

    t = sub.add_parser("train", help="train a model (torchrun for several processes)")
    _add_run_config_flags(t)
    t.set_defaults(fn=cmd_train)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (docs/serving.md)")
    s.add_argument("--checkpoint", help="HF checkpoint directory, or a training run (its export)")
    s.add_argument("--preset", default="debug", choices=sorted(PRESETS))
    s.add_argument("--random-init", action="store_true", help="serve random weights of --preset")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $OPENK3_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: checkpoint directory name, or openk3-PRESET)")
    s.add_argument("--max-num-seqs", type=int, default=None, help="EngineConfig.max_num_seqs")
    s.add_argument("--max-model-len", type=int, default=None, help="EngineConfig.max_model_len")
    s.add_argument("--no-prefix-caching", action="store_true", help="EngineConfig.enable_prefix_caching=False")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    s.add_argument("--dtype", default=None, choices=sorted(_DTYPES))
    s.set_defaults(fn=cmd_serve)

    pl = sub.add_parser("plot", help="write PNG charts of a run's metrics")
    pl.add_argument("run_dir")
    pl.add_argument("--out", default=None, help="output directory (default RUN_DIR/plots)")
    pl.set_defaults(fn=cmd_plot)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:  # config, checkpoint and argument errors: one clear line
        print(f"openk3 {args.command}: error: {e}", file=sys.stderr)
        return 2
