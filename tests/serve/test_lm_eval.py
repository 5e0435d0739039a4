"""lm-evaluation-harness against ``openk3 serve``, as its users run it: lm-eval's
``local-completions`` model on a multiple-choice task read from a local file (no downloads),
scoring each choice through ``/v1/completions`` with ``echo`` and ``logprobs``. The
log-likelihoods it receives must be the model's own, from a plain forward pass.

lm-eval runs through its Python API (``simple_evaluate``, what its ``lm_eval`` command calls) in
a process of its own, with a ``TaskManager`` of this task alone: the command line always indexes
lm-eval's ~14,000 built-in task files first (~13 s on this project's CPU, more on CI's), which
tests lm-eval, not openk3. The process prepares while the server starts and waits for its
``/health`` before the first request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
httpx = pytest.importorskip("httpx")

import openk3  # noqa: E402
from openk3 import build_model, preset, save_pretrained  # noqa: E402
from openk3.tokenizer import load_tokenizer  # noqa: E402
from openk3.train.data import SPECIAL_TOKENS, train_bpe_tokenizer  # noqa: E402
from tests.helpers import kill_tree  # noqa: E402
from tests.serve.test_cli_serve import ENV, _free_port  # noqa: E402

QUESTIONS = [
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "label": 0},
    {"question": "import", "choices": [" os", " sys", " json"], "label": 1},
    {"question": "for i in", "choices": [" range(10):", " []:", " x:"], "label": 0},
    {"question": "class Foo", "choices": ["(object):", ":", "[]"], "label": 1},
]

TASK = """task: openk3_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A debug model with a BPE tokenizer, as a training run exports it."""
    root = tmp_path_factory.mktemp("lm_eval")
    tok = root / "tokenizer.json"
    train_bpe_tokenizer(["def f(x):\n    return x + 1\nimport os\nclass Foo(object):\n"] * 40, 300, tok)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIAL_TOKENS[2]}
    save_pretrained(build_model(preset("debug"), seed=4), root / "ckpt", extra_files={
        "tokenizer.json": tok.read_bytes(), "tokenizer_config.json": json.dumps(config).encode()})
    return root / "ckpt"


def _serve(checkpoint: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "openk3", "serve", "--checkpoint", str(checkpoint), "--port", str(port),
           "--served-model-name", "tiny", "--max-model-len", "256", "--no-cuda-graphs"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)


# lm-eval's side: its model and task built, then the server's /health awaited, then the
# evaluation; the results table on stdout, the samples (each choice's (context, continuation)
# and its [log-likelihood, is-greedy] answer) as JSON in argv[4].
LM_EVAL = """
import json, sys, time
import httpx
import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table
url, checkpoint, tasks, samples_out = sys.argv[1:5]
model = lm_eval.api.registry.get_model("local-completions").create_from_arg_obj(dict(
    model="tiny", base_url=url + "/v1/completions", tokenizer=checkpoint, tokenizer_backend="huggingface",
    max_retries=1))
manager = TaskManager(include_path=tasks, include_defaults=False)
deadline = time.monotonic() + 120
while True:
    try:
        if httpx.get(url + "/health", timeout=1).status_code == 200:
            break
    except httpx.TransportError:
        pass
    if time.monotonic() > deadline:
        sys.exit("openk3 serve did not come up")
    time.sleep(0.2)
results = lm_eval.simple_evaluate(model=model, tasks=["openk3_tiny_mc"], task_manager=manager, log_samples=True)
print(make_table(results))
with open(samples_out, "w") as f:
    json.dump(results["samples"]["openk3_tiny_mc"], f, default=str)
"""


def _loglikelihood(model, tok, context: str, continuation: str) -> float:
    """What lm-eval asks for, computed directly: log p(continuation | context), with the pair
    tokenised the way it does (the whole string, split at the context's length)."""
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


def test_lm_eval_local_completions_scores_with_the_models_logprobs(checkpoint, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tasks / "openk3_tiny_mc.yaml").write_text(TASK.format(data=tasks / "tiny_mc.jsonl"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**ENV, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_HOME": str(tmp_path / "hf")}
    server = _serve(checkpoint, port)
    try:
        run = subprocess.run([sys.executable, "-c", LM_EVAL, url, str(checkpoint), str(tasks),
                              str(tmp_path / "samples.json")], capture_output=True, text=True, env=env, timeout=300)
        assert server.poll() is None, server.stdout.read()
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        kill_tree(server)  # its clean shutdown is test_cli_serve's (SIGINT, SIGTERM)
    assert "openk3_tiny_mc" in run.stdout and "acc" in run.stdout  # the results table
    docs = json.loads((tmp_path / "samples.json").read_text())
    assert len(docs) == len(QUESTIONS)
    model = openk3.load_pretrained(checkpoint, dtype=torch.float32)
    tok = load_tokenizer(checkpoint)
    scored = 0
    for doc in docs:  # one (context, continuation) request per choice, answered [[logprob, greedy]]
        for (context, continuation), resp in zip(doc["arguments"], doc["resps"]):
            want = _loglikelihood(model, tok, context, continuation)
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-4), (context, continuation)
            scored += 1
    assert scored == sum(len(q["choices"]) for q in QUESTIONS)
