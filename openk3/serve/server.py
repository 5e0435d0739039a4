"""OpenAI-compatible HTTP server over ``AsyncEngine`` (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` for
server-sent events), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text,
``metrics.py``).
With an API key, every ``/v1/*`` call needs ``Authorization: Bearer KEY``.

Every error has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``; bad input is
HTTP 400 naming the request parameter at fault. A completion request may hold several prompts and
ask for ``n`` choices of each; every choice is its own engine request. ``echo`` with ``logprobs``
(and ``max_tokens`` 0) scores the prompt's own tokens, which lm-evaluation-harness relies on.
A client that goes away, streaming or not, aborts its request: the engine frees its cache.
Chat messages may hold ``image_url`` content parts (a model with a vision tower; base64 data
URLs only, never downloaded): each image's block of tokens goes where its part is
(``chat.encode_with_images``), and a malformed part is a 400 naming it
(``messages[0].content[1].image_url``).

The wire format (request models, response and chunk JSON) is ``protocol.py``; this file is the
app: endpoints, auth, disconnects, error handling. ``build_app`` wraps an engine for tests and
embedding; ``serve`` runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import secrets
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from openk3.serve.chat import ChatTemplate, ChatTemplateError, encode_with_images
from openk3.serve.config import GRACE_SECONDS, check_grace
from openk3.serve.engine import AsyncEngine, RequestOutput
from openk3.serve.inputs import Checked, utf8_text
from openk3.serve.metrics import ServerMetrics
from openk3.serve.multimodal import MultiModalInput, special_token_id
from openk3.serve.protocol import (
    UNSUPPORTED,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    chat_choice,
    chat_chunks,
    completion_choice,
    completion_chunks,
    error_body,
    image_from_part,
    message_text,
    prompt_list,
    usage,
)
from openk3.serve.sampler import InvalidRequest, SamplingParams
from openk3.vision.preprocess import image_prompt_ids

logger = logging.getLogger(__name__)
T = TypeVar("T")
SHUTDOWN_MESSAGE = "the server is shutting down; this response was cut at the end of its grace period"


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


class _ShuttingDown(Exception):
    """The server is stopping and a response ran out of its grace period."""


class Draining:
    """Graceful shutdown: once ``begin(seconds)`` is called (the server got SIGTERM or Ctrl-C),
    responses in flight get ``seconds`` to finish; then every engine stream still open fails with
    ``_ShuttingDown`` (``AsyncEngine.fail_all``), so each stream ends with an error event and
    ``[DONE]`` and each waiting request gets a 503: no client sees a connection cut silently.
    New requests get a 503 at once. Nothing is raced per chunk: a stream's next chunk is a plain
    ``await`` until the grace period ends."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.started = False

    def begin(self, seconds: float) -> None:
        if not self.started:
            self.started = True
            asyncio.get_running_loop().call_later(seconds, self.engine.fail_all, _ShuttingDown())


async def _sse(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Each chunk (JSON text) as ``data: {json}``, then ``data: [DONE]``. An engine failure
    mid-stream, or a shutdown that outlasts the stream's grace period, becomes an error event: the
    200 status line is already out."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield f"data: {chunk}\n\n"
        except _ShuttingDown:
            yield f"data: {json.dumps(error_body(SHUTDOWN_MESSAGE, 'server_error'))}\n\n"
        except Exception as e:
            logger.exception("stream failed")
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
    yield "data: [DONE]\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``await work``, or cancel it (aborting its engine request) and return None if the client
    disconnects first; a 503 if a shutdown's grace period ends first (``Draining``)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op when it is done
        with contextlib.suppress(asyncio.CancelledError):
            await gone
    if task in done:
        try:
            return task.result()
        except _ShuttingDown:
            raise APIError(503, SHUTDOWN_MESSAGE, type="server_error") from None
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _merged(streams: list[AsyncIterator[tuple[int, RequestOutput]]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(i, output)`` of every stream (each yields its own choice index ``i``), as they come.
    Closing it closes them all (aborting their engine requests); a failing stream fails it. One
    stream (n=1, one prompt: the common case) is returned as it is: no pump task, no queue."""
    return streams[0] if len(streams) == 1 else _interleaved(streams)


async def _interleaved(streams: list[AsyncIterator[tuple[int, RequestOutput]]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[tuple[int, RequestOutput]]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait(item)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _last(outputs: AsyncIterator[tuple[int, RequestOutput]], n: int) -> list[RequestOutput]:
    """The final output of each of ``n`` choices, in choice order."""
    final: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(outputs):
        async for i, out in outputs:
            final[i] = out
    return [final[i] for i in range(n)]


class OpenAIServer:
    """The endpoints, over one ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine, model_name: str, chat_template: ChatTemplate,
                 metrics_dir: str | None = None):
        self.engine, self.model_name, self.chat_template = engine, model_name, chat_template
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics(engine.stats, metrics_dir)
        self.created = int(time.time())
        self.draining = Draining(engine)

    def _check(self, req: SamplingRequest) -> None:
        if self.draining.started:
            raise APIError(503, "the server is shutting down", type="server_error")
        if req.model is not None:
            self._served(req.model)
        extra = req.model_extra or {}
        for name, off in UNSUPPORTED.items():
            value = extra.get(name)
            if value is not None and value not in off:
                raise APIError(400, f"{name}={value!r} is not supported (only {' or '.join(map(repr, off))})", name)

    async def _generate(self, index: int, prompt: Checked, params: SamplingParams, request_id: str,
                        images: MultiModalInput | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(index, output)`` for each of the engine's outputs for one request (choice number
        ``index``), timed for /metrics. Closing it aborts the request."""
        start, last, reason = time.monotonic(), None, "abort"  # unless the engine finishes it
        try:
            async with contextlib.aclosing(self.engine.generate(prompt, params, request_id, images)) as outputs:
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
                    yield index, out
        finally:
            self.metrics.finished.labels(finish_reason=reason).inc()

    def _head(self, prefix: str, object: str) -> dict:
        """id, object, created and model: the same in every chunk of a stream."""
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": object, "created": int(time.time()),
                "model": self.model_name}

    # /v1/completions

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        self._check(req)
        prompts = prompt_list(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        # echo with logprobs: the prompt's own tokens are scored too (lm-evaluation-harness)
        prompt_logprobs = req.logprobs if req.echo else None
        choices = []
        for prompt in prompts:
            valid = self.engine.check(prompt, req.sampling_params(max_tokens, req.logprobs))
            echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(valid.ids)) if req.echo else None
            choices += [(valid, req.sampling_params(max_tokens, req.logprobs, j, prompt_logprobs), echo)
                        for j in range(req.n)]
        head = self._head("cmpl", "text_completion")
        return await self._reply(req, request, choices, head, completion_chunks, completion_choice)

    async def _reply(self, req: SamplingRequest, request: Request,
                     choices: list[tuple[Checked, SamplingParams, str | None]], head: dict,
                     chunks, choice, images: MultiModalInput | None = None) -> Response:
        """Run every choice (checked prompt, engine parameters, echoed prompt text) as its own engine
        request (each with the prompt's ``images``). Stream ``chunks(...)`` as server-sent events,
        or wait for every choice and answer ``choice(...)`` for each with the usage; 499 if the
        client left first."""
        outputs = _merged([self._generate(i, prompt, params, f"{head['id']}-{i}", images)
                           for i, (prompt, params, _) in enumerate(choices)])
        echoes = [echo for _, _, echo in choices]
        if req.stream:
            return _EventStream(_sse(chunks(self.tokenizer, outputs, head, req.include_usage, req.n, echoes)))
        final = await _unless_disconnected(request, _last(outputs, len(choices)))
        if final is None:
            return Response(status_code=499)  # nobody is listening
        return JSONResponse({**head, "choices": [choice(self.tokenizer, out, i, echoes[i])
                                                 for i, out in enumerate(final)],
                             "usage": usage(final, req.n)})

    # /v1/chat/completions

    async def chat_completions(self, req: ChatCompletionRequest, request: Request) -> Response:
        self._check(req)
        if not req.messages:
            raise APIError(400, "messages is empty", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        slot = f"<openk3-image-{uuid.uuid4().hex}>"  # stands for an image in the rendered text
        parts: list[tuple] = []

        def image_slot(part, where: str) -> str:
            parts.append((part, where))
            return slot

        take_image = image_slot if self.engine.inputs.model_config.vision_config is not None else None
        messages = [{**m.model_dump(exclude_none=True), "content": message_text(m, i, take_image)}
                    for i, m in enumerate(req.messages)]
        tools = (req.model_extra or {}).get("tools")  # declared to the model by the template
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise APIError(400, "tools must be a list of tool objects", "tools")
        text = self.chat_template.render(messages, tools=tools)
        try:
            utf8_text(text, "messages")
        except InvalidRequest as e:
            raise APIError(400, f"messages: {e.message}", "messages") from e
        images = None
        if parts:  # decoding and packing images is CPU work: off the event loop
            ids, images = await asyncio.to_thread(self._image_prompt, text, slot, parts)
        else:
            ids = self.tokenizer.encode(text)
        limit = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # the rest of the context, within the engine's limit
            inputs = self.engine.inputs
            max_tokens = max(1, min(inputs.max_model_len - len(ids), inputs.config.max_tokens_limit))
        if max_tokens < 1:
            raise APIError(400, f"{limit}: {max_tokens} must be >= 1", limit)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:
            valid = self.engine.check(ids, req.sampling_params(max_tokens, logprobs), images)
        except InvalidRequest as e:  # name the chat request's fields, not the engine's
            param = {"prompt": "messages", "max_tokens": limit, "logprobs": "top_logprobs"}.get(e.param, e.param)
            raise APIError(400, f"{param}: {e.message}", param) from e
        head = self._head("chatcmpl", "chat.completion.chunk" if req.stream else "chat.completion")
        choices = [(valid, req.sampling_params(max_tokens, logprobs, j), None) for j in range(req.n)]
        return await self._reply(req, request, choices, head, chat_chunks, chat_choice, images)

    def _image_prompt(self, text: str, slot: str, parts: list[tuple]) -> tuple[list[int], MultiModalInput]:
        """The prompt ids of rendered chat ``text`` whose ``slot``s stand for the image ``parts``
        ((content part, where) in order) and the packed images: each slot becomes the image's
        block (``image_prompt_ids``, the release's format), its placeholders expanded."""
        inputs = self.engine.inputs
        pad = inputs.vision_config.media_placeholder_token_id
        pics = [image_from_part(part, where, inputs.config.max_image_bytes) for part, where in parts]
        encode = self.tokenizer.encode
        blocks = [image_prompt_ids(functools.partial(special_token_id, self.tokenizer), encode,
                                   [p.size], [1], pad) for p in pics]
        try:
            return inputs.prepare_images(encode_with_images(text, slot, blocks, encode), pics)
        except InvalidRequest as e:  # the prompt is the messages'
            raise APIError(400, f"messages: {e.message}", "messages") from e

    # The rest.

    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "openk3",
                "max_model_len": self.engine.inputs.max_model_len}

    async def models(self) -> dict:
        return {"object": "list", "data": [self._card()]}

    def _served(self, model: str) -> None:
        """A 404 naming ``model`` unless it is the served one."""
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    async def model(self, model: str) -> dict:
        self._served(model)
        return self._card()

    async def health(self) -> Response:
        if not self.engine.is_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)


def _require_api_key(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    return check


def _validation_error(e: RequestValidationError, content_type: str) -> APIError:
    """pydantic's first complaint, naming the top-level field (loc is ("body", field, ...)).
    Of a union's branches (``content``: a string or a list of parts) the deepest complaint: a
    malformed part was reported as "content.str: Input should be a valid string"."""
    errors = e.errors()
    err = errors[0]
    if err["type"] == "json_invalid":  # loc[1] is the offset
        return APIError(400, f"request body: {err['msg']} ({err.get('ctx', {}).get('error', '')})")
    err = max(errors, key=lambda x: len(x["loc"]) if x["loc"][:2] == err["loc"][:2] else 0)
    loc = tuple(p for p in err["loc"][1:] if not (isinstance(p, str) and re.fullmatch(r"\w+\[.*\]", p)))
    if not loc:
        hint = "" if "json" in content_type else " (send JSON, with 'Content-Type: application/json')"
        return APIError(400, f"request body: {err['msg']}{hint}")
    return APIError(400, f"{'.'.join(map(str, loc))}: {err['msg']}", loc[0] if isinstance(loc[0], str) else None)


def _internal_error(e: Exception) -> APIError:
    return APIError(500, f"internal error: {e!r}", type="server_error")


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
        e = _internal_error(e)
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)


_ANSWERED = (APIError, InvalidRequest, ChatTemplateError, RequestValidationError, HTTPException)


class _Route(APIRoute):
    """A route whose unexpected exceptions become a 500 ``APIError`` inside the route. Starlette
    answers an ``Exception`` handler's response from its outermost middleware and then re-raises
    the exception to the ASGI server, which closes the connection: a client's next request on that
    kept-alive connection then failed to read its answer (``tests/serve/test_server.py``,
    ``test_engine_failure_is_a_server_error``). An ``APIError`` is answered and not re-raised."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except _ANSWERED:
                raise
            except Exception as e:
                logger.exception("request failed")
                raise _internal_error(e) from e

        return route


def build_app(async_engine: AsyncEngine, model_name: str, api_key: str | None = None,
              chat_template: ChatTemplate | None = None, metrics_dir: str | None = None) -> FastAPI:
    """The HTTP app over ``async_engine``; ``chat_template`` None is ``chat.DEFAULT_CHAT_TEMPLATE``;
    ``metrics_dir``: one of several server processes' (``ServerMetrics``)."""
    server = OpenAIServer(async_engine, model_name, chat_template or ChatTemplate(), metrics_dir)
    app = FastAPI(title="openk3", summary="OpenAI-compatible API of the openk3 serving engine")
    app.router.route_class = _Route
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_require_api_key(api_key))] if api_key else [],
                   route_class=_Route)
    v1.add_api_route("/completions", server.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", server.chat_completions, methods=["POST"])
    v1.add_api_route("/models", server.models, methods=["GET"])
    v1.add_api_route("/models/{model:path}", server.model, methods=["GET"])
    app.include_router(v1)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])

    for error in (*_ANSWERED, Exception):  # Exception: what fails outside a route
        app.add_exception_handler(error, _handle_error)
    app.state.draining = server.draining
    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn, telling the app when shutdown begins (its own handling then waits for open
    connections, up to ``timeout_graceful_shutdown``, and cuts what is left). A SIGTERM that
    ended in a drained shutdown is not raised again afterwards (uvicorn would), so the process
    exits 0 and the engine is shut down properly. ``started``: called once it listens."""

    def __init__(self, config: uvicorn.Config, draining: Draining, seconds: float,
                 started: Callable[[], object] | None = None):
        super().__init__(config)
        self.draining, self.seconds, self.on_started = draining, seconds, started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig, frame) -> None:
        asyncio.get_running_loop().call_soon_threadsafe(self.draining.begin, self.seconds)
        super().handle_exit(sig, frame)
        self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]


def serve(async_engine: AsyncEngine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, chat_template: ChatTemplate | None = None,
          sockets: list[socket.socket] | None = None, started: Callable[[], object] | None = None,
          metrics_dir: str | None = None, grace: float = GRACE_SECONDS) -> None:
    """Serve until SIGTERM or Ctrl-C, then stop: responses in flight get ``grace - 1`` seconds
    to finish (then end with an error event, or a 503), uvicorn closes what is left at
    ``grace``, and the engine stops (``grace`` >= 1). ``sockets``: listen there instead of on
    ``host:port`` (an ``api_servers.py`` server process: the supervisor's socket); ``started``
    is called once it listens; ``metrics_dir``: ``ServerMetrics``'s multiprocess directory."""
    app = build_app(async_engine, model_name, api_key, chat_template, metrics_dir)
    check_grace(grace)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=grace)
    try:
        _DrainingServer(config, app.state.draining, grace - 1, started).run(sockets)
    except KeyboardInterrupt:  # uvicorn raises Ctrl-C again once it has shut down
        pass
    finally:
        async_engine.shutdown()
