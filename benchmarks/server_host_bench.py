"""Host overhead of the OpenAI server over the engine, on the CPU, with the model work removed.

The same ``--streams`` requests (``--prompt-len``-token prompts, ``--new`` greedy tokens each)
go through these paths over an ``LLMEngine`` of the ``debug`` preset whose model runner is
stubbed: ``execute`` skips the forward pass and returns logits that make greedy sampling pick a
pre-made token (printable ASCII, so every token is one character of text and one SSE chunk),
after sleeping ``--gpu-ms`` with the GIL released, as the engine thread waits on the GPU:

- ``engine``: ``LLMEngine.generate`` (what ``serve_bench.py --parts server`` compares against);
- ``async``: ``AsyncEngine.generate``, one asyncio consumer per request in this process;
- ``app alone``: ``OpenAIServer.completions``' SSE body over a stand-in engine that replays
  pre-made outputs at once (no engine thread, no HTTP): the app's own CPU per event;
- ``app without HTTP``: the same SSE bodies over the stubbed ``AsyncEngine``;
- ``server``: ``build_app`` under ``uvicorn.Server.run`` on a real local socket (uvicorn picks its
  HTTP implementation and loop as for ``openk3 serve`` and ``part_server``: httptools and uvloop
  if installed, else h11 and asyncio), the clients in ``--client-procs`` spawned processes
  (``benchmarks/openai_clients.py``): ``--client threads`` is ``part_server``'s client
  (``openai.OpenAI``, one thread per stream), ``--client async`` one ``openai.AsyncOpenAI`` task
  per stream, ``--client raw`` plain HTTP over asyncio sockets that only counts the chunks (a
  client that takes few of the machine's cores from the server).

Measured: wall seconds of each path (best of ``--repeats``), server over engine and over async,
wall and CPU microseconds per SSE chunk; per server round the CPU seconds of the engine thread,
of the event-loop thread and of the client process (the client's SSE, JSON and pydantic parsing
is counted apart from the server's work), and the engine's own step walls under the server
against alone (how much the server's GIL use slows the engine); with ``--profile`` a cProfile
top list of the event-loop thread in one more round.

Not measured: model or GPU work (the engine's own host work per step, scheduling, sampling a
[B, vocab] tensor, detokenizing, is what is left on the engine side; ``--gpu-ms`` only models
the GIL-free wait); the device host's CPU, which is faster than a shared 2-core machine's;
network beyond loopback. On a small shared machine the client process competes with the server
for cores and the wall times vary from run to run: compare CPU per chunk, and runs on one
machine, interleaved.

Run: ``python -m benchmarks.server_host_bench [--gpu-ms 6] [--client threads|async|raw]
[--client-procs N] [--switch-interval S] [--http auto|h11|httptools] [--loop auto|asyncio|uvloop] [--profile]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import socket
import sys
import threading
import time

import torch

from benchmarks.openai_clients import KINDS, Clients
from openk3 import build_model, preset
from openk3.serve.config import EngineConfig
from openk3.serve.engine import AsyncEngine, LLMEngine
from openk3.serve.model_runner import StepResult
from openk3.serve.sampler import SamplingParams
from openk3.tokenizer import ByteTokenizer

TEXT = [ord(c) for c in "the quick brown fox jumps over the lazy dog, "]  # the pre-made tokens


def stub_engine(model, streams: int, gpu_ms: float) -> LLMEngine:
    """An engine whose runner does no model work: the logits of each sampled sequence are one-hot
    at ``TEXT[number of tokens so far % len(TEXT)]``; each step first sleeps ``gpu_ms``
    milliseconds, the GIL released, as the engine thread waits on the GPU on the device."""
    eng = LLMEngine(model, ByteTokenizer(), EngineConfig(max_num_seqs=streams, max_model_len=1024,
                                                         cuda_graphs=False), eos_token_ids=())
    vocab = model.cfg.vocab_size

    def execute(out, draft_tokens=None) -> StepResult:
        if gpu_ms:
            time.sleep(gpu_ms / 1e3)
        sampled = [s for s, _ in out.scheduled if s.num_computed_tokens == s.num_tokens]
        logits = torch.zeros(len(sampled), vocab)
        logits[torch.arange(len(sampled)), [TEXT[s.num_tokens % len(TEXT)] for s in sampled]] = 1.0
        return StepResult(logits, sampled=sampled)

    eng.runner.execute = execute
    step, eng.step_times = eng._step, []

    def timed_step(stream):
        t = time.perf_counter()
        outs = step(stream)
        eng.step_times.append((t, time.perf_counter()))
        return outs

    # the engine's steps, (start, end): how much the server slows them (``step`` and
    # ``generate`` both run ``_step``)
    eng._step = timed_step
    return eng


def engine_span(steps: list[tuple[float, float]]) -> dict:
    """Wall seconds from the first step's start to the last one's end, and the steps' own."""
    return {"engine_span_s": steps[-1][1] - steps[0][0], "engine_steps_s": sum(b - a for a, b in steps)}


def prompts(streams: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(32, 127, (prompt_len,), generator=g).tolist() for _ in range(streams)]


def time_engine(model, ps: list[list[int]], new: int, gpu_ms: float) -> tuple[float, dict]:
    eng = stub_engine(model, len(ps), gpu_ms)
    eng.generate(ps, SamplingParams(temperature=0, max_tokens=8))  # warm-up
    eng.step_times.clear()
    t = time.perf_counter()
    outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=new))
    s = time.perf_counter() - t
    assert all(len(o.token_ids) == new for o in outs)
    return s, engine_span(eng.step_times)


def time_async(model, ps: list[list[int]], new: int, gpu_ms: float) -> tuple[float, int]:
    """Seconds for all requests through ``AsyncEngine`` consumed in one event loop, and the
    outputs that carried text."""
    ae = AsyncEngine(stub_engine(model, len(ps), gpu_ms))

    async def one(i: int, ids: list[int], max_tokens: int, tag: str) -> int:
        n = 0
        async for out in ae.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens), f"{tag}-{i}"):
            n += bool(out.delta_text)
        return n

    async def run(max_tokens: int, tag: str) -> int:
        return sum(await asyncio.gather(*(one(i, ids, max_tokens, tag) for i, ids in enumerate(ps))))

    try:
        asyncio.run(run(8, "warm"))
        t = time.perf_counter()
        n = asyncio.run(run(new, "timed"))
        return time.perf_counter() - t, n
    finally:
        ae.shutdown()


def time_app(model, ps: list[list[int]], new: int, gpu_ms: float) -> tuple[float, int, float]:
    """Seconds for all requests through the app's streaming path without HTTP (the body iterator
    of ``OpenAIServer.completions``' response, consumed in one event loop), the SSE events, and
    the CPU seconds of the event-loop thread."""
    from openk3.serve.chat import ChatTemplate
    from openk3.serve.protocol import CompletionRequest
    from openk3.serve.server import OpenAIServer

    ae = AsyncEngine(stub_engine(model, len(ps), gpu_ms))
    app = OpenAIServer(ae, "bench", ChatTemplate())

    async def one(ids: list[int], max_tokens: int) -> int:
        req = CompletionRequest(prompt=ids, max_tokens=max_tokens, temperature=0.0, stream=True)
        response = await app.completions(req, None)
        return sum([1 async for _ in response.body_iterator])

    async def run(max_tokens: int) -> int:
        return sum(await asyncio.gather(*(one(ids, max_tokens) for ids in ps)))

    try:
        asyncio.run(run(8))
        t, cpu = time.perf_counter(), time.thread_time()
        n = asyncio.run(run(new))
        return time.perf_counter() - t, n, time.thread_time() - cpu
    finally:
        ae.shutdown()


class _Replay:
    """An ``AsyncEngine`` stand-in that checks a prompt as the engine's ``RequestInputs`` does
    and replays ``new`` pre-made outputs at once (no thread, no model): what is left of a
    stream's time is the app's own work per event. Also ``asgi_request_cost.py``'s engine."""

    model_name, is_alive = "bench", True

    def __init__(self, new: int):
        from openk3.serve.engine import EngineStats
        from openk3.serve.inputs import RequestInputs

        self.inputs = RequestInputs(ByteTokenizer(), preset("debug"), EngineConfig(), 1024)
        self.tokenizer, self.stats, self.new = self.inputs.tokenizer, EngineStats, new

    def check(self, prompt, params, images=None):
        return self.inputs.checked(prompt, params, images)

    def fail_all(self, error) -> None:
        pass

    async def generate(self, prompt, params, request_id, images=None):
        from openk3.serve.engine import RequestOutput

        ids = prompt.ids
        for k in range(1, self.new + 1):
            last = k == self.new
            yield RequestOutput(request_id, ids, [97] * k, "a" * k, [97], "a", None, last,
                                "length" if last else None)


def time_app_replay(ps: list[list[int]], new: int, repeats: int) -> float:
    """CPU microseconds per SSE event of the app alone (``OpenAIServer.completions``' body
    iterator over ``_Replay``), best of ``repeats``."""
    from openk3.serve.chat import ChatTemplate
    from openk3.serve.protocol import CompletionRequest
    from openk3.serve.server import OpenAIServer

    app = OpenAIServer(_Replay(new), "bench", ChatTemplate())

    async def run() -> int:
        n = 0
        for ids in ps:
            req = CompletionRequest(prompt=ids, max_tokens=new, temperature=0.0, stream=True)
            n += sum([1 async for _ in (await app.completions(req, None)).body_iterator])
        return n

    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()  # CPU time: other processes on the machine do not count
        n = asyncio.run(run())
        best = min(best, (time.thread_time() - t) / n)
    return 1e6 * best


def _thread_cpu(native_id: int) -> float:
    """CPU seconds of one thread of this process (utime + stime, /proc)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_server(model, ps: list[list[int]], new: int, client: str, repeats: int, profile: bool,
                gpu_ms: float, http: str = "auto", loop: str = "auto",
                client_procs: int = 1) -> tuple[list[dict], str | None]:
    """``repeats`` timed rounds through the server (and with ``profile`` one more, profiled);
    ``http`` and ``loop`` are uvicorn's (``auto``: httptools and uvloop when installed); the
    streams are shared among ``client_procs`` client processes (``benchmarks/openai_clients.py``)."""
    import uvicorn

    from openk3.serve.server import build_app

    ae = AsyncEngine(stub_engine(model, len(ps), gpu_ms))
    server = uvicorn.Server(uvicorn.Config(build_app(ae, "bench"), log_level="warning", http=http, loop=loop))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    prof = cProfile.Profile() if profile else None
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()  # as part_server runs it: uvicorn picks its loop (uvloop if installed)
    while not server.started:
        time.sleep(0.02)
    loop = server.servers[0].get_loop()
    loop_tid = thread.native_id
    rounds = repeats + profile
    rows = []
    try:
        with Clients(sock.getsockname()[1], ps, new, client, client_procs) as clients:
            for r in range(rounds):
                if prof is not None and r == rounds - 1:  # profile the extra last round only
                    asyncio.run_coroutine_threadsafe(_enable(prof), loop).result()
                ae.engine.step_times.clear()
                cpu = time.process_time()
                engine_cpu, loop_cpu = _thread_cpu(ae._thread.native_id), _thread_cpu(loop_tid)
                row = clients.round()
                for key in ("start", "sent"):  # serve_bench's arrival times, not reported here
                    del row[key]
                rows.append({"server_s": row.pop("seconds"), **row,
                             "server_process_cpu_s": time.process_time() - cpu,
                             "engine_thread_cpu_s": _thread_cpu(ae._thread.native_id) - engine_cpu,
                             "event_loop_cpu_s": _thread_cpu(loop_tid) - loop_cpu,
                             **engine_span(ae.engine.step_times)})
                if prof is not None and r == rounds - 1:
                    asyncio.run_coroutine_threadsafe(_disable(prof), loop).result()
    finally:
        server.should_exit = True
        ae.shutdown()
    report = None
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        report = out.getvalue()
    return rows, report


async def _enable(prof: cProfile.Profile) -> None:
    prof.enable()  # profiles the thread that runs this: the server's event loop


async def _disable(prof: cProfile.Profile) -> None:
    prof.disable()


def _installed(name: str) -> str | None:
    import importlib.util

    return name if importlib.util.find_spec(name) is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--client", choices=KINDS, default="threads",
                    help="raw: plain HTTP over asyncio sockets, no SSE parsing (a client that costs little)")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="client processes sharing the streams (one process's GIL bounds the openai client)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu-ms", type=float, default=0.0,
                    help="sleep per engine step, the GIL released: the device's GPU time (0: none)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval of the server process (default: CPython's 0.005 s)")
    ap.add_argument("--profile", action="store_true", help="cProfile the event loop in the last round")
    ap.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto",
                    help="uvicorn's HTTP implementation (auto, as openk3 serve: httptools when installed)")
    ap.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                    help="uvicorn's event loop (auto, as openk3 serve: uvloop when installed)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    model = build_model(preset("debug"), seed=0).eval()
    ps = prompts(args.streams, args.prompt_len)
    engine_s, engine_steps = min(time_engine(model, ps, args.new, args.gpu_ms) for _ in range(args.repeats))
    async_s, async_chunks = min(time_async(model, ps, args.new, args.gpu_ms) for _ in range(args.repeats))
    replay_us = time_app_replay(ps, args.new, 2 * args.repeats)
    app_s, app_events, app_cpu = min(time_app(model, ps, args.new, args.gpu_ms) for _ in range(args.repeats))
    rows, report = time_server(model, ps, args.new, args.client, args.repeats, args.profile, args.gpu_ms,
                               args.http, args.loop, args.client_procs)
    best = min(rows[:args.repeats], key=lambda r: r["server_s"])  # the profiled round is slower
    chunks = best["chunks"]
    print(f"{args.streams} streams x {args.new} tokens, client {args.client}, gpu_ms {args.gpu_ms}, "
          f"switch interval {sys.getswitchinterval()} s, {os.cpu_count()} CPUs, uvicorn http "
          f"{args.http if args.http != 'auto' else _installed('httptools') or 'h11'}, loop "
          f"{args.loop if args.loop != 'auto' else _installed('uvloop') or 'asyncio'}, "
          f"{args.client_procs} client process(es)")
    print(f"engine (LLMEngine.generate): {engine_s:.3f} s")
    print(f"async (AsyncEngine.generate): {async_s:.3f} s, {async_chunks} text outputs")
    print(f"app alone (replayed outputs, no engine, no HTTP): {replay_us:.2f} us/event")
    print(f"app without HTTP (OpenAIServer.completions' SSE body): {app_s:.3f} s, {app_events} events, "
          f"event loop CPU {app_cpu:.3f} s ({1e6 * app_cpu / app_events:.1f} us/event)")
    print(f"server ({args.client} client): {best['server_s']:.3f} s, {chunks} text chunks; "
          f"server/engine {best['server_s'] / engine_s:.2f}x, server/async {best['server_s'] / async_s:.2f}x")
    print(f"engine steps (sum of step walls): direct {engine_steps['engine_steps_s']:.3f} s, under the "
          f"server {best['engine_steps_s']:.3f} s; the server's engine span (first step to last) "
          f"{best['engine_span_s']:.3f} s of its {best['server_s']:.3f} s")
    print(f"wall per chunk: server {1e6 * best['server_s'] / chunks:.1f} us, "
          f"engine {1e6 * engine_s / chunks:.1f} us")
    print(f"CPU (best round): server process {best['server_process_cpu_s']:.2f} s "
          f"({1e6 * best['server_process_cpu_s'] / chunks:.1f} us/chunk): engine thread "
          f"{best['engine_thread_cpu_s']:.2f} s, event loop {best['event_loop_cpu_s']:.2f} s "
          f"({1e6 * best['event_loop_cpu_s'] / chunks:.1f} us/chunk); client processes "
          f"{best['client_cpu_s']:.2f} s ({1e6 * best['client_cpu_s'] / chunks:.1f} us/chunk; the busiest "
          f"{best['client_cpu_max_s']:.2f} s)")
    print("all rounds:", [{k: round(v, 3) for k, v in r.items()} for r in rows])
    if report is not None:
        print("cProfile of the event-loop thread (last round), by own time:")
        print(report)


if __name__ == "__main__":
    main()
