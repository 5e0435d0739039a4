"""The OpenAI wire format: request bodies, error bodies, and the JSON of responses and stream
chunks built from ``RequestOutput``. No HTTP here (that is ``server.py``).

Request bodies accept and ignore unknown fields; known ones are typed strictly (a string where a
number belongs is a 400 naming the field, not a silent conversion).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field

from openk3.serve.engine import Logprob, RequestOutput
from openk3.serve.sampler import SamplingParams

# Errors.


class APIError(Exception):
    """Answered as OpenAI's error object with HTTP ``status``; ``param`` names the request field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Request bodies.


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False  # a last chunk with ``usage`` and no choices


class SamplingRequest(BaseModel):
    """The fields both generation endpoints share."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None  # None: the served model
    temperature: float | None = None  # None here: SamplingParams' default
    top_p: float | None = None
    top_k: int | None = None  # extension (as in vLLM); 0 = off
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, ignored

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return SamplingParams(**{k: v for k, v in given.items() if v is not None}, seed=self.seed,
                              max_tokens=max_tokens, stop=stop, logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt; a list of one is fine
    max_tokens: int | None = 16
    logprobs: int | None = None  # top alternatives per token


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # None (and max_tokens None): up to the context
    max_tokens: int | None = None  # OpenAI's older name
    logprobs: bool = False
    top_logprobs: int | None = None


# Features the engine lacks: the value that means "off" (None is always accepted as well).
UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0,
               "logit_bias": None, "suffix": None}


def one_prompt(prompt: str | list) -> str | list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise APIError(400, f"{len(prompt)} prompts given; one per request is supported", "prompt")
        return prompt[0]
    return prompt


def message_text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    if any(p.type != "text" or p.text is None for p in m.content):
        raise APIError(400, "only text content parts are supported", "messages")
    return "".join(p.text for p in m.content)


# Responses and stream chunks.


def usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -Infinity; OpenAI reports -9999 too


def completion_logprobs(tokenizer, lps: list[Logprob], offset: int) -> dict:
    """Legacy completions format; ``text_offset`` counts characters of the generated text."""
    tokens = [tokenizer.decode([lp.token_id]) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in lps],
            "top_logprobs": [{tokenizer.decode([i]): _finite(v) for i, v in lp.top.items()} for lp in lps],
            "text_offset": offsets}


def chat_logprobs(tokenizer, lps: list[Logprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in lp.top.items()]} for lp in lps]}


def completion_choice(tokenizer, out: RequestOutput) -> dict:
    logprobs = None if out.logprobs is None else completion_logprobs(tokenizer, out.logprobs, 0)
    return {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}


def chat_choice(tokenizer, out: RequestOutput) -> dict:
    logprobs = None if out.logprobs is None else chat_logprobs(tokenizer, out.logprobs)
    return {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
            "finish_reason": out.finish_reason}


async def completion_chunks(tokenizer, outputs: AsyncIterator[RequestOutput], head: dict,
                            include_usage: bool) -> AsyncIterator[dict]:
    """``text_completion`` chunks: new text and log-probs as they come; ``head`` is the id,
    object, created and model every chunk repeats."""
    sent_logprobs = offset = 0
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            logprobs = None
            if out.logprobs is not None:
                logprobs = completion_logprobs(tokenizer, out.logprobs[sent_logprobs:], offset)
                sent_logprobs = len(out.logprobs)
                offset += sum(len(t) for t in logprobs["tokens"])
            if out.delta_text or out.finished or (logprobs and logprobs["tokens"]):
                yield {**head, "choices": [{"index": 0, "text": out.delta_text, "logprobs": logprobs,
                                            "finish_reason": out.finish_reason}]}
    if include_usage:
        yield {**head, "choices": [], "usage": usage(out)}


async def chat_chunks(tokenizer, outputs: AsyncIterator[RequestOutput], head: dict,
                      include_usage: bool) -> AsyncIterator[dict]:
    """``chat.completion.chunk`` objects: the assistant role first, then content deltas."""
    def chunk(delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
        return {**head, "choices": [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    sent_logprobs = 0
    async with contextlib.aclosing(outputs):
        yield chunk({"role": "assistant", "content": ""})
        async for out in outputs:
            logprobs = None
            if out.logprobs is not None and len(out.logprobs) > sent_logprobs:
                logprobs = chat_logprobs(tokenizer, out.logprobs[sent_logprobs:])
                sent_logprobs = len(out.logprobs)
            if out.delta_text or out.finished or logprobs:
                yield chunk({"content": out.delta_text} if out.delta_text else {}, logprobs,
                            out.finish_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": usage(out)}
