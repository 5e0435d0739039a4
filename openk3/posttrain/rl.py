"""The loop behind ``openk3 rl`` and ``openk3 distill`` (one process, one device).

Per step:

1. **rollouts**: ``PartialRollouts.generate`` on the serving engine until ``prompts_per_step``
   groups of G samples are complete (the step's batch; with partial rollouts the unfinished
   trajectories wait for the next step); new groups draw a task in turn, a problem, and an
   effort level whose control text precedes the prompt;
2. **rewards**: the task's score of each completion (its text before the problem's first stop
   string, ``Problem.stop``, a newline by default), plus the length reward of k1.5 weighted by the group's effort, times
   ``reward_weight``; with teachers, MOPD's per-token rewards (``mopd.py``);
3. **update**: the trainer recomputes each sampled token's log-probability (fp32 master weights,
   bf16 autocast on CUDA), the chosen loss (``objective.py``) is averaged over the step's tokens
   (GRPO) or sequences (k1.5), one optimiser step (per-head Muon + AdamW), then the engine
   serves the new weights (``RolloutEngine.sync``) and the policy version goes up by one.

Checkpoints are the trainer's (``openk3.train.state``: atomic, keep-last-N) with the rollout
queue, the task RNG and the policy version in ``trainer.json``, so ``--resume`` continues the
very trajectories that were in flight. A non-finite loss stops the run before the update; the
last checkpoint stays as it was.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from openk3.parallel.parallelize import parallelize
from openk3.posttrain.config import EFFORTS, POSTTRAIN_CONFIG_FILE, PostTrainConfig, check_teacher_coverage, effort_prefix
from openk3.posttrain.mopd import Teachers, mopd_rewards
from openk3.posttrain.objective import (completion_logprobs, grpo_loss, group_advantages, k15_loss, kl_k3,
                                        length_rewards, padded)
from openk3.posttrain.partial import Group, PartialRollouts, Trajectory
from openk3.posttrain.rollout import RolloutEngine
from openk3.posttrain.tasks import parse_task, score_all
from openk3.runtime import checkpoint_dir, load_model, resolve_device, resolve_dtype
from openk3.train import state as ckpt
from openk3.train.metrics import MetricsLog, Progress
from openk3.train.optim import build_optimizers
from openk3.train.trainer import Env, StopFlag, TrainingDiverged

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model")
DEFAULT_STOP = ("\n",)  # a problem without its own ``stop`` strings ends at its first newline


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def completion_text(tokenizer, tokens: list[int], eos_ids: tuple[int, ...], stop: tuple[str, ...]) -> str:
    """The text a task scores: the decoded completion (eos dropped) cut before its first stop
    string, as the serving engine returns text."""
    text = tokenizer.decode([t for t in tokens if t not in eos_ids])
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def cut_resumed_at_stop(tokenizer, t: Trajectory, stop: tuple[str, ...]) -> None:
    """Cut a trajectory that generated in several requests (a partial rollout paused and
    resumed: ``t.segments > 1``) after the token that completes its first stop string, as the
    engine cuts one request's run. Each request searched its own text only, so a stop string
    across a resume point was missed and generation went on; the tokens after it would be
    trained on and count in the length reward. A one-request trajectory is left as it is."""
    if t.segments <= 1 or not stop:
        return
    text = tokenizer.decode(t.tokens)
    ends = [i + len(s) for s in stop if (i := text.find(s)) >= 0]
    if not ends:
        return
    end = min(ends)
    for j in range(len(t.tokens)):  # the first token whose text reaches past the stop's end
        if len(tokenizer.decode(t.tokens[:j + 1])) >= end:
            del t.tokens[j + 1:], t.logprobs[j + 1:], t.versions[j + 1:]
            t.finish_reason = "stop"
            return


class _RLProgress(Progress):
    def update_rl(self, step: int, reward: float, accuracy: float) -> None:
        if self.live:
            self.bar.update(self.task, completed=step, info=f"reward {reward:.3f} acc {accuracy:.2f}")

    def log_line(self, row: dict) -> None:
        msg = (f"step {row['step']:>5}  reward {row['reward']:.3f}  acc {row['accuracy']:.3f}  "
               f"len {row['length_mean']:.1f}  stale {row['staleness_mean']:.2f}/{row['staleness_max']}  "
               f"loss {row['loss']:+.4f}  gnorm {row['grad_norm']:.2f}  groups {row['groups']}  "
               f"{row['rollout_tokens_per_s']:,.0f} tok/s")
        if "mopd_reward" in row:
            msg += f"  mopd {row['mopd_reward']:+.3f}"
        if "kl" in row:
            msg += f"  kl {row['kl']:.4f}"
        if self.live:
            self.bar.console.print(msg)
        else:
            print(msg, file=sys.stderr, flush=True)


def _tasks(cfg: PostTrainConfig) -> list:
    return [parse_task(spec, cfg.task_options) for spec in cfg.task]


def run(cfg: PostTrainConfig, tasks: list | None = None,
        loss_hook: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> dict:
    """Run (or resume) a post-training run; returns a summary (``rewards``, ``accuracies`` per
    step). ``tasks``: Task objects instead of ``cfg.task``'s (tests); ``loss_hook(step, loss)``
    may replace a step's loss (tests of the divergence stop)."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt.remove_partial_saves(out)
    prev = ckpt.latest_checkpoint(out) if cfg.resume else None
    if not cfg.resume and ckpt.latest_checkpoint(out) is not None:
        raise ValueError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    tasks = tasks if tasks is not None else _tasks(cfg)
    check_teacher_coverage(cfg, [(task.name, task.domain) for task in tasks])
    torch.manual_seed(cfg.seed)

    # the policy: fp32 master weights; the engine serves a copy in the compute dtype
    policy, tokenizer, _ = load_model(cfg.checkpoint, device=device, dtype=torch.float32)
    policy.train()
    student_dir = checkpoint_dir(cfg.checkpoint)
    env = Env(0, 1, device, dtype)
    parallel = parallelize(policy, env, compile=False)
    optimizers = build_optimizers(policy, lr=cfg.lr, weight_decay=cfg.weight_decay, optimizer=cfg.optimizer)
    eos_ids = (policy.cfg.eos_token_id,) if policy.cfg.eos_token_id is not None else ()
    use_amp = device.type == "cuda" and dtype != torch.float32
    autocast = (lambda: torch.autocast("cuda", dtype=dtype)) if use_amp else nullcontext
    reference = None
    if cfg.kl_coef > 0:  # the initial policy, frozen
        reference, _, _ = load_model(cfg.checkpoint, device=device, dtype=dtype)
        reference.requires_grad_(False)
    teachers = Teachers(cfg.teacher, device, dtype, policy.cfg.vocab_size, student_dir)

    rng = random.Random(cfg.seed)
    counter = 0  # groups drawn so far: task i % len(tasks)
    problem_type = type(tasks[0].sample(random.Random(0)))

    def new_groups(n: int) -> list[tuple[list[int], dict, tuple[str, ...]]]:
        nonlocal counter
        groups = []
        for _ in range(n):
            task_index = counter % len(tasks)
            counter += 1
            problem = tasks[task_index].sample(rng)
            effort = rng.choice(EFFORTS) if cfg.effort == "mixed" else cfg.effort
            prompt_ids = tokenizer.encode(problem.prompt)
            ids = (tokenizer.encode(effort_prefix(effort)) if effort != "none" else []) + prompt_ids
            if len(ids) + cfg.max_new_tokens > cfg.max_model_len:
                raise ValueError(f"task {tasks[task_index].name!r}: a prompt of {len(ids)} tokens + "
                                 f"--max-new-tokens {cfg.max_new_tokens} exceeds --max-model-len {cfg.max_model_len}")
            groups.append((ids, {"task": task_index, "problem": problem, "effort": effort,
                                 "teacher_ids": prompt_ids}, tuple(getattr(problem, "stop", DEFAULT_STOP))))
        return groups

    def payload_to_json(p: dict) -> dict:
        return {**p, "problem": dataclasses.asdict(p["problem"])}

    def payload_from_json(p: dict) -> dict:
        return {**p, "problem": problem_type(**p["problem"])}

    engine = RolloutEngine(policy, tokenizer, device, dtype, max_num_seqs=cfg.capacity,
                           max_model_len=cfg.max_model_len)
    scheduler = PartialRollouts(engine, cfg.group_size, cfg.capacity, cfg.max_new_tokens,
                                cfg.finish_fraction, cfg.partial_rollouts)
    start = version = 0
    if prev is not None:
        state = parallel.state_dict(optimizers)
        trainer_state = ckpt.load_checkpoint(prev, state)
        parallel.load_state_dict(state, optimizers)
        start, version, counter = trainer_state["step"], trainer_state["version"], trainer_state["groups_drawn"]
        s = trainer_state["task_rng"]
        rng.setstate((s[0], tuple(s[1]), s[2]))
        scheduler.load_state_dict(trainer_state["rollouts"], payload_from_json)
        engine.sync(policy)
        _log(f"openk3 rl: resumed from {prev} at step {start} ({len(scheduler.queue)} trajectories in flight)")
    (out / POSTTRAIN_CONFIG_FILE).write_text(json.dumps(
        {"posttrain": cfg.to_dict(), "model": policy.cfg.to_dict()}, indent=1))
    metrics = MetricsLog(out / "metrics.jsonl")
    if start:
        metrics.truncate_after(start)
    last_saved = start

    def save(step: int) -> None:
        nonlocal last_saved
        ckpt.save_checkpoint(out, step, parallel.state_dict(optimizers), {
            "version": version, "groups_drawn": counter, "task_rng": rng.getstate(),
            "rollouts": scheduler.state_dict(payload_to_json)}, cfg.keep_last)
        last_saved = step

    _log(f"openk3 rl: policy {cfg.checkpoint} ({sum(p.numel() for p in policy.parameters()):,} parameters) on "
         f"{device}, tasks {', '.join(t.name for t in tasks)}, loss {cfg.loss}, {cfg.prompts_per_step} x "
         f"{cfg.group_size} samples in flight, partial rollouts "
         f"{'on (lambda ' + str(cfg.finish_fraction) + ')' if cfg.partial_rollouts else 'off'}"
         + (f", teachers {', '.join(f'{d}:{e}' for d, e in teachers.models)}" if teachers else ""))
    rewards_log, acc_log = [], []
    step = start
    prog = "openk3 distill" if cfg.teacher else "openk3 rl"
    with StopFlag(prog) as flag, _RLProgress(cfg.max_steps, start) as bar:
        for step in range(start + 1, cfg.max_steps + 1):
            t0 = time.perf_counter()
            ready, stats = scheduler.generate(new_groups, version, cfg.prompts_per_step)
            t_roll = time.perf_counter() - t0
            batch = _score(ready, tasks, tokenizer, eos_ids, cfg)
            row = _update(cfg, policy, optimizers, parallel, autocast, batch, version, teachers, reference,
                          loss_hook=functools.partial(loss_hook, step) if loss_hook else None)
            if not math.isfinite(row["loss"]):
                raise TrainingDiverged(
                    f"non-finite loss {row['loss']} at step {step}; stopping before the update. The last "
                    f"good checkpoint is step {last_saved} in {out / ckpt.CKPT_DIR} (--resume, perhaps with a lower --lr)")
            version += 1
            engine.sync(policy)
            row.update(step=step, version=version, rollout_s=t_roll, train_s=time.perf_counter() - t0 - t_roll,
                       rollout_tokens=stats.tokens, rollout_tokens_per_s=stats.tokens / max(t_roll, 1e-9),
                       resumed=stats.resumed, resumed_tokens=stats.resumed_tokens, queued=stats.queued,
                       admitted_groups=stats.admitted_groups, rounds=stats.rounds,
                       mean_batch=stats.slot_steps / max(stats.engine_steps, 1))
            rewards_log.append(row["reward"])
            acc_log.append(row["accuracy"])
            bar.update_rl(step, row["reward"], row["accuracy"])
            if step % cfg.log_interval == 0 or step == cfg.max_steps:
                metrics.write(row)
                bar.log_line(row)
            if step % cfg.ckpt_interval == 0 or step == cfg.max_steps:
                save(step)
            if flag.stop:
                if last_saved != step:
                    save(step)
                _log(f"saved step {step}; resume with --resume")
                break
    _export(out, policy, student_dir)
    return {"start_step": start, "end_step": step, "rewards": rewards_log, "accuracies": acc_log}


def _score(groups: list[Group], tasks: list, tokenizer, eos_ids: tuple[int, ...], cfg: PostTrainConfig) -> dict:
    """Flatten the groups into rows and score them: task score, correctness, length reward and
    the total scalar reward per row."""
    rows: dict[str, list] = {k: [] for k in ("prompt", "teacher_prompt", "tokens", "logprobs", "versions",
                                             "score", "correct", "reward", "domain", "effort")}
    # every completion of the step, scored in one call per task (the code task's sandbox runs
    # `score_workers` at a time across all the groups, not group by group)
    pending: dict[int, list[tuple[int, object, str]]] = {}
    for i, g in enumerate(groups):
        for t in g.members:
            cut_resumed_at_stop(tokenizer, t, g.stop)
            pending.setdefault(g.payload["task"], []).append(
                (i, g.payload["problem"], completion_text(tokenizer, t.tokens, eos_ids, g.stop)))
    by_group: list[list[float]] = [[] for _ in groups]
    for task_index, items in pending.items():
        scores = score_all(tasks[task_index], [p for _, p, _ in items], [c for _, _, c in items],
                           max_workers=cfg.score_workers)
        for (i, _, _), s in zip(items, scores):
            by_group[i].append(float(s))
    for g, scores in zip(groups, by_group):
        problem, effort = g.payload["problem"], g.payload["effort"]
        correct = [s >= 1.0 for s in scores]
        weight = cfg.length_penalty_weight(effort)
        lens = length_rewards([len(t.tokens) for t in g.members], correct) if weight else [0.0] * len(scores)
        for t, s, ok, lr in zip(g.members, scores, correct, lens):
            rows["prompt"].append(g.prompt_ids)
            rows["teacher_prompt"].append(g.payload["teacher_ids"])
            rows["tokens"].append(t.tokens)
            rows["logprobs"].append(t.logprobs)
            rows["versions"].append(t.versions)
            rows["score"].append(s)
            rows["correct"].append(ok)
            rows["reward"].append(cfg.reward_weight * (s + weight * lr))
            rows["domain"].append(problem.domain)
            rows["effort"].append(effort)
    return rows


def _update(cfg: PostTrainConfig, policy, optimizers, parallel, autocast, batch: dict, version: int,
            teachers: Teachers, reference, loss_hook=None) -> dict:
    """One optimisation step on a scored batch; returns its metrics (the loss is NaN, and no
    update made, when it is not finite)."""
    device = policy.lm_head.weight.device
    B, L = len(batch["tokens"]), max(map(len, batch["tokens"]))
    old_logp = padded(batch["logprobs"], L, device)
    mask = padded([[1.0] * len(t) for t in batch["tokens"]], L, device).bool()
    stale = padded([[version - v for v in vs] for vs in batch["versions"]], L, device)
    rewards = torch.tensor(batch["reward"], device=device)
    centred = group_advantages(rewards, cfg.group_size, std_normalize=False)
    seq_adv = group_advantages(rewards, cfg.group_size, cfg.std_normalize) if cfg.loss == "grpo" else centred
    adv = seq_adv[:, None].expand(B, L).clone()
    row: dict = {}
    if teachers:
        teacher_logp = torch.zeros(B, L, device=device)
        keys = [teachers.pick(d, e) for d, e in zip(batch["domain"], batch["effort"])]
        for key in dict.fromkeys(keys):
            idx = [i for i, k in enumerate(keys) if k == key]
            with autocast():
                teacher_logp[idx] = teachers.logprobs(key, [batch["teacher_prompt"][i] for i in idx],
                                                      [batch["tokens"][i] for i in idx], L)
        r_mopd = mopd_rewards(teacher_logp, old_logp, cfg.mopd_clip) * mask
        adv = adv + cfg.mopd_weight * r_mopd
        row["mopd_reward"] = float(r_mopd.sum() / mask.sum())
    n_tokens, n_seqs = mask.sum(), B
    totals = torch.zeros(4, device=device)  # loss, kl, |logp - old| on fresh tokens, fresh tokens
    for lo in range(0, B, cfg.micro_batch_size):
        sl = slice(lo, lo + cfg.micro_batch_size)
        with autocast():
            logp, _ = completion_logprobs(policy, batch["prompt"][sl], batch["tokens"][sl])
        Lm = logp.shape[1]
        o, a, mk = old_logp[sl, :Lm], adv[sl, :Lm], mask[sl, :Lm]
        if cfg.loss == "grpo":
            loss = grpo_loss(logp, o, a, mk, cfg.clip_eps) / n_tokens
        else:
            loss = k15_loss(logp, o, centred[sl], mk, cfg.tau) / n_seqs
        if reference is not None:
            with torch.no_grad(), autocast():
                ref, _ = completion_logprobs(reference, batch["prompt"][sl], batch["tokens"][sl])
            kl = kl_k3(logp, ref.float(), mk) / n_tokens
            loss = loss + cfg.kl_coef * kl
            totals[1] += kl.detach()
        if loss_hook is not None:
            loss = loss_hook(loss)
        loss.backward()
        fresh = mk & (stale[sl, :Lm] == 0)
        totals[0] += loss.detach()
        totals[2] += ((logp.detach() - o).abs() * fresh).sum()
        totals[3] += fresh.sum()
    loss_f, kl_f, diff, n_fresh = totals.tolist()  # one host sync
    if not math.isfinite(loss_f):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        return {"loss": loss_f}
    grad_norm = parallel.clip_grad_norm_(cfg.clip_grad if cfg.clip_grad > 0 else 1e30)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    lengths = [len(t) for t in batch["tokens"]]
    stale_tokens = stale[mask]
    row.update(loss=loss_f, grad_norm=float(grad_norm), groups=B // cfg.group_size,
               reward=sum(batch["reward"]) / B, score=sum(batch["score"]) / B,
               accuracy=sum(batch["correct"]) / B, length_mean=sum(lengths) / B, length_max=max(lengths),
               length_min=min(lengths), staleness_mean=float(stale_tokens.mean()),
               staleness_max=int(stale_tokens.max()), stale_token_fraction=float((stale_tokens > 0).float().mean()),
               train_rollout_logprob_diff=diff / max(n_fresh, 1))
    if reference is not None:
        row["kl"] = kl_f
    return row


def _export(out: Path, policy, student_dir: Path) -> None:
    """save_pretrained the policy with the initial checkpoint's tokenizer files to OUT/export."""
    from openk3.checkpoint import save_pretrained

    extra = {name: (student_dir / name).read_bytes() for name in TOKENIZER_FILES if (student_dir / name).exists()}
    save_pretrained(policy, out / "export", extra_files=extra)
