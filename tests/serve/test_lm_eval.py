"""lm-evaluation-harness against ``openk3 serve``, as its users run it: ``lm_eval --model
local-completions`` on a multiple-choice task read from a local file (no downloads), scoring each
choice through ``/v1/completions`` with ``echo`` and ``logprobs``. The log-likelihoods it receives
must be the model's own, from a plain forward pass."""

from __future__ import annotations

import json
import signal
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
from tests.serve.test_cli_serve import ENV, _free_port, wait_until_healthy  # noqa: E402

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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        wait_until_healthy(proc, f"http://127.0.0.1:{port}")
    except BaseException:
        kill_tree(proc)
        raise
    return proc


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
    server = _serve(checkpoint, port)
    try:
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"model=tiny,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={checkpoint},"
               "tokenizer_backend=huggingface,max_retries=1",
               "--tasks", "openk3_tiny_mc", "--include_path", str(tasks), "--log_samples",
               "--output_path", str(tmp_path / "results")]
        env = {**ENV, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_HOME": str(tmp_path / "hf")}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(server)
            raise
    assert "openk3_tiny_mc" in run.stdout and "acc" in run.stdout  # the results table
    (samples,) = list((tmp_path / "results").rglob("samples_openk3_tiny_mc_*.jsonl"))
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(docs) == len(QUESTIONS)
    model = openk3.load_pretrained(checkpoint, dtype=torch.float32)
    tok = load_tokenizer(checkpoint)
    scored = 0
    for doc in docs:  # one (context, continuation) request per choice, answered [[logprob, greedy]]
        for args, resp in zip(doc["arguments"].values(), doc["resps"]):
            want = _loglikelihood(model, tok, args["arg_0"], args["arg_1"])
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-4), args
            scored += 1
    assert scored == sum(len(q["choices"]) for q in QUESTIONS)
