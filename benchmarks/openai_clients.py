"""Streaming clients for the server benchmarks (``serve_bench.py --parts server``,
``server_host_bench.py``), in processes of their own.

Why several processes: the official ``openai`` client costs ~220-330 us of CPU per SSE chunk
(its SSE decoder, JSON and pydantic parsing; measured in ``server_host_bench.py``), and the
threads of one process share one GIL. 64 streams x 128 tokens are 8,192 chunks, so one client
process cannot take them faster than ~1.8-2.7 s whatever the server does: a benchmark with one
client process measures the client. ``procs`` processes, each with its share of the streams
(every ``procs``-th prompt), lift that bound where the machine has the cores (the device host
has 16); ``client_cpu_max_s`` (the busiest process's CPU over the round) shows how close a
round came to it.

Kinds: ``threads``, ``openai.OpenAI`` with one thread per stream (what users write);
``async``, one ``openai.AsyncOpenAI`` task per stream; ``raw``, plain HTTP over asyncio
sockets that only counts the chunks (a client that takes little CPU).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time

KINDS = ("threads", "async", "raw")


def _round_fn(port: int, prompts: list[list[int]], kind: str, sent: list):
    """A function ``round_(max_tokens) -> chunks with text`` that streams every prompt at once;
    it appends ``(prompt[:4], time.perf_counter())`` to ``sent`` as each request is made (Linux's
    ``perf_counter`` is the system's monotonic clock: comparable across processes)."""
    import concurrent.futures

    import openai

    url = f"http://127.0.0.1:{port}/v1"
    if kind == "threads":
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        pool = concurrent.futures.ThreadPoolExecutor(len(prompts))

        def one(ids: list[int], max_tokens: int) -> int:
            sent.append((ids[:4], time.perf_counter()))
            stream = client.completions.create(model="bench", prompt=ids, max_tokens=max_tokens,
                                               temperature=0, stream=True)
            return sum(1 for c in stream if c.choices and c.choices[0].text)

        return lambda max_tokens: sum(pool.map(lambda ids: one(ids, max_tokens), prompts))
    loop = asyncio.new_event_loop()
    if kind == "raw":
        async def one_raw(ids: list[int], max_tokens: int) -> int:
            sent.append((ids[:4], time.perf_counter()))
            body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True})
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json"
                         f"\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n{body}".encode())
            data = b""
            while chunk := await reader.read(1 << 16):
                data += chunk
            writer.close()
            if not data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                raise RuntimeError(f"the stream did not end with [DONE]: ...{data[-200:]!r}")
            return data.count(b'"text": "') - data.count(b'"text": ""')

        async def all_raw(max_tokens: int) -> int:
            return sum(await asyncio.gather(*(one_raw(ids, max_tokens) for ids in prompts)))

        return lambda max_tokens: loop.run_until_complete(all_raw(max_tokens))
    aclient = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)

    async def one_async(ids: list[int], max_tokens: int) -> int:
        sent.append((ids[:4], time.perf_counter()))
        stream = await aclient.completions.create(model="bench", prompt=ids, max_tokens=max_tokens,
                                                  temperature=0, stream=True)
        return sum([1 async for c in stream if c.choices and c.choices[0].text])

    async def all_async(max_tokens: int) -> int:
        return sum(await asyncio.gather(*(one_async(ids, max_tokens) for ids in prompts)))

    return lambda max_tokens: loop.run_until_complete(all_async(max_tokens))


def _client_main(port: int, prompts: list[list[int]], new: int, kind: str, conn) -> None:
    """One client process: a warm-up round of 8 tokens, then a timed round per "go"; answers
    (chunks with text, this process's CPU seconds, when each request was made) or the error's
    text."""
    try:
        sent: list = []
        round_ = _round_fn(port, prompts, kind, sent)
        round_(8)  # connections, imports, the server's first requests
        conn.send("ready")
        while conn.recv() == "go":
            sent.clear()
            cpu = time.process_time()
            chunks = round_(new)
            conn.send((chunks, time.process_time() - cpu, list(sent)))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(f"error: {type(e).__name__}: {e}")


class Clients:
    """``procs`` client processes streaming ``prompts`` (each its every ``procs``-th prompt) to
    the server on ``port``; ``round()`` runs one timed round of ``new`` tokens per stream.

    Example (with a server listening on ``port``)::

        with Clients(port, prompts, new=128, kind="threads", procs=8) as clients:
            row = clients.round()   # {"seconds", "start", "sent", "chunks", "client_cpu_s", ...}
    """

    def __init__(self, port: int, prompts: list[list[int]], new: int, kind: str = "threads", procs: int = 1):
        if kind not in KINDS:
            raise ValueError(f"client kind {kind!r}: choose one of {KINDS}")
        if not 1 <= procs <= len(prompts):
            raise ValueError(f"client processes: {procs}, for {len(prompts)} streams (1 .. streams)")
        ctx = multiprocessing.get_context("spawn")
        self._conns, self._procs = [], []
        try:
            for i in range(procs):
                conn, child = ctx.Pipe()
                p = ctx.Process(target=_client_main, args=(port, prompts[i::procs], new, kind, child),
                                daemon=True)
                p.start()
                self._conns.append(conn)
                self._procs.append(p)
            for conn in self._conns:
                self._check(conn.recv(), "ready")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check(msg, expected: str | None = None):
        if isinstance(msg, str) and msg.startswith("error: "):
            raise RuntimeError(f"a client process failed: {msg[7:]}")
        if expected is not None and msg != expected:
            raise RuntimeError(f"a client process answered {msg!r}, expected {expected!r}")
        return msg

    def round(self) -> dict:
        """One round: every process starts at once; seconds from the first "go" to the last
        answer, its ``start`` (``time.perf_counter()`` at the first "go"), ``sent`` (each
        request's first four ids and when it was made), chunks with text, the CPU of all client
        processes and of the busiest."""
        t = time.perf_counter()
        for conn in self._conns:
            conn.send("go")
        answers = [self._check(conn.recv()) for conn in self._conns]
        seconds = time.perf_counter() - t
        return {"seconds": seconds, "start": t, "sent": [x for a in answers for x in a[2]],
                "chunks": sum(a[0] for a in answers),
                "client_cpu_s": sum(a[1] for a in answers), "client_cpu_max_s": max(a[1] for a in answers),
                "client_procs": len(self._conns)}

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send("stop")
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
