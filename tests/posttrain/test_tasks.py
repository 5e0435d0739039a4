"""Verifiable tasks: deterministic sampling, reference answers score 1, wrong ones 0, hidden tests,
garbage never raises, options and their errors."""

import json
import random

import pytest

from openk3.posttrain.tasks import (
    FAMILIES,
    TASK_NAMES,
    Problem,
    PythonFunctions,
    get_task,
    parse_task,
    score_all,
)

pytestmark = pytest.mark.sandbox  # one such test at a time on the machine (conftest.py)

TEXT_TASKS = [name for name in TASK_NAMES if name != "python"]


def _samples(task, seed, n=20):
    rng = random.Random(seed)
    return [task.sample(rng) for _ in range(n)]


def test_task_names_and_protocol():
    assert TASK_NAMES == ("arithmetic", "sorting", "string_edit", "python")
    for name in TASK_NAMES:
        task = get_task(name)
        assert task.name == name and task.domain in ("math", "code", "text")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_sampling_is_deterministic_per_seed(name):
    task = get_task(name)
    assert _samples(task, 0) == _samples(task, 0)
    assert _samples(task, 0) != _samples(task, 1)
    for p in _samples(task, 2):
        assert p.task == name and p.domain == task.domain and p.prompt and p.answer and p.stop
        json.dumps(p.meta)  # JSON-serialisable


def _wrong(problem: Problem) -> str:
    if problem.task == "arithmetic":
        return str(int(problem.answer) + 1)
    if problem.task == "sorting":
        return problem.answer + " 0"
    return problem.answer + "z"


@pytest.mark.parametrize("name", TEXT_TASKS)
def test_reference_scores_one_and_wrong_zero(name):
    task = get_task(name)
    for p in _samples(task, 3, n=50):
        assert task.score(p, p.answer) == 1.0
        assert task.score(p, f" {p.answer}\nanything after the first line") == 1.0
        assert task.score(p, _wrong(p)) == 0.0
        assert task.score(p, "\n" + p.answer) == 0.0  # only the first line counts


def test_long_arithmetic_answers_and_other_scripts_digits():
    """The largest options give answers of ~70 digits, which must score 1 (a 40-digit cap scored
    every one 0); digits of other scripts are no answer ("１９" for 19 scored 1)."""
    task = get_task("arithmetic", digits=9, terms=8, ops="*")
    problems = _samples(task, 1, n=20)
    assert max(len(p.answer) for p in problems) > 60
    assert all(task.score(p, p.answer) == 1.0 for p in problems)
    small = Problem("12+7=", "19", "math", "arithmetic")
    assert get_task("arithmetic").score(small, "19") == 1.0
    assert get_task("arithmetic").score(small, "\uff11\uff19") == 0.0


def test_option_values_of_the_wrong_type_name_the_option():
    """Options from JSON (``--task-options``) arrive typed: a float for an int field, or options
    that are no object at all, are refused naming the option (a traceback from deep inside, or
    an error naming neither, before)."""
    with pytest.raises(ValueError, match=r"task 'arithmetic': option digits=2.5 is not a valid int"):
        parse_task("arithmetic", {"digits": 2.5})
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_task("arithmetic", [1])
    assert parse_task("string_edit", {"ops": ["reverse"]}).ops == ("reverse",)
    assert parse_task("arithmetic", {"digits": 3, "negative": True}).digits == 3


def test_prompt_formats():
    rng = random.Random(0)
    p = get_task("arithmetic", digits=2, ops="+").sample(rng)
    a, b = p.prompt[:-1].split("+")
    assert p.prompt.endswith("=") and int(p.answer) == int(a) + int(b) and int(a) < 100
    assert get_task("arithmetic").score(Problem("2+3*4=", "14", "math", "arithmetic"), "14") == 1.0
    hard = get_task("arithmetic", digits=3, ops="+-*", terms=4)
    assert all(int(p.answer) >= 0 for p in _samples(hard, 4, 100))
    p = get_task("sorting").sample(rng)
    nums = p.prompt.removeprefix("sort ").removesuffix(":").split()
    assert p.answer == " ".join(map(str, sorted(map(int, nums))))
    for op, prompt_start in (("reverse", "reverse "), ("upper", "upper "), ("delete", "delete "),
                             ("replace", "replace ")):
        p = get_task("string_edit", ops=(op,)).sample(rng)
        assert p.prompt.startswith(prompt_start) and p.prompt.endswith(":") and p.meta["op"] == op


def test_partial_credit():
    sorting = get_task("sorting", partial=True)
    p = Problem("sort 3 1 2:", "1 2 3", "text", "sorting")
    assert sorting.score(p, "1 2 3") == 1.0 and sorting.score(p, "1 3 2") == pytest.approx(1 / 3)
    assert get_task("sorting").score(p, "1 3 2") == 0.0
    edit = get_task("string_edit", partial=True)
    p = Problem("reverse abcd:", "dcba", "text", "string_edit")
    assert edit.score(p, "dcbx") == 0.75 and edit.score(p, "dcbaaaaa") == 0.5


def test_python_reference_passes_every_family_and_a_wrong_body_fails():
    problems = [get_task("python", families=(f,)).sample(random.Random(i)) for i, f in enumerate(FAMILIES)]
    task = get_task("python")
    for p in problems:
        assert p.prompt.startswith("def ") and p.prompt.endswith('"""') and p.answer.startswith("\n    ")
        compile(p.prompt + p.answer, "ref", "exec")
    assert score_all(task, problems, [p.answer for p in problems], max_workers=2) == [1.0] * len(problems)
    assert score_all(task, problems[::4], ["\n    return None\n"] * 4, max_workers=2) == [0.0] * 4


@pytest.mark.parametrize("name", TASK_NAMES)
def test_prompt_ends_where_the_solved_text_splits(name):
    """The byte-level BPE's pre-tokens of a prompt are a prefix of those of the solved text
    (prompt + answer + stop): a model pre-trained on solved text sees the prompt's last token as
    it saw it there. (A python prompt ending in "\n" failed this: "\n    return" splits as
    "\n   " + " return", and a `small` base pre-trained on solved text solved no problem.)"""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    task = get_task(name)
    for i in range(20):
        p = task.sample(random.Random(i))
        prompt, solved = [t for t, _ in split(p.prompt)], [t for t, _ in split(p.prompt + p.answer + p.stop[0])]
        assert solved[:len(prompt)] == prompt, (p.prompt, p.answer)


def test_python_partial_credit_and_hang():
    task = PythonFunctions(wall_seconds=1.0)
    p = Problem('def add_1(x):\n    """Return x plus 1."""', "\n    return x + 1", "code", "python",
                {"entry": "add_1", "tests": [[[0], 1], [[1], 2], [[5], 6], [[-1], 0]]})
    assert task.score(p, "\n    return x + 1 if x < 1 else 0\n") == 0.5
    assert task.score(p, "\n    return x + 1\n\ndef other():\n    pass") == 1.0  # body ends at column 0
    assert task.score(p, "\n    while x > 1:\n        pass\n    return x + 1") == 0.5  # two pass, then a hang
    assert task.score(p, "\n    return True") == 0.0  # bool is not int: compared by exact type
    forged = f"\n    print('\\n{'0' * 16} 0 1')\n    return None"
    assert task.score(p, forged) == 0.0  # result lines need the secret token


def test_python_grader_holds_no_answers_in_the_completions_process():
    """Code that inspects its caller's frames finds only the tests' inputs (a review scored full
    marks for a wrong body by reading ``want`` there, or by replacing the checker, when the
    answers were compared inside the sandboxed process); a result line it forges with the secret
    token must still hold the right answer."""
    task = PythonFunctions(wall_seconds=1.0)
    p = Problem('def add_1(x):\n    """Return x plus 1."""', "\n    return x + 1", "code", "python",
                {"entry": "add_1", "tests": [[[0], 1], [[1], 2], [[5], 6], [[-1], 0]]})
    walk = "\n    import sys\n    f, seen = sys._getframe(1), {}\n    while f:\n" \
           "        seen.update(f.f_locals); seen.update(f.f_globals); f = f.f_back\n"
    assert task.score(p, walk + "    return seen.get('want', seen.get('expected'))") == 0.0
    assert task.score(p, walk + "    seen['_same'] = lambda a, b: True\n    return None") == 0.0
    forge = walk + ("    import os\n    for i in range(4):\n"
                    "        os.write(1, f\"\\n{seen['token']} {i} 7\\n\".encode())\n    os._exit(0)")
    assert task.score(p, forge) == 0.0
    assert task.score(p, walk + "    return x + 1") == 1.0  # the same frame walk, then a right body


GARBAGE = ["", "\n", "\n\n\n", "\x00", "\udc80 lone surrogate", "💥" * 50, "-" * 5000, "1" * 200,
           "    ", "def f(): pass", "    return (" * 300, "    import os; os._exit(0)",
           "    raise SystemExit(5)", "    import sys; sys.stdout.close()", "\t\treturn 1\n  x"]


@pytest.mark.parametrize("name", TASK_NAMES)
def test_scorers_never_raise_on_garbage(name):
    task = PythonFunctions(wall_seconds=1.0) if name == "python" else get_task(name, partial=True) \
        if name != "arithmetic" else get_task(name)
    p = task.sample(random.Random(5))
    for completion in GARBAGE:
        assert 0.0 <= task.score(p, completion) <= 1.0, completion


def test_options_and_errors():
    with pytest.raises(ValueError, match="known tasks: arithmetic, sorting, string_edit, python"):
        get_task("chess")
    with pytest.raises(ValueError, match="has no option 'digitz'.*digits"):
        get_task("arithmetic", digitz=2)
    with pytest.raises(ValueError, match="ops must be"):
        get_task("arithmetic", ops="/")
    with pytest.raises(ValueError, match="not a valid int"):
        get_task("sorting", max_len="many")
    with pytest.raises(ValueError, match="unknown families"):
        get_task("python", families=("nope",))
    task = get_task("arithmetic", digits="2", ops="+-*", terms="3", negative="true")
    assert (task.digits, task.ops, task.terms, task.negative) == (2, "+-*", 3, True)
    assert parse_task("string_edit:ops=reverse,upper:partial=1") == get_task("string_edit", ops=("reverse", "upper"),
                                                                             partial=True)
    assert parse_task("python:families=add,square").families == ("add", "square")
    with pytest.raises(ValueError, match="expected key=value"):
        parse_task("sorting:partial")
