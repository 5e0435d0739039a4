"""The MOPD demos' final table from their ``openk3 eval`` reports: accuracy per task of each
model, and the student's accuracy over its teacher's on that task (the issue's target: within
10% relative, i.e. >= 0.90).

    python benchmarks/mopd_table.py RUN_DIR --teacher arithmetic=teacher_math sorting=teacher_text
reads RUN_DIR/eval_{base,teacher_math,teacher_text,student}.json (``--models`` to change them).
"""

from __future__ import annotations

import argparse
import json
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


if __name__ == "__main__":
    main()
