"""The OpenAI wire format: request bodies, error bodies, and the JSON of responses and stream
chunks built from ``RequestOutput``. No HTTP here (that is ``server.py``).

Request bodies accept and ignore unknown fields; known ones are typed strictly (a string where a
number belongs is a 400 naming the field, not a silent conversion).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
from collections.abc import AsyncIterator, Callable

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, field_validator

from openk3.serve.engine import Logprob, RequestOutput
from openk3.serve.multimodal import open_image
from openk3.serve.sampler import MAX_TOP_K, SamplingParams

MAX_N = 128  # choices per prompt, as OpenAI allows

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


def _null_is_default(*names: str):
    """A validator of the fields ``names`` (of the model or its subclasses) that reads an
    explicit JSON null as the field's default: OpenAI's API declares them nullable, and its
    Python client sends ``None`` as null."""

    @field_validator(*names, mode="before", check_fields=False)
    @classmethod
    def check(cls, value, info):
        return cls.model_fields[info.field_name].default if value is None else value

    return check


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False  # a last chunk with ``usage`` and no choices
    _nulls = _null_is_default("include_usage")


class SamplingRequest(BaseModel):
    """The fields both generation endpoints share."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None  # None: the served model
    temperature: float | None = None  # None here: SamplingParams' default
    top_p: float | None = None
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)  # extension (as in vLLM); 0 = off
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, ignored

    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt
    _nulls = _null_is_default("n", "stream", "echo", "logprobs")  # echo: completions; logprobs: chat's bool

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int = 0,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine parameters of choice number ``choice`` of a prompt: a seeded request's
        choices draw from seeds ``seed, seed + 1, ...``, so they differ and each is reproducible."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        seed = None if self.seed is None else (self.seed + choice + 2**63) % 2**64 - 2**63
        return SamplingParams(**{k: v for k, v in given.items() if v is not None}, seed=seed,
                              max_tokens=max_tokens, stop=stop, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or a list of prompts
    max_tokens: int | None = 16  # 0 (with echo): score the prompt, generate nothing
    logprobs: int | None = None  # top alternatives per token (prompt tokens too, with echo)
    echo: bool = False  # the prompt comes back before the completion (and its log-probs)


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    url: str  # a data URL only: data:image/png;base64,...
    detail: str | None = None  # accepted, ignored (the tower takes the image at its own resolution)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


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


# Features the engine lacks: the values that mean "off" (None, JSON null, is always accepted as
# well). A tool call or a response format would need a parser or constrained decoding: a request
# that demands one is refused, where "auto" lets the model answer in plain text.
UNSUPPORTED = {"best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
               "suffix": ("",), "tool_choice": ("none", "auto"), "response_format": ({"type": "text"},)}


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """The prompts of a completion request: a string or a list of token ids is one prompt; a
    list of strings or of id lists is several (each answered by ``n`` choices, in order)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def message_text(m: ChatMessage, index: int,
                 image: Callable[[ContentPart, str], str] | None = None) -> str:
    """The text of ``messages[index]``; an unknown role, or no content where one is required
    (every role but an assistant's), is a 400 naming the message. ``image(part, where)`` gives the
    text standing for an ``image_url`` part (``where``: ``messages[i].content[j]``); without it
    (a text-only model) an image part is a 400 naming the part."""
    if m.role not in CHAT_ROLES:
        raise APIError(400, f"messages[{index}].role {m.role!r} is not one of {list(CHAT_ROLES)}",
                       "messages")
    if m.content is None:
        if m.role != "assistant":
            raise APIError(400, f"messages[{index}].content is required for role {m.role!r}", "messages")
        return ""
    if isinstance(m.content, str):
        return m.content
    texts = []
    for j, p in enumerate(m.content):
        where = f"messages[{index}].content[{j}]"
        if p.type == "text" and p.text is not None:
            texts.append(p.text)
        elif p.type == "image_url" and image is None:
            raise APIError(400, f"{where}: this model is text-only (no vision tower): image_url "
                                "parts are not supported", "messages")
        elif p.type == "image_url":
            texts.append(image(p, where))
        else:
            raise APIError(400, f"{where}: a content part must be {{'type': 'text', 'text': ...}} or "
                                f"{{'type': 'image_url', 'image_url': {{'url': ...}}}}, got type {p.type!r}",
                           "messages")
    return "".join(texts)


def image_from_part(part: ContentPart, where: str, max_bytes: int) -> Image.Image:
    """The decoded image of an ``image_url`` content part, which must hold a base64 data URL
    (``data:image/png;base64,...``): nothing is downloaded. A missing URL, another scheme, bad
    base64, more than ``max_bytes`` decoded bytes or data that is no image is a 400 naming
    ``{where}.image_url``."""
    where += ".image_url"
    if part.image_url is None:
        raise APIError(400, f"{where} is required: {{'url': 'data:image/png;base64,...'}}", "messages")
    url = part.image_url.url
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise APIError(400, f"{where}: http(s) URLs are not fetched (no downloads); send the image "
                            "inline as a data URL: data:image/png;base64,...", "messages")
    if scheme != "data":
        raise APIError(400, f"{where}: unsupported URL {url[:32]!r}; only data URLs are accepted "
                            "(data:image/png;base64,...)", "messages")
    header, comma, payload = url[5:].partition(",")
    media_type, _, encoding = header.partition(";")
    if not comma or encoding.lower() != "base64" or not media_type.lower().startswith("image/"):
        raise APIError(400, f"{where}: a data URL must be data:image/<type>;base64,<data>, got "
                            f"{url[:40]!r}", "messages")
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:  # refuse before decoding
        raise APIError(400, f"{where}: the image is over the limit of {max_bytes} bytes", "messages")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise APIError(400, f"{where}: the data is not valid base64 ({e})", "messages") from e
    try:
        return open_image(data, where, max_bytes)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from e


# Responses and stream chunks. A request has one or more choices (prompts x n); ``outputs`` are
# ``(choice index, RequestOutput)`` pairs as the engine produces them, the choices interleaved.


def usage(outs: list[RequestOutput], n: int) -> dict:
    """Token counts of a whole response: ``outs`` in choice order, ``n`` choices per prompt (each
    prompt is counted once, as OpenAI does)."""
    firsts = outs[::n]
    p, c = sum(len(o.prompt_token_ids) for o in firsts), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)}}


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -Infinity; OpenAI reports -9999 too


def completion_logprobs(tokenizer, lps: list[Logprob | None], offset: int) -> dict:
    """Legacy completions format; ``text_offset`` counts characters from the start of the
    choice's text. A None entry (the first prompt token, which has no context) stays null."""
    tokens = [tokenizer.decode([lp.token_id]) for lp in lps if lp is not None]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens,
            "token_logprobs": [None if lp is None else _finite(lp.logprob) for lp in lps],
            "top_logprobs": [None if lp is None else {tokenizer.decode([i]): _finite(v) for i, v in lp.top.items()}
                             for lp in lps],
            "text_offset": offsets}


def _echo_logprobs(out: RequestOutput) -> list[Logprob | None]:
    """The prompt's entries of an echoed choice: null for the first token, then each token's."""
    lps = out.prompt_logprobs or []
    return [None] + lps[1:] if lps else []


def _first_prompt_token(tokenizer, out: RequestOutput) -> str:
    return tokenizer.decode(out.prompt_token_ids[:1])


def completion_choice(tokenizer, out: RequestOutput, index: int, echo: str | None) -> dict:
    """One choice of a finished completion; ``echo`` is the prompt text when the request echoes."""
    logprobs = None
    if out.logprobs is not None:
        lps = (_echo_logprobs(out) if echo is not None else []) + out.logprobs
        logprobs = completion_logprobs(tokenizer, lps, 0)
        if echo is not None:  # the first prompt token has no log-prob but is text
            logprobs["tokens"].insert(0, _first_prompt_token(tokenizer, out))
            logprobs["text_offset"] = _offsets(logprobs["tokens"])
    return {"index": index, "text": (echo or "") + out.text, "logprobs": logprobs,
            "finish_reason": out.finish_reason}


def _offsets(tokens: list[str]) -> list[int]:
    out, offset = [], 0
    for t in tokens:
        out.append(offset)
        offset += len(t)
    return out


def chat_logprobs(tokenizer, lps: list[Logprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in lp.top.items()]} for lp in lps]}


def chat_choice(tokenizer, out: RequestOutput, index: int, echo: str | None = None) -> dict:
    logprobs = None if out.logprobs is None else chat_logprobs(tokenizer, out.logprobs)
    return {"index": index, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
            "finish_reason": out.finish_reason}


class _ChunkJSON:
    """The JSON text of one-choice stream chunks, ``json.dumps`` of ``{**head, "choices": [{"index":
    i, field: value, "logprobs": ..., "finish_reason": ...}]}`` byte for byte, built from a
    per-choice prefix (made once per stream) so that each chunk encodes only its new values."""

    def __init__(self, head: dict, field: str):
        self.head, self.field = head, field
        self.prefixes: dict[int, str] = {}

    def __call__(self, index: int, value, logprobs: dict | None, finish_reason: str | None) -> str:
        prefix = self.prefixes.get(index)
        if prefix is None:  # everything up to the value: '{"id": ..., "choices": [{"index": 0, "text": '
            prefix = json.dumps({**self.head, "choices": [{"index": index, self.field: None}]})[:-len("null}]}")]
            self.prefixes[index] = prefix
        return (f'{prefix}{json.dumps(value)}, "logprobs": '
                f'{"null" if logprobs is None else json.dumps(logprobs)}, "finish_reason": '
                f'{"null" if finish_reason is None else json.dumps(finish_reason)}}}]}}')


async def completion_chunks(tokenizer, outputs: AsyncIterator[tuple[int, RequestOutput]], head: dict,
                            include_usage: bool, n: int, echoes: list[str | None]) -> AsyncIterator[str]:
    """``text_completion`` chunks, as JSON text: new text and log-probs of each choice as they come
    (an echoed prompt in the choice's first chunk); ``head`` is the id, object, created and model
    every chunk repeats; ``echoes[i]`` the prompt text of choice i when echoing."""
    encode = _ChunkJSON(head, "text")
    sent: dict[int, int] = {}  # choice -> log-probs sent
    offsets: dict[int, int] = {}  # choice -> characters of the tokens sent (text_offset goes by them)
    last: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(outputs):
        async for index, out in outputs:
            first = index not in last
            last[index] = out
            text, echo = out.delta_text, echoes[index]
            logprobs = None
            if out.logprobs is not None:
                lps = out.logprobs[sent.get(index, 0):]
                if first and echo is not None:
                    lps = _echo_logprobs(out) + lps
                logprobs = completion_logprobs(tokenizer, lps, offsets.get(index, 0))
                if first and echo is not None:
                    logprobs["tokens"].insert(0, _first_prompt_token(tokenizer, out))
                    logprobs["text_offset"] = _offsets(logprobs["tokens"])
                sent[index] = len(out.logprobs)
                if logprobs["tokens"]:  # the next token's offset: after this chunk's tokens' text
                    offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            if first and echo is not None:
                text = echo + text
            if text or out.finished or (logprobs and logprobs["tokens"]):
                yield encode(index, text, logprobs, out.finish_reason)
    if include_usage:
        yield json.dumps({**head, "choices": [], "usage": usage([last[i] for i in sorted(last)], n)})


async def chat_chunks(tokenizer, outputs: AsyncIterator[tuple[int, RequestOutput]], head: dict,
                      include_usage: bool, n: int, echoes: list[str | None]) -> AsyncIterator[str]:
    """``chat.completion.chunk`` objects, as JSON text: each choice's assistant role first, then
    content deltas."""
    encode = _ChunkJSON(head, "delta")
    sent: dict[int, int] = {}
    last: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(outputs):
        for index in range(len(echoes)):
            yield encode(index, {"role": "assistant", "content": ""}, None, None)
        async for index, out in outputs:
            last[index] = out
            logprobs = None
            if out.logprobs is not None and len(out.logprobs) > sent.get(index, 0):
                logprobs = chat_logprobs(tokenizer, out.logprobs[sent.get(index, 0):])
                sent[index] = len(out.logprobs)
            if out.delta_text or out.finished or logprobs:
                yield encode(index, {"content": out.delta_text} if out.delta_text else {}, logprobs,
                             out.finish_reason)
    if include_usage:
        yield json.dumps({**head, "choices": [], "usage": usage([last[i] for i in sorted(last)], n)})
