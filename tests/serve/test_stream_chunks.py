"""The stream chunks' JSON text (built from a per-choice prefix, ``protocol._ChunkJSON``) is
``json.dumps`` of the chunk objects byte for byte, for completions and chat, with and without
log-probs, across choices, at the finish and in the usage chunk."""

from __future__ import annotations

import asyncio
import json

import pytest

from openk3.serve.engine import Logprob, RequestOutput
from openk3.serve.protocol import (
    chat_chunks,
    completion_chunks,
    completion_logprobs,
    usage,
)
from openk3.tokenizer import ByteTokenizer

HEAD = {"id": "cmpl-x\"y", "object": "text_completion", "created": 1700000000, "model": "m\u00e9"}
TEXTS = ["a", "\"quoted\"\n", "\u00e9\u4e2d", "\\", ""]


def outputs(n: int, logprobs: bool) -> list[tuple[int, RequestOutput]]:
    """Each of ``n`` choices' outputs over ``TEXTS``, the choices interleaved; the last finishes."""
    items = []
    for step, delta in enumerate(TEXTS):
        for i in range(n):
            text = "".join(TEXTS[:step + 1])
            lps = [Logprob(97, -0.5 * j, {97: -0.5 * j, 98: -2.0}) for j in range(step + 1)] if logprobs else None
            last = step == len(TEXTS) - 1
            items.append((i, RequestOutput(f"r{i}", [1, 2], [97] * (step + 1), text, [97], delta, lps,
                                           last, "length" if last else None, 1)))
    return items


async def collect(chunks) -> list[str]:
    return [c async for c in chunks]


async def feed(items):
    for item in items:
        yield item


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("logprobs", [False, True])
def test_completion_chunks_are_json_dumps_of_the_chunk_objects(n, logprobs):
    tok, items = ByteTokenizer(), outputs(n, logprobs)
    got = asyncio.run(collect(completion_chunks(tok, feed(items), HEAD, True, n, [None] * n)))
    expected, sent, offsets = [], {}, {}
    for i, out in items:
        lp = None
        if logprobs:
            lp = completion_logprobs(tok, out.logprobs[sent.get(i, 0):], offsets.get(i, 0))
            sent[i] = len(out.logprobs)
            if lp["tokens"]:  # text_offset counts the tokens' text, not the text sent (held back)
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        expected.append({**HEAD, "choices": [{"index": i, "text": out.delta_text, "logprobs": lp,
                                              "finish_reason": out.finish_reason}]})
    expected.append({**HEAD, "choices": [], "usage": usage([o for _, o in items[-n:]], n)})
    assert got == [json.dumps(e) for e in expected]


@pytest.mark.parametrize("n", [1, 2])
def test_chat_chunks_are_json_dumps_of_the_chunk_objects(n):
    items = outputs(n, False)
    got = asyncio.run(collect(chat_chunks(ByteTokenizer(), feed(items), HEAD, False, n, [None] * n)))
    expected = [{**HEAD, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]} for i in range(n)]
    expected += [{**HEAD, "choices": [{"index": i, "delta": {"content": o.delta_text} if o.delta_text else {},
                                       "logprobs": None, "finish_reason": o.finish_reason}]}
                 for i, o in items if o.delta_text or o.finished]
    assert got == [json.dumps(e) for e in expected]
