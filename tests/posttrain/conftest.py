"""A tiny policy checkpoint with an 18-symbol tokenizer, and a toy task implementing the
tasks protocol (``Problem`` / ``Task`` of openk3/posttrain/tasks.py), for CPU tests in seconds."""

from __future__ import annotations

import fcntl
import json
import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from openk3 import build_model, preset
from openk3.checkpoint import save_pretrained


@pytest.fixture(autouse=True)
def one_sandbox_test_at_a_time(request):
    """Tests marked ``sandbox`` (they run sandboxed programs) hold a lock shared by every test
    process of the machine: test_sandbox.py checks that no sandbox process is left anywhere, which
    another process's sandboxed programs would break (scripts/test.sh runs two workers)."""
    if request.node.get_closest_marker("sandbox") is None:
        yield
        return
    with open(Path(tempfile.gettempdir(), f"openk3-tests-sandbox-{os.getuid()}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


SYMBOLS = ["<|pad|>", "<|bos|>", "<|eos|>", "\n", *"0123456789", "a", "<", ">", "q"]


def tiny_config(kda: bool = False):
    """Two layers, MoE and AttnRes; MLA only unless ``kda`` (the KDA references cost ~0.1 s per
    engine prefill on CPU, too much for tests that run many rounds)."""
    return preset("debug").replace(vocab_size=len(SYMBOLS), hidden_size=64, num_hidden_layers=2,
                                   full_attn_layers=(2,) if kda else (1, 2), attn_res_block_size=1,
                                   intermediate_size=128, moe_intermediate_size=32, moe_latent_size=48)


def write_checkpoint(path, seed: int = 0, kda: bool = False):
    """A random tiny policy and its character tokenizer in ``path`` (a checkpoint directory)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(SYMBOLS)}, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    model = build_model(tiny_config(kda), seed=seed)
    save_pretrained(model, path, extra_files={
        "tokenizer.json": tok.to_str().encode(),
        "tokenizer_config.json": json.dumps({"eos_token": "<|eos|>"}).encode()})
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("policy"))


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    domain: str
    task: str
    meta: dict = field(default_factory=dict)


class FixedAnswerTask:
    """Prompt ``q<digit>``; score 1 when the completion starts with ``answer``."""

    name, domain = "fixed", "toy"

    def __init__(self, answer: str = "7", domain: str = "toy"):
        self.answer, self.domain = answer, domain

    def sample(self, rng: random.Random) -> Problem:
        return Problem(f"q{rng.randrange(10)}", self.answer + "\n", self.domain, self.name)

    def score(self, problem: Problem, completion: str) -> float:
        return float(completion.startswith(self.answer))
