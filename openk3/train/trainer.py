"""The training loop behind ``openk3 train``.

One process per device. Under ``torchrun`` the process group is initialised here; the parallel
layout (FSDP2, MoonEP) is applied from outside the model by ``openk3.parallel.parallelize``, whose
``Parallel`` answers every layout-dependent question (gradient reduction, clipping, state dicts,
the exported model), so this loop reads the same for one process or many.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from openk3.config import ModelConfig
from openk3.model import build_model
from openk3.model.moe import set_qat
from openk3.parallel.collectives import barrier, main_rank_first, mean_over_ranks
from openk3.parallel.parallelize import Parallel, parallelize
from openk3.runtime import resolve_device, resolve_dtype
from openk3.train.config import RUN_CONFIG_FILE, RunConfig
from openk3.train import state as ckpt
from openk3.train.balance import Balancer
from openk3.train.data import BOS_TOKEN, PAD_TOKEN, prepare_data
from openk3.train.stream import TokenStream, num_tokens, val_batches
from openk3.train.metrics import MetricsLog, Progress, flops_per_token, peak_flops
from openk3.train.optim import LRSchedule, Muon, build_optimizers, set_lr


class TrainingDiverged(RuntimeError):
    """A non-finite loss: the run stops, the last good checkpoint stays as it was."""


@dataclass
class Env:
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_env(cfg: RunConfig) -> Env:
    """Device, dtype and (under torchrun) the process group: NCCL on GPUs, gloo on CPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        device = resolve_device(cfg.device)
    except ValueError as e:
        raise ValueError(f"RunConfig.{e}") from None
    if device.type == "cuda":  # one GPU per process: torchrun's LOCAL_RANK
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # device_id binds the NCCL communicator to this process's GPU (no guess from the rank)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return Env(rank, world, device, resolve_dtype(cfg.dtype, device))


def _log(env: Env, msg: str) -> None:
    if env.is_main:
        print(msg, file=sys.stderr, flush=True)


class StopFlag:
    """Ctrl-C sets a flag; the loop saves a checkpoint after the current step and exits.
    ``prog`` names the command in the message (``openk3 train``, ``openk3 rl``, ...)."""

    def __init__(self, prog: str = "openk3 train") -> None:
        self.prog = prog
        self.stop = False

    def __enter__(self):
        self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_) -> None:
        if self.stop:  # a second Ctrl-C: give up at once
            raise KeyboardInterrupt
        self.stop = True
        print(f"\n{self.prog}: interrupted, saving a checkpoint after this step "
              "(Ctrl-C again to abort)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._old)


class _ActivationProbe:
    """max |p| after each decoder layer in training forwards, recorded only on logging steps
    (``persistent``: on every step, and kept after reading: graphed steps run the hooks at
    capture only, and each replay refreshes the tensors they recorded)."""

    def __init__(self, model) -> None:
        self.values: dict[int, torch.Tensor] = {}
        self.active = False
        self.persistent = False
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, _inputs, output):
            if self.active and module.training:  # never evaluation's forwards
                self.values[i] = output.detach().abs().max().float()
        return hook

    def read(self) -> list[float]:
        out = [float(self.values[i]) for i in sorted(self.values)]
        if not self.persistent:
            self.values.clear()
        return out


@torch.no_grad()
def evaluate(model, data, cfg: RunConfig, env: Env, parallel: Parallel | None = None) -> float:
    """Mean validation loss; with ``parallel``, each batch is split as training splits it."""
    model.eval()
    total, n = torch.zeros((), device=env.device), 0
    for inputs, targets in val_batches(data.val_path, data.dtype, cfg.seq_len, cfg.batch_size,
                                       cfg.eval_batches):
        inputs, targets = inputs.to(env.device), targets.to(env.device)
        if parallel is not None:
            inputs, targets = parallel.shard_sequence(inputs, targets)
        total += model(inputs, labels=targets).loss
        n += 1
    model.train()
    return (mean_over_ranks(total) / max(n, 1)).item()


def _oom_message(cfg: RunConfig) -> str:
    return (f"out of memory with preset={cfg.preset!r}, batch_size={cfg.batch_size}, "
            f"seq_len={cfg.seq_len}, grad_accum={cfg.grad_accum}: lower batch_size or seq_len "
            "(raise grad_accum to keep the tokens per step), or choose a smaller preset")


@dataclass
class Training:
    """The pieces one optimisation step needs, built once by ``build_training``."""

    env: Env
    model: torch.nn.Module
    parallel: Parallel
    optimizers: list
    balancer: Balancer
    autocast: Callable[[], AbstractContextManager]


def build_training(cfg: RunConfig, env: Env, model_cfg: ModelConfig) -> Training:
    """The model (fp32 master weights on ``env.device``, routed experts quantisation-aware when
    ``cfg.qat`` says so), its parallel layout (FSDP2, MoonEP, compilation, activation
    checkpointing: ``openk3.parallel.parallelize``), the optimisers and the router balancer, as
    ``train`` uses them (and ``benchmarks/train_throughput.py``)."""
    torch.manual_seed(cfg.seed)
    # fp32 master weights; bf16 compute comes from autocast (one device) or FSDP's policy
    model = build_model(model_cfg, device=env.device, seed=cfg.seed)
    set_qat(model, cfg.qat)  # before parallelize: MoonEP's expert shares copy it
    model.train()
    parallel = parallelize(model, env, ep=cfg.ep, compile=cfg.compile,
                           activation_checkpointing=cfg.activation_checkpointing, cp=cfg.cp,
                           ep_replicate=cfg.ep_replicate)
    optimizers = build_optimizers(model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  optimizer=cfg.optimizer)
    balancer = Balancer(cfg.balance, model_cfg.num_experts,
                        model_cfg.num_experts_per_token).attach(model)
    use_amp = env.device.type == "cuda" and env.dtype != torch.float32
    autocast = (lambda: torch.autocast("cuda", dtype=env.dtype)) if use_amp else nullcontext
    return Training(env, model, parallel, optimizers, balancer, autocast)


def step_function(t: Training, cfg: RunConfig, probe: _ActivationProbe | None = None) -> Callable:
    """``batches -> train_step(t, batches, cfg)``, as CUDA graphs where ``cfg.cuda_graph`` asks
    for them and they apply (``openk3.train.graphed``; the activation probe then records on
    every step, inside the graph). AdamW's capturable mode follows the choice, whatever a
    resumed checkpoint's param groups say. Call it after loading a checkpoint. On CUDA it says
    which it chose, and why."""
    from openk3.train import graphed

    reason = graphed.unsupported_reason(t, cfg)
    if cfg.cuda_graph and reason is not None:
        raise ValueError(f"RunConfig.cuda_graph=True: {reason}")
    if cfg.cuda_graph is False or reason is not None:
        if t.env.device.type == "cuda":
            _log(t.env, f"steps: eager ({reason or '--no-cuda-graph'})")
        graphed.set_capturable(t.optimizers, False)
        return lambda batches: train_step(t, batches, cfg)
    _log(t.env, "steps: CUDA graphs from the second step at each sequence length (--no-cuda-graph: eager)")
    if probe is not None:
        probe.persistent = True
    return graphed.GraphedTrainStep(t, cfg, strict=bool(cfg.cuda_graph), log=lambda m: _log(t.env, m))


def _finite(loss: float, mtp_loss: float | None) -> bool:
    return math.isfinite(loss) and (mtp_loss is None or math.isfinite(mtp_loss))


def train_step(t: Training, batches: Iterable[tuple], cfg: RunConfig) -> tuple[float, torch.Tensor, float | None]:
    """One optimisation step over ``cfg.grad_accum`` micro-batches ``(inputs, targets)`` [B, T]
    (or ``(inputs, targets, images)``, ``openk3.vision.preprocess.PackedImages``):
    forward (the loss comes out of the model: no [B, T, vocab] logits), backward, balancer
    update after each micro-batch, gradient reduction and clipping, the optimiser steps.

    The loss differentiated is ``loss + aux_loss_coef * aux + mtp_loss_weight * mtp_loss``
    (aux: the balancer's auxiliary loss, 0 unless ``balance="aux"``; mtp_loss with an MTP
    layer only). Returns (the loss without its MTP term, the gradient norm, the MTP loss or
    None without an MTP layer); the losses are averaged over micro-batches and ranks."""
    sums = torch.zeros(2, device=t.env.device)  # [loss (+ aux term), MTP loss]
    has_mtp = False
    for inputs, targets, *images in batches:
        inputs, targets = t.parallel.shard_sequence(inputs.to(t.env.device),
                                                    targets.to(t.env.device))
        extra = {"images": images[0].to(t.env.device)} if images else {}
        has_mtp = micro_step(t, inputs, targets, sums, cfg, **extra)
    loss_f, mtp_f = mean_over_ranks(sums / cfg.grad_accum).tolist()  # one host sync
    mtp_f = mtp_f if has_mtp else None
    if not _finite(loss_f, mtp_f):
        return loss_f, torch.full((), float("nan")), mtp_f  # the caller stops before the update
    return loss_f, update_step(t, cfg), mtp_f


def micro_step(t: Training, inputs: torch.Tensor, targets: torch.Tensor, sums: torch.Tensor,
               cfg: RunConfig, **extra) -> bool:
    """Forward and backward of one micro-batch (on the device, already sharded), then the
    balancer's update; adds its loss and MTP loss into ``sums`` [2] without a host sync.
    Returns whether the model has an MTP loss."""
    with t.autocast():
        out = t.model(inputs, labels=targets, **extra)
    sums[0] += out.loss.detach()  # the logged loss is the next-token loss alone (docs/training.md)
    loss = out.loss + cfg.aux_loss_coef * t.balancer.aux_loss()
    if out.mtp_loss is not None:
        loss = loss + cfg.mtp_loss_weight * out.mtp_loss
        sums[1] += out.mtp_loss.detach()
    (loss / cfg.grad_accum).backward()
    t.balancer.update()  # biases for the *next* batch; never re-route this one
    return out.mtp_loss is not None


def update_step(t: Training, cfg: RunConfig, *, keep_grads: bool = False) -> torch.Tensor:
    """Gradient reduction and clipping, every optimiser's step, gradients freed; returns the
    gradient norm before clipping (a 0-dim tensor, no host sync). ``keep_grads``: leave the
    gradient tensors as they are (the graphed step's first micro-batch overwrites them)."""
    t.parallel.reduce_gradients()
    # Muon applies the clipping coefficient in its momentum pass (where the layout allows):
    # one pass over its gradients fewer
    muon = [opt for opt in t.optimizers if isinstance(opt, Muon)]
    grad_norm, coef = t.parallel.clip_grads_(cfg.clip_grad if cfg.clip_grad > 0 else 1e30,
                                             unscaled=[p for opt in muon for g in opt.param_groups
                                                       for p in g["params"]])
    for opt in t.optimizers:
        if coef is not None and opt in muon:
            opt.step(grad_scale=coef)
        else:
            opt.step()
        if not keep_grads:
            opt.zero_grad(set_to_none=True)
    return grad_norm


def train(cfg: RunConfig) -> dict:
    """Run (or resume) a training run; returns a summary dict. See ``openk3 train --help``.
    A model with a vision tower trains on the synthetic image-text corpus instead
    (``openk3.vision.train``)."""
    if cfg.model_config().vision_config is not None:
        from openk3.vision.train import train_vl

        return train_vl(cfg)
    env = setup_env(cfg)
    run_dir = Path(cfg.out)
    model_cfg = cfg.model_config()  # validated before anything is allocated
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.remove_partial_saves(run_dir)
    prev = ckpt.latest_checkpoint(run_dir) if cfg.resume else None
    if cfg.resume and prev is None:
        _log(env, f"--resume: no checkpoint in {run_dir}, starting a new run")
    if not cfg.resume and ckpt.latest_checkpoint(run_dir) is not None:
        raise ValueError(f"{run_dir} already holds a run; pass --resume to continue it or choose "
                         "another --out")

    def prepare():
        return prepare_data(list(cfg.data) or None, vocab_size=model_cfg.vocab_size,
                            tokenizer_path=cfg.tokenizer, log=lambda m: _log(env, m))

    data = main_rank_first(prepare)  # rank 0 tokenises; the others then find it in the cache
    if data.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"tokenizer has {data.vocab_size} tokens but the model's vocab_size is "
                         f"{model_cfg.vocab_size}; set --vocab-size {data.vocab_size}")
    val_tokens = num_tokens(data.val_path, data.dtype)
    if val_tokens <= cfg.seq_len:  # the held-out documents are too short (docs/training.md)
        _log(env, f"the validation split ({data.val_path}) has {val_tokens} tokens, less than one window of "
                  f"--seq-len {cfg.seq_len} + 1: no validation loss is reported")

    training = build_training(cfg, env, model_cfg)
    model, parallel, optimizers, balancer = (training.model, training.parallel, training.optimizers,
                                             training.balancer)
    if env.world_size > 1:
        ep = ("" if cfg.ep == 1 else f", expert parallelism {cfg.ep} "
              f"({'MoonEP' if cfg.ep_replicate else 'plain: no replicas'})")
        _log(env, f"layout: {env.world_size} processes, FSDP2 over {parallel.dp_size} data-parallel "
                  f"groups{ep}{'' if cfg.cp == 1 else f', context parallelism {cfg.cp}'}")
    # the ranks of a context-parallel group read the same batch; the stream is opened at the
    # longest length of the run (it checks the data holds a window of it), then follows the schedule
    stream = TokenStream(data.train_path, data.dtype, max(cfg.seq_lens()), cfg.batch_size,
                         seed=cfg.seed, rank=parallel.dp_rank, world_size=parallel.dp_size)
    stream.seq_len = cfg.seq_len_at(1)
    start = 0
    schedule = LRSchedule(cfg.max_steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio)
    if prev is not None:
        state = parallel.state_dict(optimizers)  # the shards this layout wants, filled in place
        trainer_state = ckpt.load_checkpoint(prev, state)
        parallel.load_state_dict(state, optimizers)
        stream.seq_len = cfg.seq_len_at(trainer_state["step"])  # the length it was saved at
        saved, mine = trainer_state["data"].get("global_batch_size"), stream.world_size * stream.batch_size
        if saved is not None and saved != mine:
            per_rank = f"--batch-size {saved // stream.world_size}" if saved % stream.world_size == 0 else \
                f"a number of data-parallel groups that divides {saved}"
            raise ValueError(f"--batch-size {cfg.batch_size} on {stream.world_size} data-parallel group(s) "
                             f"(processes / --cp) is a global batch of "
                             f"{mine} sequences, but {prev} was saved with {saved}: the data stream continues "
                             f"exactly only with the same global batch ({per_rank})")
        stream.load_state_dict(trainer_state["data"])
        start = trainer_state["step"]
        if "lr_schedule" in trainer_state:  # a changed --max-steps continues, never jumps up
            schedule = LRSchedule.from_dict(trainer_state["lr_schedule"]).extended(cfg.max_steps, start)
        _log(env, f"resumed from {prev} at step {start}")
        if schedule.anchor is not None and schedule.anchor[0] == start:
            _log(env, f"--max-steps {cfg.max_steps}: the {cfg.schedule} schedule continues from its "
                      f"current learning rate {cfg.lr * schedule.anchor[1]:.2e} (docs/training.md)")
    if env.is_main:
        (run_dir / RUN_CONFIG_FILE).write_text(json.dumps(
            {"run": cfg.to_dict(), "model": model_cfg.to_dict(), "world_size": env.world_size},
            indent=1))

    def tokens_per_step(step: int) -> int:
        return cfg.batch_size * cfg.seq_len_at(step) * cfg.grad_accum * parallel.dp_size

    peak = peak_flops(env.device, env.dtype) * env.world_size
    metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=env.is_main)
    if env.is_main:  # rows logged after the checkpoint we resume from (all, starting afresh) are redone
        metrics.truncate_after(start)
    probe = _ActivationProbe(model)
    step_fn = step_function(training, cfg, probe)
    last_saved = start
    summary: dict = {"start_step": start}

    def check_update(step: int, grad_norm: torch.Tensor) -> float:
        """The gradient norm of ``step`` on the host; a non-finite one put NaN or inf into the
        weights (the loss alone cannot tell), which must never be saved."""
        value = float(grad_norm)
        if not math.isfinite(value):
            raise TrainingDiverged(
                f"non-finite gradient norm {value} at step {step} (loss finite); stopping before its "
                f"weights are saved. The last good checkpoint is step {last_saved} in "
                f"{run_dir / ckpt.CKPT_DIR} (resume with --resume, perhaps with a lower --lr or --clip-grad)")
        return value

    def save(step: int, grad_norm: torch.Tensor) -> None:
        nonlocal last_saved
        check_update(step, grad_norm)
        ckpt.save_checkpoint(run_dir, step, parallel.state_dict(optimizers),
                             {"data": stream.state_dict(), "lr_schedule": schedule.to_dict()}, cfg.keep_last)
        last_saved = step

    def stopping() -> bool:
        """Ctrl-C on any rank, agreed by all (each rank saves the same step, then stops)."""
        if env.world_size == 1:
            return flag.stop
        return mean_over_ranks(torch.tensor(float(flag.stop), device=env.device)).item() > 0

    with StopFlag() as flag, Progress(cfg.max_steps, start, enabled=env.is_main) as bar:
        # tokens and FLOPs since the last row, over the time spent in training steps (an
        # evaluation's or a checkpoint's time is left out); FLOPs per step at its own length
        t_last, step, tokens_last, flops_last = time.perf_counter(), start, 0, 0.0
        flops_at = functools.cache(lambda seq_len: flops_per_token(model_cfg, seq_len))
        tokens_total = sum(tokens_per_step(s) for s in range(1, start + 1))
        losses: list[float] = []
        last_norm = None  # the last step's gradient norm, checked at this step's host read
        stopped = False
        for step in range(start + 1, cfg.max_steps + 1):
            stream.seq_len = cfg.seq_len_at(step)
            mult = schedule(step - 1)
            set_lr(optimizers, mult)
            eval_step = val_tokens > cfg.seq_len and (step % cfg.eval_interval == 0 or step == cfg.max_steps)
            # an evaluation is logged with its step's row, also where it falls between log steps
            logging_step = step % cfg.log_interval == 0 or step == cfg.max_steps or eval_step
            probe.active = logging_step or probe.persistent
            try:
                loss_f, grad_norm, mtp_f = step_fn(stream.next_batch() for _ in range(cfg.grad_accum))
            except torch.cuda.OutOfMemoryError as e:
                raise RuntimeError(_oom_message(cfg)) from e
            if last_norm is not None:  # ready by now (the loss's read waited for this step's work),
                check_update(step - 1, last_norm)  # and a cause of a non-finite loss below
            last_norm = grad_norm.detach().clone()  # a graphed step overwrites its output next time
            if not _finite(loss_f, mtp_f):
                mtp_note = "" if mtp_f is None else f" (MTP loss {mtp_f})"
                raise TrainingDiverged(
                    f"non-finite loss {loss_f}{mtp_note} at step {step}; stopping. The last good "
                    f"checkpoint is step {last_saved} in {run_dir / ckpt.CKPT_DIR} (resume with --resume, "
                    "perhaps with a lower --lr)")
            losses.append(loss_f)
            tokens_last += tokens_per_step(step)
            flops_last += tokens_per_step(step) * flops_at(cfg.seq_len_at(step))
            tokens_total += tokens_per_step(step)
            bar.update(step, loss=loss_f, lr=cfg.lr * mult)

            if logging_step:
                elapsed = max(time.perf_counter() - t_last, 1e-9)
                tok_s, flop_s = tokens_last / elapsed, flops_last / elapsed
                tokens_last, flops_last = 0, 0.0
                row = {"step": step, "loss": loss_f, "lr": cfg.lr * mult,
                       "grad_norm": check_update(step, grad_norm),
                       **({"mtp_loss": mtp_f} if mtp_f is not None else {}),
                       "tokens_per_s": tok_s, "seq_len": cfg.seq_len_at(step),
                       "tokens": tokens_total,
                       "load_max_over_mean": balancer.stats(),
                       "max_abs_activation": probe.read()}
                if env.device.type == "cuda":
                    row["mfu"] = flop_s / peak
                if eval_step:
                    row["val_loss"] = evaluate(model, data, cfg, env, parallel)
                metrics.write(row)
                bar.log_line(row)
                t_last = time.perf_counter()
            if step % cfg.ckpt_interval == 0 or step == cfg.max_steps:
                started = time.perf_counter()
                save(step, grad_norm)
                t_last += time.perf_counter() - started
            if stopping():
                stopped = True
                if last_saved != step:
                    save(step, grad_norm)
                _log(env, f"saved step {step}; resume with --resume")
                break
    summary.update(end_step=step, first_loss=losses[0] if losses else None,
                   last_loss=losses[-1] if losses else None, losses=losses)
    # the final step is always checkpointed above; export those weights. A sharded model needs
    # every rank for a forward, so samples come from the gathered single-device copy.
    plain = parallel.gathered_model()
    if plain is not None:
        set_qat(plain, cfg.qat)  # a gathered copy is a fresh model
        export(run_dir, plain, data, experts="mxfp4" if cfg.qat == "mxfp4" else "bf16")
        if not stopped and cfg.num_samples:
            summary["samples"] = print_samples(plain, data, cfg, env)
    barrier()
    return summary


def export(run_dir: Path, model, data, experts: str = "bf16") -> None:
    """save_pretrained a single-device ``model`` with its tokenizer to RUN_DIR/export, in one
    atomic write: ``tokenizer.json`` and a ``tokenizer_config.json`` naming the special tokens,
    which ``transformers.AutoTokenizer`` (and so lm-evaluation-harness) reads. ``experts``: as
    ``save_pretrained``'s; a QAT run exports ``"mxfp4"``, the weights its forward used."""
    from openk3.checkpoint import save_pretrained

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data.tokenizer_path))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.id_to_token(data.eos_id)}
    for key, token in (("bos_token", BOS_TOKEN), ("pad_token", PAD_TOKEN)):
        if tok.token_to_id(token) is not None:
            tokenizer_config[key] = token
    save_pretrained(model, run_dir / "export", experts=experts, extra_files={
        "tokenizer.json": Path(data.tokenizer_path).read_bytes(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=1).encode()})


def print_samples(model, data, cfg: RunConfig, env: Env) -> list[str]:
    from openk3.generate import generate
    from openk3.tokenizer import HFTokenizer

    tok = HFTokenizer(Path(data.tokenizer_path))
    prompts = ["def ", "class ", "import "][: cfg.num_samples]
    prompts += ["    "] * (cfg.num_samples - len(prompts))
    model.eval()
    texts = []
    for i, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        out = generate(model, ids, cfg.sample_tokens, temperature=cfg.sample_temperature,
                       top_p=0.95, seed=cfg.seed + i, eos_token_id=data.eos_id)
        text = tok.decode(ids + out)
        texts.append(text)
        print(f"--- sample {i + 1} ---\n{text}\n", flush=True)
    model.train()
    return texts
