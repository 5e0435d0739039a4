"""benchmarks/mopd_table.py: the accuracy tables the P12 device runs print."""

from benchmarks.mopd_table import part, part_table, table


def report(samples: dict[str, list[tuple[str, float]]]) -> dict:
    return {"tasks": {task: {"accuracy": sum(s == 1.0 for _, s in rows) / len(rows),
                             "samples": [{"prompt": p, "score": s} for p, s in rows]}
                      for task, rows in samples.items()}}


def test_part_names_python_families_and_arithmetic_operators():
    assert part('def times_7(a):\n    """Return a times 7."""') == "times"
    assert part("def is_even(n):") == "is_even"
    assert part("3*4+2=") == "*+"
    assert part("73-6=") == "-"
    assert part("-3+4=") == "+"  # a leading sign is not an operator
    assert part("sort 3 1 2:") == "all"


def test_tables_count_by_task_and_part():
    base = report({"arithmetic": [("1+2=", 1.0), ("3*4=", 0.0), ("5*6=", 0.0)],
                   "python": [("def add_2(a):", 1.0), ("def times_3(a):", 0.4)]})
    teacher = report({"arithmetic": [("1+2=", 1.0), ("3*4=", 1.0), ("5*6=", 0.0)],
                      "python": [("def add_2(a):", 1.0), ("def times_3(a):", 1.0)]})
    student = report({"arithmetic": [("1+2=", 1.0), ("3*4=", 0.0), ("5*6=", 1.0)],
                      "python": [("def add_2(a):", 1.0), ("def times_3(a):", 1.0)]})
    reports = {"base": base, "teacher": teacher, "student": student}
    rows = table(reports, {"arithmetic": "teacher", "python": "teacher"}).splitlines()
    assert rows[2] == "| arithmetic | 0.333 | 0.667 | 0.667 | 1.00 |"
    assert rows[3] == "| python | 0.500 | 1.000 | 1.000 | 1.00 |"
    parts = part_table(reports).splitlines()[2:]
    assert parts == ["| arithmetic | * | 2 | 0.000 | 0.500 | 0.500 |",
                     "| arithmetic | + | 1 | 1.000 | 1.000 | 1.000 |",
                     "| python | add | 1 | 1.000 | 1.000 | 1.000 |",
                     "| python | times | 1 | 0.000 | 1.000 | 1.000 |"]
