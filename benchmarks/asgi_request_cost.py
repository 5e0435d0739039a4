"""What the HTTP app costs per request when a burst arrives (issue P8, the server's admission).

``serve_bench.py --parts server`` showed the server's overhead over the engine to be the time
its last request of a 64-request burst waits before the engine has it: the event loop admits
one request at a time. This script times the app's own share of that, without sockets: 64
streamed ``/v1/completions`` requests (128-id prompts, one token each) sent at once through the
ASGI interface to

- ``fastapi``: ``build_app`` as served (FastAPI's route: its body parsing, dependencies, route
  class);
- ``starlette route``: the same app with a plain Starlette route in front for the one endpoint,
  parsing the body with ``CompletionRequest.model_validate_json`` and calling the same
  ``OpenAIServer.completions``;

over ``server_host_bench._Replay`` answering one token at once (``openk3``'s handler, checks and
SSE body run; no model). Best of ``--repeats`` bursts, microseconds per request of the event loop. uvicorn's HTTP
parsing and socket writes come on top (``server_host_bench.py`` measures the whole server).

Run: ``python -m benchmarks.asgi_request_cost [--repeats 7]`` (CPU only).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import time
from array import array

from benchmarks.server_host_bench import _Replay
from openk3.serve.chat import ChatTemplate
from openk3.serve.protocol import CompletionRequest
from openk3.serve.server import OpenAIServer, build_app


def _request(app, body: bytes):
    async def one() -> int:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
        given = False

        async def receive():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)  # the client stays: no disconnect

        status = []

        async def send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await app(scope, receive, send)
        return status[0]

    return one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--burst", type=int, default=64)
    args = ap.parse_args()
    engine = _Replay(new=1)
    server = OpenAIServer(engine, "bench", ChatTemplate())

    async def completions(request):
        return await server.completions(CompletionRequest.model_validate_json(await request.body()), request)

    from starlette.routing import Route

    lean = build_app(engine, "bench")
    lean.router.routes.insert(0, Route("/v1/completions", completions, methods=["POST"]))
    apps = {"fastapi": build_app(engine, "bench"), "starlette route": lean}
    rng = random.Random(0)
    body = json.dumps({"prompt": array("q", (rng.randrange(3, 200) for _ in range(128))).tolist(),
                       "max_tokens": 1, "temperature": 0, "stream": True}).encode()
    loop = asyncio.new_event_loop()
    for name, app in apps.items():
        one = _request(app, body)

        async def burst() -> tuple[float, list[int]]:
            t = time.perf_counter()
            statuses = await asyncio.gather(*(one() for _ in range(args.burst)))
            return time.perf_counter() - t, statuses

        loop.run_until_complete(burst())  # imports, first-call caches
        best = float("inf")
        for _ in range(args.repeats):
            gc.collect()
            seconds, statuses = loop.run_until_complete(burst())
            if set(statuses) != {200}:
                raise RuntimeError(f"{name}: statuses {sorted(set(statuses))}")
            best = min(best, seconds)
        print(f"{name:16s} {1e6 * best / args.burst:6.0f} us per request (best of {args.repeats} bursts of "
              f"{args.burst})", flush=True)


if __name__ == "__main__":
    main()
