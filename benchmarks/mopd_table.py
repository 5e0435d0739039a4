"""The MOPD demos' final table from their ``openk3 eval`` reports: accuracy per task of each
model, and the student's accuracy over its teacher's on that task (the issue's target: within
10% relative, i.e. >= 0.90).

    python benchmarks/mopd_table.py RUN_DIR --teacher arithmetic=teacher_math sorting=teacher_text
reads RUN_DIR/eval_{base,teacher_math,teacher_text,student}.json (``--models`` to change them).
A second table splits each task's accuracy by part (``part``): a python problem by its function
(one prompt per family), an arithmetic one by its operators, so that a gain shows where it was
made (e.g. on the families that were rare in the pre-training text).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path


def table(reports: dict[str, dict], teachers: dict[str, str], student: str = "student") -> str:
    """Markdown: a row per task, a column per model (its accuracy), then student / teacher."""
    names = list(reports)
    tasks = list(next(iter(reports.values()))["tasks"])
    lines = ["| task | " + " | ".join(names) + " | student / teacher |",
             "|---|" + "---|" * (len(names) + 1)]
    for task in tasks:
        acc = {n: reports[n]["tasks"][task]["accuracy"] for n in names}
        teacher = teachers.get(task)
        ratio = (f"{acc[student] / acc[teacher]:.2f}" if teacher in acc and acc[teacher] > 0 else "n/a")
        lines.append(f"| {task} | " + " | ".join(f"{acc[n]:.3f}" for n in names) + f" | {ratio} |")
    return "\n".join(lines)


def part(prompt: str) -> str:
    """The part of a task a problem belongs to: the family of a python problem (its function's
    name without a constant's suffix: ``times_7`` -> ``times``), else the operators of an
    arithmetic expression in order of first use (``+-``, ``*``), else the whole task."""
    if m := re.match(r"def ([a-z_]+?)(?:_\d+)?\(", prompt):
        return m.group(1)
    ops = "".join(dict.fromkeys(re.findall(r"(?<=\d)[-+*]", prompt)))
    return ops or "all"


def part_table(reports: dict[str, dict]) -> str:
    """Markdown: a row per (task, part), a column per model: accuracy (problems in the part)."""
    names = list(reports)
    lines = ["| task | part | problems | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for task in next(iter(reports.values()))["tasks"]:
        scores = {n: defaultdict(list) for n in names}
        for n in names:
            for s in reports[n]["tasks"][task]["samples"]:
                scores[n][part(s["prompt"])].append(s["score"] == 1.0)
        for key in sorted(scores[names[0]]):
            count = len(scores[names[0]][key])
            lines.append(f"| {task} | {key} | {count} | " + " | ".join(
                f"{sum(scores[n][key]) / len(scores[n][key]):.3f}" if scores[n][key] else "-" for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--teacher", nargs="+", required=True, metavar="TASK=MODEL",
                    help="each task's teacher (a model name of --models)")
    ap.add_argument("--models", nargs="+", default=None,
                    help="eval_NAME.json files to read, in column order (default: base, the teachers, student)")
    args = ap.parse_args()
    teachers = dict(spec.rsplit("=", 1) for spec in args.teacher)  # a task spec may hold "="
    models = args.models or ["base", *dict.fromkeys(teachers.values()), "student"]
    reports = {m: json.loads((args.run_dir / f"eval_{m}.json").read_text()) for m in models}
    print(table(reports, teachers))
    print()
    print(part_table(reports))


if __name__ == "__main__":
    main()
