"""The openk3 command: params, generate, train, serve, rl, distill, eval, plot."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import types
import typing

from openk3.checkpoint.hf import EXPERTS_MODES
from openk3.config import PRESETS, preset
from openk3.runtime import DTYPES, checkpoint_dir, load_model, model_tokenizer, resolve_device
from openk3.serve.config import GRACE_SECONDS, EngineConfig, check_grace
from openk3.train.config import RunConfig, resolve_run_config


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


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """Which model to load and where: the arguments of ``openk3.runtime.load_model``."""
    p.add_argument("--checkpoint", help="HF checkpoint directory, or a training run (its export)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="model preset for --random-init (default debug)")
    p.add_argument("--random-init", action="store_true", help="use random weights of --preset")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--experts", default="dequantize", choices=EXPERTS_MODES,
                   help="routed experts: 'dequantize' to the model dtype (default), or keep them "
                        "'packed' as MXFP4 (4.25 bits per weight, kernels that dequantise in "
                        "registers; quantises unpacked experts on load; docs/mxfp4.md)")
    p.add_argument("--tokenizer", default=None, metavar="DIR|bytes",
                   help="a directory with tokenizer.json or tiktoken.model, or 'bytes' for raw UTF-8 "
                        "(default: the checkpoint's own; with --random-init, one whose every id is visible)")


def _preset_name(args: argparse.Namespace) -> str | None:
    return args.preset or ("debug" if args.random_init else None)


def _load_model(args: argparse.Namespace):
    """``load_model`` from the flags of ``_add_model_flags`` (random weights: seed 0)."""
    return load_model(args.checkpoint, _preset_name(args), args.random_init, args.device, args.dtype, 0,
                      args.tokenizer, args.experts)


def cmd_generate(args: argparse.Namespace) -> int:
    from openk3.generate import generate

    if args.max_new_tokens < 1:
        print(f"openk3 generate: --max-new-tokens {args.max_new_tokens} must be >= 1", file=sys.stderr)
        return 2
    from openk3.serve.sampler import InvalidRequest, SamplingParams

    try:  # the sampling flags, checked before anything loads or the prompt is echoed
        SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    except InvalidRequest as e:
        print(f"openk3 generate: --{e.param.replace('_', '-')} {e.message}", file=sys.stderr)
        return 2
    if args.draft and not args.num_speculative_tokens:
        print("openk3 generate: --draft needs --num-speculative-tokens K (K >= 1)", file=sys.stderr)
        return 2
    model, tok, _ = _load_model(args)  # random weights of seed 0 whatever --seed (which samples)
    device = next(model.parameters()).device
    ids = tok.encode(args.prompt)
    images = None
    if args.image:
        from openk3.serve.multimodal import special_token_id
        from openk3.vision.preprocess import image_prompt_ids, load_image, pack_images

        if model.cfg.vision_config is None:
            print("openk3 generate: --image needs a model with a vision tower", file=sys.stderr)
            return 2
        pics = [load_image(p) for p in args.image]
        images = pack_images(pics, model.cfg.vision_config)
        special = functools.partial(special_token_id, tok)
        bos = [model.cfg.bos_token_id] if model.cfg.bos_token_id is not None else []
        ids = bos + image_prompt_ids(special, tok.encode, [p.size for p in pics],
                                     images.tokens_per_image(model.cfg.vision_config),
                                     model.cfg.vision_config.media_placeholder_token_id) + ids
    if not ids:
        print("openk3 generate: --prompt is empty after tokenisation", file=sys.stderr)
        return 2
    too_big = [i for i in ids if i >= model.cfg.vocab_size]
    if too_big:
        print(f"openk3 generate: token ids {too_big[:5]} exceed the model's vocab_size "
              f"{model.cfg.vocab_size}", file=sys.stderr)
        return 2
    print(args.prompt, end="", flush=True)
    if args.num_speculative_tokens:
        if images is not None:
            print("openk3 generate: --image with speculative decoding is not supported",
                  file=sys.stderr)
            return 2
        return _generate_speculative(args, model, tok, ids)
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
             seed=args.seed, eos_token_id=model.cfg.eos_token_id, on_token=stream, images=images)
    dt = time.perf_counter() - t0
    print(tok.decode(new)[len(shown):], end="", flush=True)  # a tail held back as an incomplete character
    print(f"\n[{len(new)} tokens in {dt:.2f}s, {len(new) / max(dt, 1e-9):.1f} tok/s on {device}]",
          file=sys.stderr)
    return 0


def _generate_speculative(args: argparse.Namespace, model, tok, ids: list[int]) -> int:
    """``generate`` with a draft model: through the serving engine, which verifies
    ``--num-speculative-tokens`` draft tokens per step (docs/speculative.md)."""
    from openk3.serve.engine import LLMEngine
    from openk3.serve.sampler import SamplingParams

    if args.draft is None:
        print("openk3 generate: --num-speculative-tokens needs --draft DIR", file=sys.stderr)
        return 2
    config = EngineConfig(max_num_seqs=1, max_model_len=len(ids) + args.max_new_tokens,
                          num_speculative_tokens=args.num_speculative_tokens, draft=args.draft)
    engine = LLMEngine(model, tok, config)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_new_tokens)
    t0, n = time.perf_counter(), 0
    engine.add_request(ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            print(out.delta_text, end="", flush=True)
            n = len(out.token_ids)
    dt, s = time.perf_counter() - t0, engine.stats
    print(f"\n[{n} tokens in {dt:.2f}s, {n / max(dt, 1e-9):.1f} tok/s on {engine.runner.device}; "
          f"draft acceptance {s.spec_acceptance_rate:.0%}, {s.spec_mean_accepted_tokens:.2f} accepted "
          f"per step]", file=sys.stderr)
    return 0


def _add_config_flags(p: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the config dataclass ``cls``, spelled like the field
    (``--max-steps`` sets ``max_steps``); a bool gets ``--x`` / ``--no-x``, a tuple takes several
    values, a dict takes JSON. A flag left out is None: the config's (or the preset's) value stays."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        kw = {"dest": f.name, "default": None, "help": f"{cls.__name__}.{f.name} (default {default})"}
        t = hints[f.name]
        if typing.get_origin(t) in (typing.Union, types.UnionType):  # X | None
            t = next(a for a in typing.get_args(t) if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        if t is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif typing.get_origin(t) in (tuple, list):
            p.add_argument(flag, nargs="+", type=typing.get_args(t)[0], **kw)
        elif t is dict:
            p.add_argument(flag, type=json.loads, metavar="JSON", **kw)
        else:
            p.add_argument(flag, type=t, **kw)


def _config_flags_given(args: argparse.Namespace, cls: type) -> dict:
    """The fields of ``cls`` whose flags were given (see ``_add_config_flags``)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name) is not None}


def cmd_train(args: argparse.Namespace) -> int:
    from openk3.train.trainer import TrainingDiverged, train

    cfg, notices = resolve_run_config(_config_flags_given(args, RunConfig))
    if os.environ.get("RANK", "0") == "0":
        for notice in notices:
            print(f"openk3 train: {notice}", file=sys.stderr)
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


def cmd_train_draft(args: argparse.Namespace) -> int:
    from openk3.train.draft import DraftRunConfig, train_draft

    from openk3.train.trainer import TrainingDiverged

    cfg = DraftRunConfig(**_config_flags_given(args, DraftRunConfig))
    try:
        summary = train_draft(cfg)
    except TrainingDiverged as e:
        print(f"openk3 train-draft: {e}", file=sys.stderr)
        return 1
    first, last = summary["alphas"][0], summary["alphas"][-1]
    print(f"openk3 train-draft: {len(summary['alphas'])} steps, acceptance per depth "
          f"{' '.join(f'{a:.3f}' for a in first)} -> {' '.join(f'{a:.3f}' for a in last)}; "
          f"draft in {cfg.out}", file=sys.stderr)
    return 0


def cmd_rl(args: argparse.Namespace, defaults: dict | None = None) -> int:
    """``openk3 rl`` and, with ``DISTILL_DEFAULTS``, ``openk3 distill`` (docs/posttraining.md)."""
    from openk3.posttrain.config import PostTrainConfig, resolve_posttrain_config
    from openk3.posttrain.plot import plot_posttrain
    from openk3.posttrain.rl import run
    from openk3.train.trainer import TrainingDiverged

    cfg = resolve_posttrain_config(_config_flags_given(args, PostTrainConfig), defaults)
    if defaults is not None and not cfg.teacher:
        raise ValueError("--teacher DOMAIN:EFFORT=PATH: distillation needs at least one teacher")
    try:
        summary = run(cfg)
    except TrainingDiverged as e:
        print(f"openk3 {args.command}: {e}", file=sys.stderr)
        return 1
    plot_posttrain(cfg.out)
    if summary["rewards"]:
        print(f"openk3 {args.command}: steps {summary['start_step']}..{summary['end_step']}, reward "
              f"{summary['rewards'][0]:.3f} -> {summary['rewards'][-1]:.3f}, accuracy {summary['accuracies'][0]:.3f} "
              f"-> {summary['accuracies'][-1]:.3f}; run in {cfg.out} (plots in {cfg.out}/plots)", file=sys.stderr)
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from openk3.posttrain.config import DISTILL_DEFAULTS

    return cmd_rl(args, DISTILL_DEFAULTS)


def cmd_eval(args: argparse.Namespace) -> int:
    """``openk3 eval``: task accuracy on held-out problems (``openk3.posttrain.evaluate``)."""
    from openk3.posttrain.config import EvalConfig
    from openk3.posttrain.evaluate import evaluate, format_table

    cfg = EvalConfig(**_config_flags_given(args, EvalConfig))
    report = evaluate(cfg)
    print(f"openk3 eval: {cfg.checkpoint}, {cfg.num_problems} held-out problems per task (seed {cfg.seed}), "
          f"temperature {cfg.temperature}, {report['seconds']:.1f} s" + (f"; results in {cfg.out}" if cfg.out else ""),
          file=sys.stderr)
    print(format_table(report))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from openk3.posttrain.plot import plot_posttrain
    from openk3.train.metrics import read_metrics
    from openk3.train.plot import plot_run

    paths = plot_run(args.run_dir, args.out)
    if any("reward" in row for row in read_metrics(args.run_dir)):  # an rl / distill run
        paths += plot_posttrain(args.run_dir, args.out)
    for path in paths:
        print(path)
    return 0


def _serve_engine(args: argparse.Namespace):
    """``openk3 serve``'s engine, built where it will run (the engine process by default)."""
    from openk3.serve.engine import LLMEngine

    model, tok, name = _load_model(args)
    config = EngineConfig(**_config_flags_given(args, EngineConfig))
    engine = LLMEngine(model, tok, config, model_name=args.served_model_name or name)
    cache = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in engine.runner.cache_bytes().items())
    print(f"openk3 serve: {engine.model_name} on {engine.runner.device}, context {engine.max_model_len} tokens, "
          f"{config.max_num_seqs} sequences at once; cache: {cache}", file=sys.stderr)
    decode, prefill = engine.runner.graph_sizes()
    if decode or prefill:  # no request should wait for a capture
        start = time.perf_counter()
        print(f"openk3 serve: capturing CUDA graphs: decode batches {decode[0]}..{decode[-1]}"
              + (f", prefill passes of {prefill[0]}..{prefill[-1]} tokens" if prefill else "")
              + (", the verify pass and the draft's chains of each batch" if engine.drafter is not None else ""),
              file=sys.stderr, flush=True)
        engine.capture_graphs()
        print(f"openk3 serve: CUDA graphs captured in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return engine


# ``openk3 serve``'s server processes on a GPU: 64 streams of `small` on an H200 came within 1.10x
# of the engine with 4 (1.085-1.097x, the official openai client), 1.12-1.18x with 1, 1.14x
# with 8 (docs/benchmarks.md, twenty-ninth session)
DEFAULT_GPU_API_SERVERS = 4


def cmd_serve(args: argparse.Namespace) -> int:
    from openk3.serve.chat import ChatTemplate
    from openk3.serve.server import serve

    api_key = args.api_key or os.environ.get("OPENK3_API_KEY")
    # a --tokenizer DIR's template first: the checkpoint's tokenizer (and template) is replaced
    sources = [args.tokenizer] if args.tokenizer not in (None, "bytes") else []
    sources += [checkpoint_dir(args.checkpoint)] if args.checkpoint else []
    chat_template = ChatTemplate.from_checkpoint(*sources) if sources else None
    if args.api_servers is None:  # several server processes where the engine's steps are fast
        gpu = args.engine == "process" and resolve_device(args.device).type == "cuda"
        args.api_servers = DEFAULT_GPU_API_SERVERS if gpu else 1
    try:
        check_grace(args.shutdown_grace)
    except ValueError:
        print(f"openk3 serve: --shutdown-grace {args.shutdown_grace} must be >= 1 and finite (responses in "
              "flight get it less one second)", file=sys.stderr)
        return 2
    if args.api_servers < 1:
        print(f"openk3 serve: --api-servers {args.api_servers} must be >= 1", file=sys.stderr)
        return 2
    if args.api_servers > 1 and args.engine != "process":
        print("openk3 serve: --api-servers above 1 needs --engine process", file=sys.stderr)
        return 2
    if args.engine == "process":
        from openk3.serve.engine_process import ProcessEngine

        # bad model flags fail here at once, not after the engine process has imported torch
        model_tokenizer(args.checkpoint, _preset_name(args), args.random_init, args.tokenizer, args.experts)
        factory = functools.partial(_serve_engine, args)
        try:  # the engine's ValueErrors (config, checkpoint) are raised here as they were there
            if args.api_servers > 1:
                from openk3.serve.api_servers import ApiServers, bound_socket

                sock = bound_socket(args.host, args.port)  # a port in use fails before the model loads
                servers = ApiServers(factory, args.api_servers, sock, api_key=api_key, chat_template=chat_template,
                                     grace=args.shutdown_grace)
            else:
                async_engine = ProcessEngine(factory)
        except (RuntimeError, OSError) as e:
            print(f"openk3 serve: {e}", file=sys.stderr)
            return 1
        if args.api_servers > 1:
            if not servers.stopping:
                print(f"openk3 serve: {args.api_servers} API server processes on http://{args.host}:{args.port}",
                      file=sys.stderr, flush=True)
            return servers.run()
    else:
        from openk3.serve.engine import AsyncEngine

        async_engine = AsyncEngine(_serve_engine(args))
    serve(async_engine, async_engine.model_name, host=args.host, port=args.port, api_key=api_key,
          chat_template=chat_template, grace=args.shutdown_grace)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="openk3", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("params", help="count total and activated parameters of a preset")
    p.add_argument("--preset", default="k3", choices=sorted(PRESETS))
    p.add_argument("--json", action="store_true", help="print {'total', 'active', 'breakdown'}")
    p.set_defaults(fn=cmd_params)

    g = sub.add_parser("generate", help="generate text from a checkpoint or a random-init preset")
    _add_model_flags(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image placed before the prompt (repeatable; needs a vision tower)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--draft", default=None, metavar="DIR",
                   help="draft for speculative decoding: a draft model directory (shares the tokenizer), "
                        "an EAGLE-3 draft directory (openk3 train-draft) or 'mtp' (the target's MTP layer)")
    g.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="draft tokens verified per step (needs --draft; 0: off)")
    g.set_defaults(fn=cmd_generate)

    t = sub.add_parser("train", help="train a model (torchrun for several processes)")
    _add_config_flags(t, RunConfig)
    t.set_defaults(fn=cmd_train)

    from openk3.train.draft import DraftRunConfig

    td = sub.add_parser("train-draft", help="train an EAGLE-3 draft against a frozen target "
                                            "(docs/speculative.md)")
    _add_config_flags(td, DraftRunConfig)
    td.set_defaults(fn=cmd_train_draft)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (docs/serving.md)")
    _add_model_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $OPENK3_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: checkpoint directory name, or openk3-PRESET)")
    s.add_argument("--engine", choices=("process", "thread"), default="process",
                   help="process: the engine steps in a process of its own, the HTTP server's event loop "
                        "in this one (no shared interpreter lock); thread: both in this process")
    s.add_argument("--api-servers", type=int, default=None, metavar="N",
                   help="HTTP server processes in front of the engine process, sharing the port: a "
                        f"burst of requests is admitted N at a time (default: {DEFAULT_GPU_API_SERVERS} "
                        "with the engine process on a GPU, else 1; docs/serving.md)")
    s.add_argument("--shutdown-grace", type=float, default=GRACE_SECONDS, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, responses in flight get this less one second to finish, "
                        "then end with an error event; the server exits by then (>= 1; default %(default)s)")
    _add_config_flags(s, EngineConfig)
    s.set_defaults(fn=cmd_serve)

    from openk3.posttrain.config import DISTILL_DEFAULTS, EvalConfig, PostTrainConfig

    r = sub.add_parser("rl", help="RL on verifiable tasks with rollouts from the serving engine "
                                  "(docs/posttraining.md)")
    _add_config_flags(r, PostTrainConfig)
    r.set_defaults(fn=cmd_rl)
    d = sub.add_parser("distill", help="multi-teacher on-policy distillation (MOPD): --teacher "
                                       f"DOMAIN:EFFORT=PATH ...; defaults as rl but {DISTILL_DEFAULTS}")
    _add_config_flags(d, PostTrainConfig)
    d.set_defaults(fn=cmd_distill)
    e = sub.add_parser("eval", help="task accuracy of a checkpoint on held-out problems, generated by the "
                                    "serving engine and scored by the task's verifier (docs/posttraining.md)")
    _add_config_flags(e, EvalConfig)
    e.set_defaults(fn=cmd_eval)

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
