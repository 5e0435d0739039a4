"""Task accuracy of a checkpoint on held-out problems (``openk3 eval``).

The problems of task ``NAME`` come from ``random.Random(f"openk3-eval/{NAME}/{seed}")``: a
string-seeded stream, while training draws its problems from integer-seeded ones (``openk3 rl``
and ``distill``: ``random.Random(--seed)``; the demos' solved-text corpora: small integers), so
the evaluation never replays a training stream. Problems themselves can still coincide where a
task has few distinct ones (one-digit ``arithmetic`` has 155): held-out means another draw from
the same distribution, which measures the skill, not the memory of particular problems.

Completions come from the serving engine (``LLMEngine.generate``, ``batch_size`` sequences at
once), greedy by default, each stopping at its problem's stop strings, and are scored by the
task's own verifier (``tasks.score_all``: the sandbox for ``python``). A prompt is built as
``openk3 rl`` builds it (effort control text, then the problem's prompt, tokenised separately),
so a policy is evaluated on the very token sequences it was trained on.

    >>> from openk3.posttrain.config import EvalConfig
    >>> from openk3.posttrain.evaluate import evaluate
    >>> report = evaluate(EvalConfig(checkpoint="runs/rl", task=("arithmetic",), num_problems=100))
    >>> report["tasks"]["arithmetic"]["accuracy"]
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from openk3.posttrain.config import EvalConfig, effort_prefix
from openk3.posttrain.tasks import Problem, parse_task, score_all


def held_out_problems(task, num_problems: int, seed: int) -> list[Problem]:
    """The first ``num_problems`` evaluation problems of ``task`` for ``seed`` (module docstring)."""
    rng = random.Random(f"openk3-eval/{task.name}/{seed}")
    return [task.sample(rng) for _ in range(num_problems)]


def evaluate(cfg: EvalConfig, engine=None) -> dict:
    """Evaluate ``cfg.checkpoint`` on every task of ``cfg.task``; returns the report (also written
    to ``cfg.out`` as JSON when set): ``{"checkpoint", "config", "seconds", "tasks": {spec:
    {"accuracy", "mean_score", "mean_length", "truncated", "num_problems", "samples"}}}``, with
    accuracy the fraction of completions scored 1, ``mean_score`` the mean score (partial credit
    for ``python``), ``mean_length`` the mean completion length in tokens, ``truncated`` the
    fraction that hit ``max_new_tokens``, and ``samples`` one record per problem.

    ``engine``: anything with ``tokenizer`` and ``generate(prompts, params)`` as ``LLMEngine``
    (tests); None loads the checkpoint into a new engine."""
    t0 = time.perf_counter()
    tasks = {spec: parse_task(spec, cfg.task_options) for spec in cfg.task}
    problems = {spec: held_out_problems(task, cfg.num_problems, cfg.seed) for spec, task in tasks.items()}
    if engine is None:
        engine = _load_engine(cfg, problems)
    report = {"checkpoint": cfg.checkpoint, "config": cfg.to_dict(), "tasks": {}}
    for spec, task in tasks.items():
        outs = engine.generate([_prompt_ids(engine.tokenizer, p, cfg.effort) for p in problems[spec]],
                               [_sampling(cfg, p, i) for i, p in enumerate(problems[spec])])
        texts = [o.text for o in outs]
        scores = score_all(task, problems[spec], texts, max_workers=cfg.score_workers)
        lengths = [len(o.token_ids) for o in outs]
        n = len(scores)
        report["tasks"][spec] = {
            "accuracy": sum(s >= 1.0 for s in scores) / n, "mean_score": sum(scores) / n,
            "mean_length": sum(lengths) / n, "truncated": sum(o.finish_reason == "length" for o in outs) / n,
            "num_problems": n,
            "samples": [{"prompt": p.prompt, "answer": p.answer, "completion": t, "score": s, "tokens": k}
                        for p, t, s, k in zip(problems[spec], texts, scores, lengths)]}
    report["seconds"] = time.perf_counter() - t0
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(report, indent=1))
    return report


def format_table(report: dict) -> str:
    """One row per task: problems, accuracy, mean score, mean length, truncated fraction."""
    lines = [f"{'task':<28} {'problems':>8} {'accuracy':>9} {'score':>7} {'length':>7} {'truncated':>9}"]
    for spec, r in report["tasks"].items():
        lines.append(f"{spec:<28} {r['num_problems']:>8} {r['accuracy']:>9.3f} {r['mean_score']:>7.3f} "
                     f"{r['mean_length']:>7.1f} {r['truncated']:>9.2f}")
    return "\n".join(lines)


def _prompt_ids(tokenizer, problem: Problem, effort: str) -> list[int]:
    return (tokenizer.encode(effort_prefix(effort)) if effort != "none" else []) + tokenizer.encode(problem.prompt)


def _sampling(cfg: EvalConfig, problem: Problem, index: int):
    from openk3.serve.sampler import SamplingParams

    seed = None if cfg.temperature == 0 else cfg.seed * 1_000_003 + index  # reproducible noise per problem
    return SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, stop=tuple(problem.stop),
                          seed=seed)


def _load_engine(cfg: EvalConfig, problems: dict[str, list[Problem]]):
    """The checkpoint in a serving engine sized for the longest prompt + ``max_new_tokens``."""
    from openk3.runtime import load_model
    from openk3.serve.config import EngineConfig
    from openk3.serve.engine import LLMEngine

    path = Path(cfg.checkpoint)
    if not path.is_dir():
        raise ValueError(f"--checkpoint {cfg.checkpoint!r}: no such directory (give a training or RL run, "
                         "or an HF checkpoint directory)")
    try:
        model, tokenizer, _ = load_model(path, device=None if cfg.device == "auto" else cfg.device,
                                         dtype=None if cfg.dtype == "auto" else cfg.dtype)
    except Exception as e:  # tokenizers raises bare Exceptions; the message says what failed
        raise ValueError(f"--checkpoint {cfg.checkpoint!r}: cannot load a model from it "
                         f"({type(e).__name__}: {e})") from e
    longest = max(len(_prompt_ids(tokenizer, p, cfg.effort)) for ps in problems.values() for p in ps)
    config = EngineConfig(max_num_seqs=cfg.batch_size, max_model_len=longest + cfg.max_new_tokens,
                          max_num_batched_tokens=max(16384, cfg.batch_size), physical_block_size=512,
                          hash_block_size=64, kda_checkpoint_interval=512, enable_prefix_caching=False)
    return LLMEngine(model, tokenizer, config)
