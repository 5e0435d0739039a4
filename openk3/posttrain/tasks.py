"""Verifiable tasks for RL, generated locally (no downloads): arithmetic, sorting, string edits,
and small Python functions judged by hidden unit tests run in the sandbox.

A task samples a ``Problem`` (a short prompt the model continues, its reference answer) from a
``random.Random`` and scores a completion in [0, 1]. Prompts are short and regular so that the
``debug`` model (a byte-level BPE model pre-trained on Python source) can get some right and RL
has something to improve:

    arithmetic    "12+7="                 -> "19"
    sorting       "sort 3 1 2:"           -> "1 2 3"
    string_edit   "reverse abc:"          -> "cba"
    python        def add_7(x): + docstring "Return x plus 7."  -> "\\n    return x + 7"

Completions end at a newline: the text tasks score the completion's first line only (leading and
trailing whitespace ignored), so generation can stop at ``Problem.stop`` = ("\\n",). A Python
completion is the function body: its lines up to the first non-empty line that starts at column
0; ``Problem.stop`` holds stop strings for that. The prompt ends at the docstring's closing
quotes and the body starts with the newline: a byte-level BPE splits "\\n    return" into
"\\n   " + " return", so a prompt ending in "\\n" would end on a token that the solved text
never has there (a model pre-trained on that text then starts a new function instead of the
body). Options (difficulty) are the task's dataclass fields:
``get_task("arithmetic", digits=2, ops="+-*")``. docs/posttraining.md, "Tasks".
"""

from __future__ import annotations

import ast
import dataclasses
import random
import re
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from openk3.posttrain.sandbox import SandboxLimits, run_python

TEXT_STOP = ("\n",)
PYTHON_STOP = ("\n\n", "\ndef ", "\nclass ")


@dataclass(frozen=True)
class Problem:
    """One prompt. ``answer`` is the reference answer (plain text, what a perfect completion's
    first line is, or for ``python`` the reference body); ``meta`` is task-private data the
    scorer needs (hidden tests), JSON-serialisable; ``stop`` the stop strings for generation."""

    prompt: str
    answer: str
    domain: str  # "math" | "code" | "text"
    task: str
    meta: dict = field(default_factory=dict)
    stop: tuple[str, ...] = TEXT_STOP


class Task(Protocol):
    name: str
    domain: str

    def sample(self, rng: random.Random) -> Problem: ...

    def score(self, problem: Problem, completion: str) -> float: ...


def first_line(completion: str) -> str:
    """What the text tasks score: the completion up to its first newline, stripped."""
    return completion.split("\n", 1)[0].strip() if isinstance(completion, str) else ""


def _overlap(got: list | str, want: list | str) -> float:
    """Partial credit: the fraction of positions where ``got`` matches ``want`` (over the longer)."""
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1)


def _check(ok: bool, task: str, message: str) -> None:
    if not ok:
        raise ValueError(f"task {task!r}: {message}")


@dataclass(frozen=True)
class Arithmetic:
    """``terms`` non-negative integers of up to ``digits`` digits joined by operators from
    ``ops`` (usual precedence), e.g. "12+7=" -> "19". Results are non-negative unless
    ``negative``. Score 1 for the exact integer, else 0."""

    digits: int = 1
    ops: str = "+-"
    terms: int = 2
    negative: bool = False
    name: ClassVar[str] = "arithmetic"
    domain: ClassVar[str] = "math"

    def __post_init__(self):
        _check(1 <= self.digits <= 9, self.name, f"digits must be in [1, 9], got {self.digits}")
        _check(bool(self.ops) and set(self.ops) <= set("+-*"), self.name,
               f"ops must be a non-empty string of + - *, got {self.ops!r}")
        _check(2 <= self.terms <= 8, self.name, f"terms must be in [2, 8], got {self.terms}")

    def sample(self, rng: random.Random) -> Problem:
        while True:
            nums = [rng.randrange(10 ** self.digits) for _ in range(self.terms)]
            ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
            value = _evaluate(nums, ops)
            if value >= 0 or self.negative:
                break
        expr = "".join(f"{n}{op}" for n, op in zip(nums, ops)) + str(nums[-1])
        return Problem(f"{expr}=", str(value), self.domain, self.name)

    def score(self, problem: Problem, completion: str) -> float:
        # ASCII digits only (``\d`` takes any script's), and no longer than the answer (which
        # reaches ~72 digits; the length cap keeps int() of a long line cheap)
        got = first_line(completion)
        return float(len(got) <= len(problem.answer) + 1 and re.fullmatch(r"-?[0-9]+", got) is not None
                     and int(got) == int(problem.answer))


def _evaluate(nums: list[int], ops: list[str]) -> int:
    """``nums[0] ops[0] nums[1] ...`` with * before + and -."""
    total, term = 0, nums[0]
    sign = 1
    for op, n in zip(ops, nums[1:]):
        if op == "*":
            term *= n
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), n
    return total + sign * term


@dataclass(frozen=True)
class Sorting:
    """Sort ``min_len``..``max_len`` integers in [0, ``max_value``] ascending:
    "sort 3 1 2:" -> "1 2 3". Score 1 for the exact sequence, else 0 (``partial``: the
    fraction of positions right)."""

    min_len: int = 3
    max_len: int = 5
    max_value: int = 9
    partial: bool = False
    name: ClassVar[str] = "sorting"
    domain: ClassVar[str] = "text"

    def __post_init__(self):
        _check(1 <= self.min_len <= self.max_len <= 64, self.name,
               f"need 1 <= min_len <= max_len <= 64, got {self.min_len}, {self.max_len}")
        _check(self.max_value >= 1, self.name, f"max_value must be >= 1, got {self.max_value}")

    def sample(self, rng: random.Random) -> Problem:
        nums = [rng.randint(0, self.max_value) for _ in range(rng.randint(self.min_len, self.max_len))]
        return Problem(f"sort {' '.join(map(str, nums))}:", " ".join(map(str, sorted(nums))),
                       self.domain, self.name)

    def score(self, problem: Problem, completion: str) -> float:
        got, want = first_line(completion).split(), problem.answer.split()
        return 1.0 if got == want else _overlap(got, want) if self.partial else 0.0


_EDITS = ("reverse", "upper", "delete", "replace")


@dataclass(frozen=True)
class StringEdit:
    """One edit of a random word of ``min_len``..``max_len`` letters from ``alphabet``:
    "reverse abc:" -> "cba", "upper abc:" -> "ABC", "delete b from abcb:" -> "ac",
    "replace a with x in abca:" -> "xbcx". Score 1 for the exact string, else 0 (``partial``:
    the fraction of character positions right)."""

    ops: tuple[str, ...] = _EDITS
    min_len: int = 3
    max_len: int = 6
    alphabet: str = "abcdefgh"
    partial: bool = False
    name: ClassVar[str] = "string_edit"
    domain: ClassVar[str] = "text"

    def __post_init__(self):
        object.__setattr__(self, "ops", tuple(self.ops))
        _check(bool(self.ops) and set(self.ops) <= set(_EDITS), self.name,
               f"ops must be a non-empty subset of {_EDITS}, got {self.ops!r}")
        _check(2 <= self.min_len <= self.max_len <= 64, self.name,
               f"need 2 <= min_len <= max_len <= 64, got {self.min_len}, {self.max_len}")
        _check(len(set(self.alphabet)) >= 2 and self.alphabet.isalpha() and self.alphabet.islower(),
               self.name, f"alphabet must hold >= 2 distinct lowercase letters, got {self.alphabet!r}")

    def sample(self, rng: random.Random) -> Problem:
        op = rng.choice(self.ops)
        while True:  # a word with >= 2 distinct letters: deleting one never leaves nothing
            word = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
            if len(set(word)) >= 2:
                break
        c = rng.choice(word)
        if op == "reverse":
            prompt, answer = f"reverse {word}:", word[::-1]
        elif op == "upper":
            prompt, answer = f"upper {word}:", word.upper()
        elif op == "delete":
            prompt, answer = f"delete {c} from {word}:", word.replace(c, "")
        else:
            new = rng.choice(sorted(set(self.alphabet) - {c}))
            prompt, answer = f"replace {c} with {new} in {word}:", word.replace(c, new)
        return Problem(prompt, answer, self.domain, self.name, {"op": op})

    def score(self, problem: Problem, completion: str) -> float:
        got = first_line(completion)
        return 1.0 if got == problem.answer else _overlap(got, problem.answer) if self.partial else 0.0


# ------------------------------------------------------------------------------ python functions


def _ints(n: int) -> Callable[[random.Random], list]:
    return lambda rng: [rng.randint(-20, 20) for _ in range(n)]


def _int_list(rng: random.Random) -> list:
    return [[rng.randint(-9, 9) for _ in range(rng.randint(1, 6))]]


def _word(rng: random.Random) -> list:
    return ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 7)))]


@dataclass(frozen=True)
class _Family:
    """A kind of function. ``{k}`` in ``name``, ``doc`` and ``body`` is a constant drawn from
    ``k``; ``expected(k, *args)`` computes the hidden tests' answers (trusted code, ours)."""

    name: str
    params: str
    doc: str
    body: str
    expected: Callable
    inputs: Callable[[random.Random], list]
    k: tuple[int, int] = (2, 9)


FAMILIES: dict[str, _Family] = {
    "add": _Family("add_{k}", "x", "Return x plus {k}.", "return x + {k}", lambda k, x: x + k, _ints(1)),
    "sub": _Family("sub_{k}", "x", "Return x minus {k}.", "return x - {k}", lambda k, x: x - k, _ints(1)),
    "times": _Family("times_{k}", "x", "Return x times {k}.", "return x * {k}", lambda k, x: x * k, _ints(1)),
    "square": _Family("square", "x", "Return x squared.", "return x * x", lambda k, x: x * x, _ints(1)),
    "is_even": _Family("is_even", "x", "Return True if x is even, else False.", "return x % 2 == 0",
        lambda k, x: x % 2 == 0, _ints(1)),
    "larger": _Family("larger", "a, b", "Return the larger of a and b.", "return max(a, b)",
        lambda k, a, b: max(a, b), _ints(2)),
    "smaller": _Family("smaller", "a, b", "Return the smaller of a and b.", "return min(a, b)",
        lambda k, a, b: min(a, b), _ints(2)),
    "distance": _Family("distance", "a, b", "Return the absolute difference of a and b.", "return abs(a - b)",
        lambda k, a, b: abs(a - b), _ints(2)),
    "total": _Family("total", "xs", "Return the sum of the numbers in xs.", "return sum(xs)",
        lambda k, xs: sum(xs), _int_list),
    "size": _Family("size", "xs", "Return the number of items in xs.", "return len(xs)",
        lambda k, xs: len(xs), _int_list),
    "first": _Family("first", "xs", "Return the first item of xs.", "return xs[0]",
        lambda k, xs: xs[0], _int_list),
    "last": _Family("last", "xs", "Return the last item of xs.", "return xs[-1]",
        lambda k, xs: xs[-1], _int_list),
    "doubled": _Family("doubled", "xs", "Return a list of the items of xs, each doubled.",
        "return [x * 2 for x in xs]", lambda k, xs: [x * 2 for x in xs], _int_list),
    "above": _Family("above_{k}", "xs", "Return the items of xs greater than {k}, in order.",
        "return [x for x in xs if x > {k}]", lambda k, xs: [x for x in xs if x > k], _int_list, (0, 5)),
    "reverse": _Family("reverse", "s", "Return s reversed.", "return s[::-1]", lambda k, s: s[::-1], _word),
    "shout": _Family("shout", "s", "Return s in upper case.", "return s.upper()",
        lambda k, s: s.upper(), _word),
}

# Run once per completion, with the hidden tests' inputs and never their answers: after each
# test, a line "TOKEN INDEX REPR" straight to fd 1, where REPR is the result's repr if it is made
# only of the types an answer can have (bool, int, str, list; exact types, so an object claiming
# equality with everything gives nothing), the token read from stdin before the completion runs.
# The grader compares outside this process (``_graded``), so code that inspects its caller's
# frames finds no answer to copy and a checker to replace; a line it forges must hold the right
# answer, i.e. solve the test. The token keeps the completion's own prints from being read as
# results by accident, and a test that hangs keeps the lines written before it.
_HARNESS = """import os, sys


def _plain(x):
    t = type(x)
    return t in (bool, int, str) or t is list and all(_plain(i) for i in x)


def _main(token, inputs):
    namespace = {{"__name__": "solution"}}
    try:
        exec(compile({source!r}, "solution.py", "exec"), namespace)
        fn = namespace[{entry!r}]
    except BaseException:
        os._exit(0)
    for i, args in enumerate(inputs):
        try:
            got = fn(*args)
            if _plain(got):
                os.write(1, f"\\n{{token}} {{i}} {{got!r}}\\n".encode())
        except BaseException:
            pass
    os._exit(0)


_main(sys.stdin.readline().strip(), {inputs!r})
"""


def _same(a, b) -> bool:
    """Equal by exact type and value (bool is not int, a tuple is no list)."""
    if type(a) is not type(b):
        return False
    if type(a) is list:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _graded(stdout: str, token: str, tests: list) -> int:
    """How many of ``tests`` ([args, answer] pairs) the harness's result lines in ``stdout`` pass:
    the first line for each test index counts."""
    results = {}
    for line in stdout.splitlines():
        fields = line.split(" ", 2)
        if len(fields) == 3 and fields[0] == token and fields[1].isdigit():
            results.setdefault(int(fields[1]), fields[2])
    passed = 0
    for i, (_, want) in enumerate(tests):
        if i in results:
            try:
                passed += _same(ast.literal_eval(results[i]), want)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
    return passed


def function_body(completion: str) -> str:
    """The body a completion gives: its lines up to the first non-empty one at column 0."""
    lines = []
    for line in completion.split("\n") if isinstance(completion, str) else ():
        if line.strip() and not line[0].isspace():
            break
        lines.append(line)
    return "\n".join(lines).rstrip()


@dataclass(frozen=True)
class PythonFunctions:
    """A small function to complete: the prompt is its signature and docstring, the completion
    its body; score = the fraction of ``num_tests`` hidden unit tests it passes, run in the
    sandbox (``run_python``, ``wall_seconds`` each). ``families`` restricts the kinds of function
    (names in ``FAMILIES``; empty: all)."""

    num_tests: int = 5
    families: tuple[str, ...] = ()
    wall_seconds: float = 3.0
    name: ClassVar[str] = "python"
    domain: ClassVar[str] = "code"

    def __post_init__(self):
        object.__setattr__(self, "families", tuple(self.families))
        _check(1 <= self.num_tests <= 100, self.name, f"num_tests must be in [1, 100], got {self.num_tests}")
        unknown = set(self.families) - set(FAMILIES)
        _check(not unknown, self.name, f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
        _check(self.wall_seconds > 0, self.name, f"wall_seconds must be > 0, got {self.wall_seconds}")

    def sample(self, rng: random.Random) -> Problem:
        family = FAMILIES[rng.choice(self.families or tuple(FAMILIES))]
        k = rng.randint(*family.k)
        entry = family.name.format(k=k)
        prompt = f'def {entry}({family.params}):\n    """{family.doc.format(k=k)}"""'
        tests = []
        for _ in range(self.num_tests):
            args = family.inputs(rng)
            tests.append([args, family.expected(k, *args)])
        return Problem(prompt, "\n    " + family.body.format(k=k), self.domain, self.name,
                       {"entry": entry, "tests": tests}, PYTHON_STOP)

    def score(self, problem: Problem, completion: str) -> float:
        body = function_body(completion)
        if not body.strip():
            return 0.0
        tests = problem.meta["tests"]
        program = _HARNESS.format(source=problem.prompt + body + "\n", entry=problem.meta["entry"],
                                  inputs=[args for args, _ in tests])
        token = secrets.token_hex(8)
        limits = SandboxLimits(cpu_seconds=self.wall_seconds, wall_seconds=self.wall_seconds)
        result = run_python(program, stdin=token + "\n", limits=limits)
        return _graded(result.stdout, token, tests) / len(tests)


# ------------------------------------------------------------------------------------ registry

_TASKS = {cls.name: cls for cls in (Arithmetic, Sorting, StringEdit, PythonFunctions)}
TASK_NAMES: tuple[str, ...] = tuple(_TASKS)


def get_task(name: str, **options) -> Task:
    """The task ``name`` with ``options`` (its dataclass fields). Values may be strings, as from
    a command line: converted to the field's type (tuples from comma-separated lists)."""
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}")
    cls = _TASKS[name]
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, value in options.items():
        if key not in types:
            raise ValueError(f"task {name!r} has no option {key!r}; its options: {', '.join(types)}")
        if isinstance(value, str):
            options[key] = _convert(name, key, value, types[key])
        elif not _has_kind(value, types[key]):  # JSON gives numbers, bools and lists as they are
            raise ValueError(f"task {name!r}: option {key}={value!r} is not a valid {types[key]}")
        elif isinstance(value, list):
            options[key] = tuple(value)
    return cls(**options)


def _has_kind(value, kind: str) -> bool:
    """Whether a non-string option value is of its field's type (a bool is no int here)."""
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind.startswith("tuple"):
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    return False


def _convert(task: str, key: str, value: str, kind: str):
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            return {"true": True, "1": True, "yes": True,
                    "false": False, "0": False, "no": False}[value.lower()]
        if kind.startswith("tuple"):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value
    except (KeyError, ValueError):
        raise ValueError(f"task {task!r}: option {key}={value!r} is not a valid {kind}") from None


def parse_task(spec: str, options: dict | None = None) -> Task:
    """``"name"`` or ``"name:key=value:key=value"`` (e.g. ``arithmetic:digits=2:ops=+-*``);
    ``options`` apply under the spec's own."""
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"task options {options!r} must be a JSON object of option names and values")
    name, *pairs = spec.split(":")
    own = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise ValueError(f"task spec {spec!r}: expected key=value, got {pair!r} (expected NAME:key=value:...)")
        own[key.strip()] = value
    return get_task(name.strip(), **{**(options or {}), **own})


def score_all(task: Task, problems: list[Problem], completions: list[str],
              max_workers: int = 4) -> list[float]:
    """``task.score`` over pairs; the sandboxed python task runs ``max_workers`` at a time."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    if task.domain != "code" or max_workers <= 1:
        return [task.score(p, c) for p, c in zip(problems, completions)]
    with ThreadPoolExecutor(max_workers) as pool:
        return list(pool.map(task.score, problems, completions))
