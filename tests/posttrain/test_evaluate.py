"""``openk3 eval``: accuracy equals a hand count, with a fake engine whose completions the test
chooses (text and code tasks) and with the real engine on a tiny model that always emits one
token; the held-out stream; the JSON report; errors naming the parameter."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from openk3 import build_model
from openk3.checkpoint import save_pretrained
from openk3.cli import main
from openk3.posttrain.config import EvalConfig
from openk3.posttrain.evaluate import evaluate, held_out_problems
from openk3.posttrain.tasks import get_task

from .conftest import tiny_config

pytestmark = pytest.mark.sandbox  # one such test at a time on the machine (conftest.py)


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


@dataclass
class Output:
    text: str
    token_ids: list[int]
    finish_reason: str


class FakeEngine:
    """Answers the i-th request of a ``generate`` call with ``answer(i, prompt)``."""

    def __init__(self, answer):
        self.tokenizer, self.answer, self.calls = CharTokenizer(), answer, []

    def generate(self, prompts, params):
        self.calls.append((prompts, params))
        texts = [self.answer(i, "".join(map(chr, p))) for i, p in enumerate(prompts)]
        return [Output(t, [0] * (i % 4 + 1), "length" if i % 4 == 3 else "stop") for i, t in enumerate(texts)]


def test_accuracy_is_the_hand_count(tmp_path):
    n, seed = 30, 5
    problems = held_out_problems(get_task("arithmetic"), n, seed)
    solutions = {p.prompt: p.answer for p in problems}
    right = [i % 3 == 0 for i in range(n)]  # every third completion is the answer, the rest "x"
    engine = FakeEngine(lambda i, prompt: solutions[prompt] + " " if right[i] else "x")
    out = tmp_path / "eval" / "r.json"
    cfg = EvalConfig(checkpoint="unused", task=("arithmetic",), num_problems=n, seed=seed, max_new_tokens=7,
                     out=str(out))
    report = evaluate(cfg, engine=engine)
    r = report["tasks"]["arithmetic"]
    assert r["accuracy"] == r["mean_score"] == sum(right) / n == 10 / 30
    assert r["mean_length"] == sum(i % 4 + 1 for i in range(n)) / n
    assert r["truncated"] == sum(i % 4 == 3 for i in range(n)) / n
    prompts, params = engine.calls[0]
    assert prompts == [CharTokenizer().encode(p.prompt) for p in problems]
    assert all(sp.temperature == 0 and sp.max_tokens == 7 and sp.stop == ("\n",) and sp.seed is None
               for sp in params)
    saved = json.loads(out.read_text())
    assert saved["config"]["num_problems"] == n and saved["checkpoint"] == "unused"
    samples = saved["tasks"]["arithmetic"]["samples"]
    assert [s["prompt"] for s in samples] == [p.prompt for p in problems]
    assert [s["score"] for s in samples] == [float(ok) for ok in right]
    assert samples[1] == {"prompt": problems[1].prompt, "answer": problems[1].answer, "completion": "x",
                          "score": 0.0, "tokens": 2}


def test_code_task_is_judged_by_its_hidden_tests():
    n = 4
    problems = held_out_problems(get_task("python"), n, 0)
    bodies = {p.prompt: p.answer for p in problems}
    engine = FakeEngine(lambda i, prompt: bodies[prompt.removeprefix("<low>")] if i % 2 == 0 else "\n    return None")
    cfg = EvalConfig(checkpoint="unused", task=("python",), num_problems=n, effort="low", temperature=0.5)
    r = evaluate(cfg, engine=engine)["tasks"]["python"]
    assert r["accuracy"] == r["mean_score"] == 0.5  # the reference passes every hidden test, None none
    prompts, params = engine.calls[0]
    assert "".join(map(chr, prompts[0])) == "<low>" + problems[0].prompt  # rl's prompt: effort text first
    assert params[0].stop == problems[0].stop and params[0].seed is not None and params[0].temperature == 0.5


def test_held_out_stream():
    task = get_task("sorting")
    a = held_out_problems(task, 20, 0)
    assert a == held_out_problems(task, 20, 0)
    assert a != held_out_problems(task, 20, 1)
    rng = random.Random(0)  # the stream `openk3 rl --seed 0` draws its problems from
    assert a != [task.sample(rng) for _ in range(20)]
    spec = EvalConfig(checkpoint="x", task=("sorting:max_len=3",)).task[0]
    report = evaluate(EvalConfig(checkpoint="x", task=(spec,), num_problems=5),
                      engine=FakeEngine(lambda i, p: ""))
    assert all(len(s["answer"].split()) == 3 for s in report["tasks"][spec]["samples"])


SYMBOLS = ["1", "<|bos|>", "<|eos|>", "\n", "0", *"23456789", "+", "-", "*", "=", "<|pad|>"]


@pytest.fixture(scope="module")
def always_one(tmp_path_factory):
    """A tiny model whose logits are all zero, so greedy decoding emits token 0, "1", forever."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    path = tmp_path_factory.mktemp("always_one")
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(SYMBOLS)}, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    model = build_model(tiny_config().replace(vocab_size=len(SYMBOLS)), seed=0)
    model.lm_head.weight.data.zero_()
    save_pretrained(model, path, extra_files={"tokenizer.json": tok.to_str().encode()})
    return path


def test_real_engine_through_the_cli(always_one, tmp_path, capsys):
    n, out = 40, tmp_path / "r.json"
    rc = main(["eval", "--checkpoint", str(always_one), "--task", "arithmetic", "--num-problems", str(n),
               "--max-new-tokens", "1", "--seed", "3", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    want = sum(p.answer == "1" for p in held_out_problems(get_task("arithmetic"), n, 3))
    assert 0 < want < n
    r = json.loads(out.read_text())["tasks"]["arithmetic"]
    assert r["accuracy"] == want / n and r["mean_length"] == 1.0 and r["truncated"] == 1.0
    assert all(s["completion"] == "1" for s in r["samples"])
    table = capsys.readouterr().out
    assert "arithmetic" in table and f"{want / n:.3f}" in table


def test_an_rl_run_is_a_checkpoint(always_one, tmp_path):
    """An rl / distill run directory (run_config.json with "posttrain", weights in export/) loads,
    as ``rl --checkpoint`` and ``distill --teacher`` take it."""
    import shutil

    run = tmp_path / "rl"
    shutil.copytree(always_one, run / "export")
    (run / "run_config.json").write_text(json.dumps({"posttrain": {}, "model": {}}))
    r = evaluate(EvalConfig(checkpoint=str(run), num_problems=3, max_new_tokens=1, device="cpu"))
    assert all(s["completion"] == "1" for s in r["tasks"]["arithmetic"]["samples"])


def test_errors_name_the_parameter(always_one, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--task 'nope'.*unknown task 'nope'; known tasks: arithmetic"):
        EvalConfig(checkpoint="x", task=("nope",))
    with pytest.raises(ValueError, match=r"--task 'sorting:size=3'.*no option 'size'"):
        EvalConfig(checkpoint="x", task=("sorting:size=3",))
    with pytest.raises(ValueError, match="--task .*named twice"):
        EvalConfig(checkpoint="x", task=("sorting", "sorting"))
    with pytest.raises(ValueError, match="--num-problems 0"):
        EvalConfig(checkpoint="x", num_problems=0)
    with pytest.raises(ValueError, match="--checkpoint ''"):
        EvalConfig()
    with pytest.raises(ValueError, match="--checkpoint .*missing.*no such directory"):
        evaluate(EvalConfig(checkpoint=str(tmp_path / "missing"), num_problems=1, device="cpu"))
    with pytest.raises(ValueError, match="--checkpoint .*cannot load a model.*no tokenizer"):
        evaluate(EvalConfig(checkpoint=str(tmp_path), num_problems=1, device="cpu"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.json").write_text("{}")
    with pytest.raises(ValueError, match="--checkpoint .*training run without export"):
        evaluate(EvalConfig(checkpoint=str(run), num_problems=1, device="cpu"))
    assert main(["eval", "--checkpoint", str(always_one), "--task", "arithmetic", "nope"]) == 2
    assert "--task 'nope'" in capsys.readouterr().err


def test_task_specs():
    from openk3.posttrain.tasks import Arithmetic, parse_task

    assert parse_task("arithmetic:digits=2", {"ops": "+", "digits": 3}) == Arithmetic(digits=2, ops="+")
    with pytest.raises(ValueError, match="expected NAME:key=value"):
        parse_task("arithmetic:digits", {})
