"""OpenAI-compatible HTTP server over ``AsyncEngine`` (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` for
server-sent events), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text).
With an API key, every ``/v1/*`` call needs ``Authorization: Bearer KEY``.

Every error has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``; bad input is
HTTP 400 naming the request parameter at fault. One prompt and one choice (``n`` = 1) per request.
A client that goes away, streaming or not, aborts its request: the engine frees its cache.

``build_app`` wraps an engine for tests and embedding; ``serve`` runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from openk3.serve.chat import ChatTemplate, ChatTemplateError
from openk3.serve.engine import AsyncEngine, EngineStats, Logprob, RequestOutput
from openk3.serve.sampler import InvalidRequest, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Request bodies. Unknown fields are accepted and ignored; known ones are typed strictly (a
# string where a number belongs is a 400 naming the field, not a silent conversion).


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False  # a last chunk with ``usage`` and no choices


class _SamplingRequest(BaseModel):
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


class CompletionRequest(_SamplingRequest):
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


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # None (and max_tokens None): up to the context
    max_tokens: int | None = None  # OpenAI's older name
    logprobs: bool = False
    top_logprobs: int | None = None


# Features the engine lacks: the value that means "off" (None is always accepted as well).
_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0,
                "logit_bias": None, "suffix": None}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def _error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
                code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Metrics.


class Histogram:
    """A Prometheus histogram (cumulative buckets, upper bounds in seconds)."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1

    def lines(self) -> list[str]:
        n = self.name
        out = [f"# HELP {n} {self.help}", f"# TYPE {n} histogram"]
        out += [f'{n}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{n}_bucket{{le="+Inf"}} {self.count}', f"{n}_sum {self.sum}", f"{n}_count {self.count}"]


class Metrics:
    """Latencies measured by the server, plus the engine's counters at scrape time."""

    def __init__(self):
        self.ttft = Histogram("openk3_time_to_first_token_seconds", "Request arrival to first token.",
                              (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80))
        self.itl = Histogram("openk3_inter_token_latency_seconds", "Time between consecutive tokens.",
                             (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5))
        self.e2e = Histogram("openk3_e2e_request_latency_seconds", "Request arrival to last token.",
                             (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320))
        self.finished: Counter[str] = Counter()  # by finish_reason

    def render(self, s: EngineStats) -> str:
        lines: list[str] = []

        def add(name: str, kind: str, help: str, samples: dict[str, float]) -> None:
            lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value}" for labels, value in samples.items())

        add("openk3_prompt_tokens_total", "counter", "Prompt tokens computed (prefix-cache hits excluded).",
            {"": s.prompt_tokens})
        add("openk3_generation_tokens_total", "counter", "Tokens generated.", {"": s.generation_tokens})
        add("openk3_requests_finished_total", "counter",
            "Requests ended, by finish reason (abort: the client left, or the engine failed).",
            {f'{{finish_reason="{r}"}}': n for r, n in sorted(self.finished.items())})
        add("openk3_num_requests_running", "gauge", "Requests in the running batch.", {"": s.num_running})
        add("openk3_num_requests_waiting", "gauge", "Requests queued for admission.", {"": s.num_waiting})
        add("openk3_cache_usage_ratio", "gauge", "Fraction of MLA cache blocks held by requests.",
            {"": s.cache_usage})
        add("openk3_prefix_cache_queries_total", "counter", "Admissions that looked up the prefix cache.",
            {"": s.prefix_queries})
        add("openk3_prefix_cache_hits_total", "counter", "Prefix-cache lookups that hit.", {"": s.prefix_hits})
        add("openk3_prefix_cache_hit_rate", "gauge", "prefix_cache_hits / prefix_cache_queries.",
            {"": s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0})
        add("openk3_prefix_cache_saved_tokens_total", "counter", "Prefill tokens skipped thanks to hits.",
            {"": s.prefix_tokens_saved})
        add("openk3_num_preemptions_total", "counter", "Requests preempted for lack of cache.",
            {"": s.num_preemptions})
        for h in (self.ttft, self.itl, self.e2e):
            lines.extend(h.lines())
        return "\n".join(lines) + "\n"


# Response pieces.


def _usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -Infinity; OpenAI reports -9999 too


def _completion_logprobs(tokenizer, lps: list[Logprob], offset: int) -> dict:
    """Legacy completions format; ``text_offset`` counts characters of the generated text."""
    tokens = [tokenizer.decode([lp.token_id]) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in lps],
            "top_logprobs": [{tokenizer.decode([i]): _finite(v) for i, v in lp.top.items()} for lp in lps],
            "text_offset": offsets}


def _chat_logprobs(tokenizer, lps: list[Logprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in lp.top.items()]} for lp in lps]}


def _one_prompt(prompt: str | list) -> str | list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise APIError(400, f"{len(prompt)} prompts given; one per request is supported", "prompt")
        return prompt[0]
    return prompt


def _message_text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    if any(p.type != "text" or p.text is None for p in m.content):
        raise APIError(400, "only text content parts are supported", "messages")
    return "".join(p.text for p in m.content)


class _EventStream(StreamingResponse):
    """``text/event-stream`` whose generator is closed however the response ends. When the client
    disconnects, Starlette cancels the task sending the stream and leaves the generator suspended;
    closing it here runs its ``finally`` blocks now, and they abort the engine request."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Each chunk as ``data: {json}``, then ``data: [DONE]``. An engine failure mid-stream becomes
    an error event: the 200 status line is already out."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:
            logger.exception("stream failed")
            yield f"data: {json.dumps(_error_body(str(e), 'server_error'))}\n\n"
    yield "data: [DONE]\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``await work``, or cancel it (aborting its engine request) and return None if the client
    disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op when it is done
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            last = out
    return last


class OpenAIServer:
    """The endpoints, over one ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine, model_name: str, chat_template: ChatTemplate):
        self.engine, self.model_name, self.chat_template = engine, model_name, chat_template
        self.tokenizer = engine.tokenizer
        self.metrics = Metrics()
        self.created = int(time.time())

    def _check(self, req: _SamplingRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "model_not_found")
        extra = req.model_extra or {}
        for name, off in _UNSUPPORTED.items():
            value = extra.get(name)
            if value is not None and value != off:
                raise APIError(400, f"{name}={value!r} is not supported (only {off!r})", name)

    def _sampling_params(self, req: _SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        given = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
        return SamplingParams(**{k: v for k, v in given.items() if v is not None}, seed=req.seed,
                              max_tokens=max_tokens, stop=stop, logprobs=logprobs)

    async def _generate(self, ids: list[int], params: SamplingParams,
                        request_id: str) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one request, timed for /metrics. Closing it aborts the request."""
        start, last, reason = time.monotonic(), None, "abort"  # unless the engine finishes it
        try:
            async with contextlib.aclosing(self.engine.generate(ids, params, request_id)) as outputs:
                async for out in outputs:
                    now = time.monotonic()
                    if out.delta_token_ids:
                        if last is None:
                            self.metrics.ttft.observe(now - start)
                        else:
                            self.metrics.itl.observe(now - last)
                        last = now
                    if out.finished:
                        reason = out.finish_reason
                        self.metrics.e2e.observe(now - start)
                    yield out
        finally:
            self.metrics.finished[reason] += 1

    def _head(self, prefix: str, object: str) -> dict:
        """id, object, created and model: the same in every chunk of a stream."""
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": object, "created": int(time.time()),
                "model": self.model_name}

    # /v1/completions

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        self._check(req)
        prompt = _one_prompt(req.prompt)
        params = self._sampling_params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
        ids = self.engine.validate(prompt, params)
        head = self._head("cmpl", "text_completion")

        def choice(out: RequestOutput) -> dict:
            logprobs = None if out.logprobs is None else _completion_logprobs(self.tokenizer, out.logprobs, 0)
            return {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}

        return await self._reply(req, request, self._generate(ids, params, head["id"]), head,
                                 self._completion_chunks, choice)

    async def _reply(self, req: _SamplingRequest, request: Request, outputs: AsyncIterator[RequestOutput],
                     head: dict, chunks, choice) -> Response:
        """Stream ``chunks(outputs, head, include_usage)`` as server-sent events, or wait for the
        final output and answer ``choice(out)`` with usage; 499 if the client left first."""
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return _EventStream(_sse(chunks(outputs, head, include_usage)))
        out = await _unless_disconnected(request, _last(outputs))
        if out is None:
            return Response(status_code=499)  # nobody is listening
        return JSONResponse({**head, "choices": [choice(out)], "usage": _usage(out)})

    async def _completion_chunks(self, outputs: AsyncIterator[RequestOutput], head: dict,
                                 include_usage: bool) -> AsyncIterator[dict]:
        sent_logprobs = offset = 0
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                logprobs = None
                if out.logprobs is not None:
                    logprobs = _completion_logprobs(self.tokenizer, out.logprobs[sent_logprobs:], offset)
                    sent_logprobs = len(out.logprobs)
                    offset += sum(len(t) for t in logprobs["tokens"])
                if out.delta_text or out.finished or (logprobs and logprobs["tokens"]):
                    yield {**head, "choices": [{"index": 0, "text": out.delta_text, "logprobs": logprobs,
                                                "finish_reason": out.finish_reason}]}
        if include_usage:
            yield {**head, "choices": [], "usage": _usage(out)}

    # /v1/chat/completions

    async def chat_completions(self, req: ChatCompletionRequest, request: Request) -> Response:
        self._check(req)
        if not req.messages:
            raise APIError(400, "messages is empty", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        messages = [{**m.model_dump(exclude_none=True), "content": _message_text(m)} for m in req.messages]
        ids = self.tokenizer.encode(self.chat_template.render(messages))
        limit = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.engine.engine.max_model_len - len(ids))
        try:
            params = self._sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
            self.engine.validate(ids, params)
        except InvalidRequest as e:  # name the chat request's fields, not the engine's
            param = {"prompt": "messages", "max_tokens": limit, "logprobs": "top_logprobs"}.get(e.param, e.param)
            raise APIError(400, f"{param}: {e.message}", param) from e
        head = self._head("chatcmpl", "chat.completion.chunk" if req.stream else "chat.completion")

        def choice(out: RequestOutput) -> dict:
            logprobs = None if out.logprobs is None else _chat_logprobs(self.tokenizer, out.logprobs)
            return {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
                    "finish_reason": out.finish_reason}

        return await self._reply(req, request, self._generate(ids, params, head["id"]), head,
                                 self._chat_chunks, choice)

    async def _chat_chunks(self, outputs: AsyncIterator[RequestOutput], head: dict,
                           include_usage: bool) -> AsyncIterator[dict]:
        def chunk(delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
            return {**head, "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

        sent_logprobs = 0
        async with contextlib.aclosing(outputs):
            yield chunk({"role": "assistant", "content": ""})
            async for out in outputs:
                logprobs = None
                if out.logprobs is not None and len(out.logprobs) > sent_logprobs:
                    logprobs = _chat_logprobs(self.tokenizer, out.logprobs[sent_logprobs:])
                    sent_logprobs = len(out.logprobs)
                if out.delta_text or out.finished or logprobs:
                    yield chunk({"content": out.delta_text} if out.delta_text else {}, logprobs,
                                out.finish_reason)
        if include_usage:
            yield {**head, "choices": [], "usage": _usage(out)}

    # The rest.

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "openk3",
                                            "max_model_len": self.engine.engine.max_model_len}]}

    async def health(self) -> Response:
        if not self.engine.is_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        return PlainTextResponse(self.metrics.render(self.engine.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")


def _require_api_key(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    return check


def _validation_error(e: RequestValidationError, content_type: str) -> APIError:
    """pydantic's first complaint, naming the top-level field (loc is ("body", field, ...))."""
    err = e.errors()[0]
    if err["type"] == "json_invalid":  # loc[1] is the offset
        return APIError(400, f"request body: {err['msg']} ({err.get('ctx', {}).get('error', '')})")
    loc = err["loc"][1:]
    if not loc:
        hint = "" if "json" in content_type else " (send JSON, with 'Content-Type: application/json')"
        return APIError(400, f"request body: {err['msg']}{hint}")
    return APIError(400, f"{'.'.join(map(str, loc))}: {err['msg']}", loc[0] if isinstance(loc[0], str) else None)


async def _handle_error(request: Request, e: Exception) -> JSONResponse:
    """Every failure as OpenAI's error object."""
    if isinstance(e, InvalidRequest):
        e = APIError(400, str(e), e.param)
    elif isinstance(e, ChatTemplateError):
        e = APIError(400, str(e), "messages")
    elif isinstance(e, RequestValidationError):
        e = _validation_error(e, request.headers.get("content-type", ""))
    elif isinstance(e, HTTPException):
        e = APIError(e.status_code, str(e.detail))
    elif not isinstance(e, APIError):
        e = APIError(500, f"internal error: {e!r}", type="server_error")
    return JSONResponse(_error_body(e.message, e.type, e.param, e.code), status_code=e.status)


def build_app(async_engine: AsyncEngine, model_name: str, api_key: str | None = None,
              chat_template: ChatTemplate | None = None) -> FastAPI:
    """The HTTP app over ``async_engine``; ``chat_template`` None is ``chat.DEFAULT_CHAT_TEMPLATE``."""
    server = OpenAIServer(async_engine, model_name, chat_template or ChatTemplate())
    app = FastAPI(title="openk3", summary="OpenAI-compatible API of the openk3 serving engine")
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_require_api_key(api_key))] if api_key else [])
    v1.add_api_route("/completions", server.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", server.chat_completions, methods=["POST"])
    v1.add_api_route("/models", server.models, methods=["GET"])
    app.include_router(v1)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])

    for error in (APIError, InvalidRequest, ChatTemplateError, RequestValidationError, HTTPException,
                  Exception):
        app.add_exception_handler(error, _handle_error)
    return app


def serve(async_engine: AsyncEngine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, chat_template: ChatTemplate | None = None) -> None:
    """Serve until interrupted, then stop the engine."""
    app = build_app(async_engine, model_name, api_key, chat_template)
    try:
        # open streams would hold shutdown up forever; give them a few seconds
        uvicorn.run(app, host=host, port=port, timeout_graceful_shutdown=5)
    finally:
        async_engine.shutdown()
